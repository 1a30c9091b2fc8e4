"""A decision maker wrapped from outside: how an instrument times or logs a policy's calls
without patching the policy or its class.

`DelegatingDecisions(inner)` is itself a decision maker (`workers.decisions.DecisionMaker`): its
`before_draft`, `after_draft` and `observe` call the inner one's, and every other attribute read
(the declarations `reads_draft_features` and `reads_suffix`, read every step; `name`, `stats()`;
a baseline's `apply`) is the inner one's, so the engine and `adapt.bench.live.run_live` see the
same decisions and the same reports. A subclass overrides the three calls to look at them;
`TimedDecisions` times them.
"""

from __future__ import annotations

import time

CALLS = ("before_draft", "after_draft", "observe")  # the decision interface's three calls per step


class DelegatingDecisions:
    """``inner``'s decisions, unchanged; subclasses look at the three calls (module docstring)."""

    def __init__(self, inner):
        self.inner = inner

    def before_draft(self, rows):
        return self.inner.before_draft(rows)

    def after_draft(self, rows, intent, draft):
        return self.inner.after_draft(rows, intent, draft)

    def observe(self, record) -> None:
        return self.inner.observe(record)

    def __getattr__(self, name: str):
        # asked only for what the wrapper itself lacks: the inner decision maker's attributes
        if name == "inner":  # not set yet (a copy under construction): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class TimedDecisions(DelegatingDecisions):
    """``inner``'s three calls timed (wall seconds, `time.perf_counter`) and counted: `seconds`
    and `calls` by call name (`CALLS`); `reset()` zeroes them (after a warm-up run)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(CALLS, 0.0)
        self.calls = dict.fromkeys(CALLS, 0)

    def _timed(self, name: str, call, *args):
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1

    def before_draft(self, rows):
        return self._timed("before_draft", self.inner.before_draft, rows)

    def after_draft(self, rows, intent, draft):
        return self._timed("after_draft", self.inner.after_draft, rows, intent, draft)

    def observe(self, record) -> None:
        return self._timed("observe", self.inner.observe, record)

    def ms_per_step(self, steps: int) -> dict:
        """{call: ms per decode step} over ``steps`` decode steps, for the calls that ran."""
        n = max(steps, 1)
        return {name: round(1e3 * s / n, 4) for name, s in self.seconds.items() if self.calls[name]}
