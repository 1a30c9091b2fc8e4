"""Explore-policy traces of a pair: the input of `adapt policy fit` and notebooks/policy_tuning.ipynb.

    python -m adapt.bench.instruments.traces --pair smollm2 --out notebooks/data/smollm2-traces.jsonl

Serves ``--requests`` requests of ``--workload`` (adapt/bench/workloads.py) at each ``--loads``
concurrency with the `explore` policy (the full block, random diffusion steps, random leniency:
every kind of step the adaptive policy can choose gets logged, so a replay can price any of them),
as step 1 of `adapt bench policies` does, and writes one trace record per request per engine step
(workers/traces.py; the format is in docs/contracts.md §6) as JSON Lines, with a progress bar over
the requests. The records hold counts (accepted drafts per position, confidences) and this
machine's step times, so the acceptance fit carries to any machine and the cost fit does not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def collect(out: str | Path, *, pair: str = "smollm2", workload: str = "mixed", requests: int = 8,
            loads: tuple[int, ...] = (1, 4), max_tokens: int = 40, compile: str = "off", threads: int = 2,
            seed: int = 0, progress: bool = True) -> Path:
    """Write explore traces of ``pair`` to ``out`` (replacing it); returns ``out``."""
    import torch
    from tqdm.auto import tqdm

    import policies
    from adapt.bench.live import LiveRun
    from adapt.bench.policies import workload_engine
    from adapt.replay import Scenario, make_mix
    from workers.traces import FileTraceSink

    torch.set_num_threads(threads)
    engine, prompts = workload_engine(pair, workload, max(loads), max_tokens, compile=compile)
    mix = make_mix(requests, 1e9, 1e9, max_tokens=max_tokens)  # no SLA: explore decides at random anyway
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    sink = FileTraceSink(out)
    bar = tqdm(total=requests * len(loads), desc=f"explore traces of {pair}", unit="request", disable=not progress)
    try:
        for c in loads:
            explore = policies.get("explore", steps_grid=(1, 2), seed=seed + c)
            run = LiveRun(engine, explore, Scenario("explore", c, mix), prompts, seed=seed + c, trace_sink=sink)
            while not run.done:
                before = len(run.finished)
                run.tick()
                bar.update(len(run.finished) - before)
    finally:
        bar.close()
        sink.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adapt.bench.instruments.traces", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--workload", default="mixed")
    p.add_argument("--requests", type=int, default=8, help="requests per load")
    p.add_argument("--loads", default="1,4", help="concurrencies, comma-separated")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--compile", default="off", choices=("off", "aot"), help="the engine's decode steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="the JSON Lines file to write")
    args = p.parse_args(argv)
    try:
        loads = tuple(int(x) for x in args.loads.split(",") if x.strip())
    except ValueError:
        p.error(f"--loads: comma-separated integers, got {args.loads!r}")
    if not loads or min(loads) < 1 or args.requests < 1:
        p.error("--loads and --requests must be positive")
    path = collect(args.out, pair=args.pair, workload=args.workload, requests=args.requests, loads=loads,
                   max_tokens=args.max_tokens, compile=args.compile, threads=args.threads, seed=args.seed)
    print(f"wrote {path} ({sum(1 for _ in path.open())} records, {path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
