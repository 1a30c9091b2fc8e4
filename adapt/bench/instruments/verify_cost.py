"""What a target forward of T new tokens costs at a short and at a long context.

A verify of a k-token draft is a target forward of T = k + 1 tokens per row. The cost tables
(adapt/cost_model.py) price it by the forward's positions only, profiled over short contexts.
This instrument times the engine's own decode forward (`Engine.target_forward`: the compiled
package where one is loaded) for each T at each start position (the cached context before the
new tokens), for ``--batch`` rows (1 by default) at the same start, every call in sweeps of a random order (`cost_model.sweep_medians`), and
reports the medians and each one over the one-token forward at the same start: how much dearer
each extra verified token gets as the context grows.

    python -m adapt.bench.instruments.verify_cost --pair smollm2 --compile aot --max-len 1979 \\
        --out results/verify-cost/smollm2/verify-cost.json

The cache's contents do not matter for the time (every call writes and attends over the same
positions), so nothing is prefilled: the calls attend over whatever the cache holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def time_forwards(engine, starts: list[int], widths: list[int], repeats: int, batch: int = 1) -> list[dict]:
    """[{"start", "tokens", "ms", "over_one"}] for every (start, T), ``batch`` rows each: median ms
    of ``repeats`` sweeps; ``over_one``: over the one-token forward at that start (None without T = 1)."""
    import torch

    from adapt.cost_model import sweep_medians

    room = engine.tcache.k[0].shape[2]
    bad = [(s, t) for s in starts for t in widths if s + t > room - 1]
    if bad:
        raise ValueError(f"--starts/--widths: start + T must stay under the cache's {room} positions, "
                         f"not {bad[0][0]} + {bad[0][1]} (raise --max-len)")
    calls, points = [], []
    for start in starts:
        for T in widths:
            ids = torch.randint(1, engine.target.config.vocab_size, (batch, T), device=engine.device)  # [B, T]
            pos = torch.full((batch,), start, device=engine.device)                                   # [B]

            def call(ids=ids, pos=pos, start=start, T=T):
                with torch.inference_mode():
                    engine.target_forward(ids, pos, engine.tcache, 0, start + T, start_value=start)
            calls.append(call)
            points.append((start, T))
    ms = sweep_medians(calls, repeats, 0)
    one = {s: float(m) for (s, t), m in zip(points, ms) if t == 1}
    return [{"start": s, "tokens": t, "ms": round(float(m), 3),
             "over_one": round(float(m) / one[s], 3) if s in one else None} for (s, t), m in zip(points, ms)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--compile", default="aot", choices=("off", "aot", "auto"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-len", type=int, default=1979, help="the engine's max_len (the package's cache shape)")
    p.add_argument("--starts", default="150,1780", help="cached positions before the new tokens, comma-separated")
    p.add_argument("--widths", default="1,2,5,9,17", help="new tokens T per forward, comma-separated")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="rows per forward, each at the same start")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        starts = [int(x) for x in args.starts.split(",")]
        widths = [int(x) for x in args.widths.split(",")]
    except ValueError:
        p.error("--starts/--widths: comma-separated integers")
    if min(starts) < 0 or min(widths) < 1:
        p.error("--starts/--widths: starts >= 0, widths >= 1")
    if args.batch < 1:
        p.error("--batch: at least 1 row")

    import torch

    from adapt.bench.report import commit
    from adapt.profile_cache import machine_facts
    from workers.engine import Engine, EngineConfig
    from workers.pairs import get_pair

    torch.set_num_threads(args.threads)
    pair = get_pair(args.pair)
    pair.prepare()
    engine = Engine(EngineConfig(target=str(pair.target), drafter=None if pair.drafter is None else str(pair.drafter),
                                 dtype=args.dtype, max_batch=args.batch, max_len=args.max_len, compile=args.compile))
    try:
        points = time_forwards(engine, starts, widths, args.repeats, args.batch)
    except ValueError as e:
        p.error(str(e))
    out = {"instrument": "verify_cost", "pair": args.pair, "dtype": args.dtype, "backend": engine.backend.label,
           "max_len": args.max_len, "batch": args.batch, "repeats": args.repeats, "machine": machine_facts("cpu"), "commit": commit(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "points": points}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    for pt in points:
        print(f"start {pt['start']:5d}  T {pt['tokens']:2d}: {pt['ms']:7.2f} ms  ({pt['over_one']}x the one-token forward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
