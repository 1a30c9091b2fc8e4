"""Live policy runs: a closed-loop load generator around the real `Engine`.

`run_live(engine, policy, scenario, prompts)` keeps ``scenario.concurrency`` requests in flight
(a finished request is replaced by the next one), with each request's `RequestTargets` passed to
the engine, and measures what a client sees: tokens, wall time, per-request TPOT (time between its
first and last token divided by the tokens after the first) and TTFT, TVD spent and τ from the
engine's per-request stats, and the policy's own decision time. `collect_traces` runs the
`explore` policy the same way with a trace sink, which is how the bench gets replayable traces.
"""

from __future__ import annotations

import time
from collections import deque

from adapt.replay import Scenario


def run_live(engine, policy, scenario: Scenario, prompts: list[list[int]], *, seed: int = 0,
             trace_sink=None) -> dict:
    """Serve ``scenario`` through ``engine`` with ``policy`` deciding; returns metrics."""
    from workers.request import DecodeKnobs, SamplingParams

    if engine.has_unfinished():
        raise RuntimeError("run_live: the engine still has requests")
    engine.decisions = policy
    engine.trace_sink = trace_sink
    K = engine.block
    queue = deque(enumerate(scenario.requests))
    live: dict[str, dict] = {}
    done: list[dict] = []
    tag = f"{getattr(policy, 'name', 'p')}-c{scenario.concurrency}-{time.monotonic_ns() % 10**9}"
    t_start = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and len(live) < scenario.concurrency:
            i, spec = queue.popleft()
            rid = f"{tag}-{i}"
            knobs = DecodeKnobs(steps=1, draft_len=K, quality=str(spec.targets.quality), commit_order=spec.commit_order)
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=spec.temperature, seed=seed * 100003 + i,
                                    ignore_eos=True)
            engine.add_request(rid, prompts[i % len(prompts)], params, knobs, targets=spec.targets)
            live[rid] = {"spec": spec, "t_add": time.perf_counter(), "t_first": None, "t_last": None, "tokens": 0}
        for out in engine.step():
            now = time.perf_counter()
            st = live[out.request_id]
            if out.new_token_ids:
                if st["t_first"] is None:
                    st["t_first"] = now
                st["t_last"] = now
                st["tokens"] += len(out.new_token_ids)
            if out.finished:
                st.update(stats=out.stats)
                done.append(live.pop(out.request_id))
    wall = time.perf_counter() - t_start
    tokens = sum(d["tokens"] for d in done)
    met = 0
    tvd = 0.0
    passes = 0
    for d in done:
        target = d["spec"].targets.effective_tpot_ms
        tpot = 1e3 * (d["t_last"] - d["t_first"]) / max(d["tokens"] - 1, 1)
        ttft = 1e3 * (d["t_first"] - d["t_add"])
        ok = target is None or tpot <= target
        if d["spec"].targets.ttft_ms is not None:
            ok = ok and ttft <= d["spec"].targets.ttft_ms
        met += ok
        tvd += float(d["stats"].get("tvd_spent", 0.0))
        passes += int(d["stats"].get("target_passes", 1))
    stats = policy.stats() if hasattr(policy, "stats") else {}
    return {"goodput_tok_s": tokens / max(wall, 1e-9), "sla_attainment": met / max(len(done), 1),
            "tau": tokens / max(passes, 1), "tvd_spent_per_token": tvd / max(tokens, 1),
            "decision_ms_per_step": stats.get("decision_ms_per_step", float("nan")),
            "tokens": tokens, "requests": len(done), "wall_s": wall}


def collect_traces(engine, scenario: Scenario, prompts, sink, *, steps_grid=(1, 2), seed: int = 0) -> dict:
    """Run the `explore` policy (full block, random s, random leniency) and log traces to ``sink``."""
    import policies

    explore = policies.get("explore", steps_grid=tuple(steps_grid), seed=seed)
    return run_live(engine, explore, scenario, prompts, seed=seed, trace_sink=sink)
