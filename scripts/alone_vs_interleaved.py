"""Does interleaving change a run's own numbers, or the ratio of two policies?

For each scenario instance (`adapt.bench.interleave.scenario_instance`), two policies A and B on
SmolLM2's mixed workload, each on its own engine: A alone, B alone, both interleaved
(adapt/bench/interleave.py: the runs take turns step by step, each timed by its own clock), B
alone, A alone. Printed and written as JSON per instance: every run's goodput (tok/s), B / A alone
(the sums of the two alone runs of each, in ABBA order so that a drift meets both alike) and
interleaved. Examples:

    python scripts/alone_vs_interleaved.py --policies ar,ar --load 16 --compile off --instances 0   # stop 24
    python scripts/alone_vs_interleaved.py --policies suffix,adaptive --load 1 --compile aot \\
        --instances 0,1,2,3 --out results/policies-smollm2-54/alone-vs-interleaved-l1.json          # stop 54

Stop 24 (`ar` twice at 16 requests, eager): 34.7 alone, 35.0 and 33.9 interleaved, 34.4 alone.
Stop 54 (static suffix drafting against the adaptive policy at one request, both packages): B / A
1.223, 1.048, 1.096, 1.147 alone against 1.101, 1.072, 1.193, 1.076 interleaved: no bias either
way beyond the noise of one instance's run (docs/benchmarks.md, stop 54).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="ar,ar", help="A,B: baselines of `adapt bench policies` or adaptive")
    p.add_argument("--load", type=int, default=16)
    p.add_argument("--compile", default="off", choices=("off", "aot"))
    p.add_argument("--instances", default="0", help="scenario instances, comma-separated")
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: max(24, 2 x load))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.policies.split(",")]
    if len(names) != 2:
        p.error(f"--policies: two names A,B, got {args.policies!r}")

    import torch

    from adapt.bench import write_json
    from adapt.bench.interleave import engine_copies, run_round, scenario_instance
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.bench.evaluation import evaluation_mix, profiled_policy_file
    from adapt.replay import Scenario

    torch.set_num_threads(2)
    engine, prompts = workload_engine(args.pair, "mixed", args.load, args.max_tokens + 33, compile=args.compile)
    pf = profiled_policy_file(Path(__file__).resolve().parents[1] / "models" / args.pair / "policy.json", engine)
    K = engine.block
    mix = evaluation_mix(pf.cost, K, args.requests or max(24, 2 * args.load), max_tokens=args.max_tokens)
    grid = tuple(pf.settings.get("steps_grid", (1,)))

    engines = engine_copies(engine, 2)
    warm, scenario = Scenario("warm", min(args.load, 4), mix[:4]), Scenario("mix", args.load, mix)
    out = []
    for inst in [int(x) for x in args.instances.split(",")]:
        served, seed = scenario_instance(prompts, inst, len(mix))
        alone: list[list[float]] = [[], []]

        def run_alone(i: int) -> None:
            m = run_round([engines[i]], [make_policy(names[i], pf, steps_grid=grid, width=K)], warm, scenario, served, interleave=False, seed=seed)[0]
            alone[i].append(round(m["goodput_tok_s"], 2))

        run_alone(0)
        run_alone(1)
        both = run_round(engines, [make_policy(n, pf, steps_grid=grid, width=K) for n in names], warm, scenario, served, interleave=True, seed=seed)
        run_alone(1)
        run_alone(0)
        both_tok_s = [round(m["goodput_tok_s"], 2) for m in both]
        rec = {"instance": inst, "policies": names, "load": args.load, "alone_a": alone[0], "alone_b": alone[1],
               "interleaved": both_tok_s, "b_over_a_alone": round(sum(alone[1]) / sum(alone[0]), 3),
               "b_over_a_interleaved": round(both_tok_s[1] / both_tok_s[0], 3)}
        print(json.dumps(rec), flush=True)
        out.append(rec)
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
