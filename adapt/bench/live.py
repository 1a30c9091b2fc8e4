"""Live policy runs: a closed-loop load generator around the real `Engine`.

`run_live(engine, policy, scenario, prompts)` keeps ``scenario.concurrency`` requests in flight
(a finished request is replaced by the next one), with each request's `RequestTargets` passed to
the engine, and measures what a client sees: tokens, wall time, per-request TPOT (time between its
first and last token divided by the tokens after the first) and TTFT, TVD spent and τ from the
engine's per-request stats, the policy's own decision time, and where the rows' drafts came from
(``source_share``: the share of decode row-steps that verified no draft, a diffusion draft or a
suffix draft). ``prefill_stall_share`` is the share of the requests' time between their first
and last tokens spent waiting for other requests' prefills (`Engine.prefill_seconds`), and
``sla_attainment_without_stalls`` the attainment had those waits not counted; ``per_request``
lists each finished request's target, TPOT, TTFT, stall per token and tokens; ``deferred_steps``
counts the steps whose admission (`EngineConfig.admission`) left a request waiting by a free
slot. `collect_traces` runs the `explore` policy the same way with a trace sink, which is how the
bench gets replayable traces.

`KnobsBaseline` is a decision maker with fixed knobs for every row (the engine's own
`StaticDecisions` on them): ``KnobsBaseline("ar", draft_len=0)`` never drafts,
``KnobsBaseline("suffix", source="suffix", draft_len=engine.width)`` drafts every row from the
suffix drafter (workers/suffix.py) where it has a draft. `run_live` gives the requests these knobs,
and the same object runs in the trace replay (`adapt.replay`; suffix drafts cannot be replayed).

The suffix drafter remembers finished outputs (its global index): `run_live` starts every run
with an empty one (``fresh_suffix=True``), so that no run copies what an earlier run produced for
the same prompts.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from adapt.replay import Scenario


class KnobsBaseline:
    """Fixed knobs for every row (``DecodeKnobs`` fields as keywords: ``draft_len``, ``steps``,
    ``source``), each row keeping its own quality and commit order; decisions by
    `workers.decisions.StaticDecisions` on those knobs, timed like a `policies.base.Policy`."""

    reads_draft_features = False

    def __init__(self, name: str, **knobs):
        from workers.decisions import StaticDecisions
        from workers.request import DecodeKnobs

        allowed = {f.name for f in dataclasses.fields(DecodeKnobs)} - {"quality", "commit_order"}
        bad = sorted(set(knobs) - allowed)
        if bad:
            raise ValueError(f"KnobsBaseline: {bad[0]!r} is not a knob it fixes (one of {sorted(allowed)})")
        DecodeKnobs(**knobs)  # validates the values
        self.name, self.knobs = name, dict(knobs)
        self.reads_suffix = knobs.get("source") == "suffix"
        self._static = StaticDecisions()
        self._mapped: dict = {}
        self.decision_s, self.steps_decided = 0.0, 0

    def apply(self, knobs):
        """A request's knobs with this baseline's fixed ones."""
        out = self._mapped.get(knobs)
        if out is None:
            out = self._mapped[knobs] = dataclasses.replace(knobs, **self.knobs)
        return out

    def _rows(self, rows):
        return dataclasses.replace(rows, knobs=[self.apply(k) for k in rows.knobs])

    def before_draft(self, rows):
        t0 = time.thread_time()
        intent = self._static.before_draft(self._rows(rows))
        self.decision_s += time.thread_time() - t0
        self.steps_decided += 1
        return intent

    def after_draft(self, rows, intent, draft):
        t0 = time.thread_time()
        dec = self._static.after_draft(self._rows(rows), intent, draft)
        self.decision_s += time.thread_time() - t0
        return dec

    def observe(self, record) -> None:
        return None

    def stats(self) -> dict:
        return {"policy": self.name, "steps_decided": self.steps_decided,
                "decision_ms_per_step": 1e3 * self.decision_s / max(self.steps_decided, 1)}


def reset_suffix_memory(engine) -> None:
    """Forget the outputs the engine's suffix drafter remembers (a no-op without one)."""
    if getattr(engine, "suffix", None) is not None:
        engine.suffix.forget_outputs()


def run_live(engine, policy, scenario: Scenario, prompts: list[list[int]], *, seed: int = 0,
             trace_sink=None, fresh_suffix: bool = True) -> dict:
    """Serve ``scenario`` through ``engine`` with ``policy`` deciding; returns metrics.

    A policy with an ``apply(knobs)`` method (`KnobsBaseline`) sets the requests' knobs;
    ``fresh_suffix``: start with an empty suffix-drafter memory (see the module docstring)."""
    run = LiveRun(engine, policy, scenario, prompts, seed=seed, trace_sink=trace_sink, fresh_suffix=fresh_suffix)
    while not run.done:
        run.tick()
    return run.metrics()


