"""What a policy's per-step arithmetic costs warm (in a loop) and cold (right after a model-sized
forward), on the shipped SmolLM2 policy file: the acceptance predictor's `survival`, the batch
prefix scheduler (`greedy_prefix`) and the cost table over a verify span (`CostModel.step_ms`).

A live engine step runs the target's forward between two decisions, which fills the CPU's caches
with weights, so the decision's code and data come back cold; a loop that times the same call
again and again measures it warm. Each call is timed ``--calls`` times per mode and the median is
printed, in µs (stop 48: survival of 2 rows × 16 positions 151 µs warm, 655 µs after a 2048²
matmul on this 2-core machine; docs/controller.md). With ``--bursts`` it also times bursts of
``n`` = 1, 5, 20, 60 small operations of three kinds (torch ops on [2, 16] tensors cycling through
five ops, the same in numpy, plain Python float arithmetic): what the cold penalty is per burst
and per operation (stop 51, `results/decision-cold-51.json`: one torch op cold 116 µs against 3 warm,
60 of them 291 against 105; numpy 49 and 221; plain Python 24–35 µs for the whole burst). Example:

    python scripts/decision_cold.py --rows 2 --bursts --out results/decision-cold-51.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bursts(torch) -> dict:
    """{name: call}: bursts of n small operations, n = 1, 5, 20, 60, of three kinds."""
    import numpy as np

    x, xn = torch.rand(2, 16), np.random.default_rng(0).random((2, 16))
    torch_ops = (lambda y: y * 1.5, lambda y: y.clamp(0, 1), lambda y: y.cumsum(1), torch.sigmoid, torch.log1p)
    numpy_ops = (lambda y: y * 1.5, lambda y: np.clip(y, 0, 1), lambda y: y.cumsum(1),
                 lambda y: 1 / (1 + np.exp(-y)), np.log1p)

    def run(ops, y0, n):
        y = y0
        for i in range(n):
            y = ops[i % len(ops)](y)

    def python(n):
        y = [0.3, 0.5]
        for _ in range(n):
            y = [v * 1.01 + 0.1 for v in y]

    calls = {}
    for n in (1, 5, 20, 60):
        calls[f"torch x{n}"] = lambda n=n: run(torch_ops, x, n)
        calls[f"numpy x{n}"] = lambda n=n: run(numpy_ops, xn, n)
        calls[f"python x{n}"] = lambda n=n: python(n)
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy-file", default=str(Path(__file__).resolve().parents[1] / "models/smollm2/policy.json"))
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--matmul", type=int, default=2048, help="side of the square matmul run before a cold call")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bursts", action="store_true", help="also time bursts of n small ops (torch, numpy, Python)")
    p.add_argument("--out", default=None, help="write the medians here as JSON")
    args = p.parse_args(argv)

    import torch

    from adapt.bench import write_json
    from adapt.policy_file import load
    from policies.greedy import greedy_prefix

    torch.set_num_threads(args.threads)
    pf = load(args.policy_file)
    pred, cost = pf.predictor, pf.cost
    B, K = args.rows, args.block
    gen = torch.Generator().manual_seed(0)
    conf, ent, margin = (torch.rand(B, K, generator=gen) for _ in range(3))
    temp = torch.tensor([0.0, 0.7] * B)[:B]
    recent, steps = torch.full((B,), 0.5), torch.ones(B, dtype=torch.int64)
    match, eps = torch.zeros(B, dtype=torch.bool), torch.zeros(B)
    values = torch.rand(B, K, generator=gen).sort(1, descending=True).values
    calls = {
        "survival": lambda: pred.survival(conf, ent, margin, temp, recent, steps, match, eps),
        "greedy_prefix": lambda: greedy_prefix(values, float(B), B, lambda n: cost.step_ms(n) + 3.0, "argmax"),
        "step_ms": lambda: cost.step_ms(torch.arange(B * (K + 1), dtype=torch.float64)),
    }
    if args.bursts:
        calls.update(bursts(torch))
    w = torch.randn(args.matmul, args.matmul)
    out = {"rows": B, "block": K, "matmul": args.matmul, "threads": args.threads, "us": {}}
    for name, call in calls.items():
        out["us"][name] = {}
        for mode in ("warm", "cold"):
            times = []
            for _ in range(args.calls):
                if mode == "cold":
                    w @ w  # a forward's worth of weights through the caches
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            out["us"][name][mode] = round(1e6 * statistics.median(times), 1)
        print(f"{name:14s} warm {out['us'][name]['warm']:7.1f} us   cold {out['us'][name]['cold']:7.1f} us")
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
