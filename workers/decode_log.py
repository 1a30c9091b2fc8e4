"""What each decode step of a request did, counted: the request's `decode_stats`.

A **decode step** of a request is one target pass after its prefill (the prefill's pass emits its
first token and drafts nothing). Per step the engine records the row's draft source
(workers/draft_sources.py), the diffusion steps s it drafted with (0 for other sources), the drafted tokens k it verified, the
acceptance rule, how many drafts the target accepted, and whether a pinned knob had to be cut
(workers/pins.py). `DecodeLog.summary` turns the counts into the JSON the engine API, the CLI and
the HTTP API report (docs/serving.md, "Per-request decode pins", defines every field).
"""

from __future__ import annotations

from collections import Counter

from kernels.rules import Rule, rule_name
from workers import draft_sources

CLAMP_REASONS = ("tokens_left", "draft", "block")


def source_name(source: int, draft_len: int) -> str:
    """A row's draft source in a step, by name ('diffusion', 'suffix', ...): the source of code
    ``source``, or 'none' where the step verified nothing."""
    return "none" if draft_len <= 0 else draft_sources.by_code(source).name


def _mode(counts: dict, skip_zero: bool = False) -> int:
    """The most frequent key (ties: the largest; key 0 left out with `skip_zero`); 0 for none."""
    best, top = 0, 0
    for key, n in counts.items():
        if (n > top or (n == top and key > best)) and not (skip_zero and key == 0):
            best, top = key, n
    return best


class DecodeLog:
    """Counts over a request's decode steps (see the module docstring)."""

    def __init__(self, pins: tuple = (), block_clamps: int = 0):
        self.steps = 0
        self.diffusion = Counter()   # s -> decode steps drafted by diffusion in s passes
        self.draft_len = Counter()   # k -> decode steps that verified k drafted tokens
        self.rules = Counter()       # rule id -> decode steps that verified drafts with it
        self.sources = Counter()     # source name ('diffusion' | 'suffix' | 'none' | ...) -> decode steps
        self.verified = Counter()    # source -> drafted tokens verified
        self.accepted = Counter()    # source -> drafted tokens accepted
        self.clamps = Counter({"block": block_clamps})
        self.pins = dict(pins)
        self.last = (0, 0, 0, int(Rule.GREEDY))  # (source, s, k, rule) of the latest decode step

    def record(self, source: int, steps: int, draft_len: int, rule: int, accepted: int, clamp: str | None = None) -> None:
        """Count one decode step of source code ``source`` in ``steps`` diffusion passes (0 for
        other sources); `clamp`: why a pinned knob was cut this step (`CLAMP_REASONS`)."""
        self.steps += 1
        self.last = (source, steps, draft_len, rule)
        if steps > 0:
            self.diffusion[steps] += 1
        self.draft_len[draft_len] += 1
        src = source_name(source, draft_len)
        self.sources[src] += 1
        if draft_len > 0:
            self.rules[rule] += 1
            self.verified[src] += draft_len
            self.accepted[src] += accepted
        if clamp is not None:
            self.clamps[clamp] += 1

    def used(self) -> dict:
        """The summary fields `steps_used`, `draft_len_used`, `source_used`, `rules_used`."""
        sources = [s for s, n in self.verified.items() if n > 0]
        rule = _mode(self.rules) if self.rules else self.last[3]
        return {"steps_used": _mode(self.diffusion), "draft_len_used": _mode(self.draft_len, skip_zero=True),
                "source_used": "none" if not sources else sources[0] if len(sources) == 1 else "mixed",
                "rules_used": rule_name(rule)}

    def last_step(self) -> dict:
        source, s, k, rule = self.last
        return {"steps": s, "draft_len": k, "source": source_name(source, k), "rule": rule_name(rule)}

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "diffusion_steps": {str(s): n for s, n in self.diffusion.items()},
            "draft_len": {str(k): n for k, n in self.draft_len.items()},
            "source": dict(self.sources),
            "rules": {rule_name(r): n for r, n in self.rules.items()},
            "verified": dict(self.verified),
            "accepted": {src: self.accepted[src] for src in self.verified},
            "pins": dict(self.pins),
            "pin_clamps": {r: self.clamps[r] for r in CLAMP_REASONS},
        }