class LiveRun:
    """One closed-loop run of `run_live`, advanced one engine step at a time (`tick`), so that
    several runs can take turns on one machine (adapt/bench/interleave.py). Every time is read from
    ``engine.clock`` (seconds)."""

    def __init__(self, engine, policy, scenario: Scenario, prompts: list[list[int]], *, seed: int = 0,
                 trace_sink=None, fresh_suffix: bool = True):
        if engine.has_unfinished():
            raise RuntimeError("run_live: the engine still has requests")
        if fresh_suffix:
            reset_suffix_memory(engine)
        engine.decisions = policy
        engine.trace_sink = trace_sink
        self.engine, self.policy, self.scenario, self.prompts, self.seed = engine, policy, scenario, prompts, seed
        self.queue = deque(enumerate(scenario.requests))
        self.live: dict[str, dict] = {}
        self.finished: list[dict] = []
        self.sources = {"none": 0, "diffusion": 0, "suffix": 0}
        self.tag = f"{getattr(policy, 'name', 'p')}-c{scenario.concurrency}-{time.monotonic_ns() % 10**9}"
        self.deferred0 = getattr(engine, "deferred_steps", 0)
        self.t_start = engine.clock()
        self.t_end = None

    @property
    def done(self) -> bool:
        """Every request of the scenario has finished."""
        return not self.queue and not self.engine.has_unfinished()

    def _admit(self) -> None:
        """Add requests until ``scenario.concurrency`` are in flight."""
        from workers.request import DecodeKnobs, SamplingParams

        engine, K, apply = self.engine, self.engine.block, getattr(self.policy, "apply", None)
        while self.queue and len(self.live) < self.scenario.concurrency:
            i, spec = self.queue.popleft()
            rid = f"{self.tag}-{i}"
            knobs = DecodeKnobs(steps=1, draft_len=K, quality=str(spec.targets.quality), commit_order=spec.commit_order)
            if apply is not None:
                knobs = apply(knobs)
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature,
                                    seed=self.seed * 100003 + i, ignore_eos=True)
            engine.add_request(rid, self.prompts[i % len(self.prompts)], params, knobs, targets=spec.targets)
            self.live[rid] = {"spec": spec, "t_add": engine.clock(), "t_first": None, "t_last": None, "tokens": 0,
                              "p_first": 0.0, "p_last": 0.0}

    def tick(self) -> None:
        """Top the requests in flight up and run one engine step."""
        engine = self.engine
        self._admit()
        for out in engine.step():
            now = engine.clock()
            st = self.live[out.request_id]
            if out.new_token_ids:
                st["p_last"] = engine.prefill_seconds
                if st["t_first"] is None:
                    st["t_first"], st["p_first"] = now, engine.prefill_seconds
                else:  # a decode step (the first token comes from the prefill)
                    src = out.stats.get("last_step", {}).get("source")  # this step's source
                    if src in self.sources:
                        self.sources[src] += 1
                st["t_last"] = now
                st["tokens"] += len(out.new_token_ids)
            if out.finished:
                st.update(stats=out.stats)
                self.finished.append(self.live.pop(out.request_id))
        if self.done and self.t_end is None:
            self.t_end = engine.clock()

    def metrics(self) -> dict:
        """What a client saw (see the module docstring); call once `done`."""
        done, policy = self.finished, self.policy
        wall = (self.t_end if self.t_end is not None else self.engine.clock()) - self.t_start
        tokens = sum(d["tokens"] for d in done)
        met = met_unstalled = 0
        tvd = 0.0
        passes = 0
        decode_s = stall_s = 0.0
        per_request = []
        for d in done:
            target = d["spec"].targets.effective_tpot_ms
            tpot = 1e3 * (d["t_last"] - d["t_first"]) / max(d["tokens"] - 1, 1)
            stall = d["p_last"] - d["p_first"]  # other requests' prefills while it decoded
            decode_s, stall_s = decode_s + d["t_last"] - d["t_first"], stall_s + stall
            met_unstalled += target is None or tpot - 1e3 * stall / max(d["tokens"] - 1, 1) <= target
            ttft = 1e3 * (d["t_first"] - d["t_add"])
            ok = target is None or tpot <= target
            if d["spec"].targets.ttft_ms is not None:
                ok = ok and ttft <= d["spec"].targets.ttft_ms
            met += ok
            per_request.append({"target_ms": target, "tpot_ms": round(tpot, 2), "ttft_ms": round(ttft, 1),
                                "stall_ms_per_token": round(1e3 * stall / max(d["tokens"] - 1, 1), 2),
                                "tokens": d["tokens"], "met": bool(ok)})
            tvd += float(d["stats"].get("tvd_spent", 0.0))
            passes += int(d["stats"].get("target_passes", 1))
        stats = policy.stats() if hasattr(policy, "stats") else {}
        row_steps = max(sum(self.sources.values()), 1)
        return {"goodput_tok_s": tokens / max(wall, 1e-9), "sla_attainment": met / max(len(done), 1),
                "tau": tokens / max(passes, 1), "tvd_spent_per_token": tvd / max(tokens, 1),
                "decision_ms_per_step": stats.get("decision_ms_per_step", float("nan")),
                "tokens": tokens, "requests": len(done), "wall_s": wall,
                "prefill_stall_share": stall_s / max(decode_s, 1e-9),
                "sla_attainment_without_stalls": met_unstalled / max(len(done), 1),
                "ttft_ms_mean": sum(q["ttft_ms"] for q in per_request) / max(len(per_request), 1),
                "deferred_steps": getattr(self.engine, "deferred_steps", 0) - self.deferred0,
                "source_share": {k: v / row_steps for k, v in self.sources.items()}, "per_request": per_request}


def collect_traces(engine, scenario: Scenario, prompts, sink, *, steps_grid=(1, 2), seed: int = 0) -> dict:
    """Run the `explore` policy (full block, random s, random leniency) and log traces to ``sink``."""
    import policies

    explore = policies.get("explore", steps_grid=tuple(steps_grid), seed=seed)
    return run_live(engine, explore, scenario, prompts, seed=seed, trace_sink=sink)
