"""Where a decode step's time goes, per policy, live: `PhaseProbe` around one run of each policy.

Serves SmolLM2's mixed workload (the `adapt bench ab` scenario; ``--workload`` another) at one load with each
policy in turn on one engine, for each scenario instance, and prints milliseconds per decode step
by phase (`adapt.bench.speed_runners.PhaseProbe`, an observer of the engine's `StepRecord.times`:
decide, draft, choose, forward, accept, conclude; workers/step_record.py), plus the decision
maker's own three calls (`decision_parts_ms`: `before_draft` inside `decide`, `after_draft`
inside `choose`, `observe` inside `conclude`), timed by a delegating wrapper around the policy
(`wrapped_decisions.TimedDecisions`; nothing is patched, so the policy's internal parts are not
timed apart). Each phase also comes per call (`per_call_ms`: the phases that run only on
drafting steps cost those steps their per-call time), and the steps of each draft source apart
(`by_source`, from the run's trace records: steps, tokens per step, median step / draft-phase /
verify-phase ms; the draft phase runs from the step's start to the drafts, decisions and the
drafter's pass included, the verify phase from there to its end), so what a diffusion step costs
over a plain one in the same run is read off directly. The runs follow one another, so a drift
of the machine between them moves their ratio (use `adapt bench ab --interleave` to compare
policies); the phases of one run are what it shows. Example:

    python -m adapt.bench.instruments.phase_times --policies suffix,adaptive --instances 0,1 --out runs/phases-l1.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--policies", default="suffix,adaptive")
    p.add_argument("--load", type=int, default=1)
    p.add_argument("--workload", default="mixed", help="a workload of adapt.bench.workloads (longdoc: long documents)")
    p.add_argument("--instances", default="0")
    p.add_argument("--compile", default="aot", choices=("off", "aot"))
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from adapt.bench import write_json
    from adapt.bench.interleave import scenario_instance
    from adapt.bench.live import run_live
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.bench.speed_runners import PhaseProbe
    from adapt.bench.evaluation import evaluation_mix, profiled_policy_file
    from adapt.bench.instruments.wrapped_decisions import TimedDecisions
    from adapt.replay import Scenario
    from workers.traces import ListTraceSink

    torch.set_num_threads(2)
    engine, prompts = workload_engine(args.pair, args.workload, args.load, 97, compile=args.compile)
    pf = profiled_policy_file(Path(__file__).resolve().parents[3] / "models" / args.pair / "policy.json", engine)
    K = engine.block
    mix = evaluation_mix(pf.cost, K, max(args.requests, 2 * args.load))
    grid = tuple(pf.settings.get("steps_grid", (1,)))
    out = {}
    for inst in [int(x) for x in args.instances.split(",")]:
        served, seed = scenario_instance(prompts, inst, len(mix))
        for name in [n.strip() for n in args.policies.split(",")]:
            policy = TimedDecisions(make_policy(name, pf, steps_grid=grid, width=K))
            run_live(engine, policy, Scenario("warm", min(args.load, 4), mix[:4]), served, seed=seed)
            policy.reset()
            sink = ListTraceSink()
            with PhaseProbe(engine) as probe:
                run_live(engine, policy, Scenario("mix", args.load, mix), served, seed=seed, trace_sink=sink)
            r = probe.report()
            r["by_source"] = by_source(sink.records)
            r["decision_parts_ms"] = policy.ms_per_step(r["decode_steps"])
            print(inst, name, json.dumps(r), flush=True)
            out[f"{name}-{inst}"] = r
    if args.out:
        write_json(args.out, out)
    return 0


def by_source(records: list[dict]) -> dict:
    """{source: {steps, tokens_per_step, step_ms, draft_ms, verify_ms}} over one run's trace
    records (one per row and step; at one request, one per step): medians of the times, so a
    stalled step does not move them."""
    import statistics

    groups: dict = collections.defaultdict(list)
    for r in records:
        groups[r["source"]].append(r)
    return {source: {"steps": len(rs),
                     "tokens_per_step": round(sum(r["accepted"] + 1 for r in rs) / len(rs), 3),
                     **{key: round(statistics.median(r[key] or 0.0 for r in rs), 3)
                        for key in ("step_ms", "draft_ms", "verify_ms")}}
            for source, rs in sorted(groups.items())}


if __name__ == "__main__":
    sys.exit(main())
