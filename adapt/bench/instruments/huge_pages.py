"""Weights on huge pages or not (workers/huge_pages.py): the same decode forwards and the same
`adapt generate`, in processes that alternate between the two, ratios per pair.

Memory once on huge pages stays there, and a process's allocations land where they land, so
the comparison is between processes: each pair runs one child with huge pages and one without,
in alternating order (on-off, off-on, ...), and reports the ratio inside the pair, so that the
machine's drift between pairs cancels. Two children per setting and pair:

- **forwards**: loads the pair's engine (`EngineConfig.huge_pages` on or off) and times its decode
  forward (`Engine.target_forward`, the compiled package where one is loaded) of T tokens after
  `--start` cached positions (verify_cost's `time_forwards`: medians of sweeps in random order);
  ratio: milliseconds without over milliseconds with huge pages;
- **generate**: the README's main job (`adapt generate --chat PROMPT --json`, with or without
  `--huge-pages`); ratios: its decode rate (tok/s) with over without, and its wall time without
  over with (the move's seconds included).

    python -m adapt.bench.instruments.huge_pages --pairs 6 --out results/ab/smollm2/huge-pages/huge-pages.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a number is prime."  # the README's main job


def time_child(args) -> dict:
    """In a child: load the engine, time its forwards, report them with the huge page figures."""
    import torch

    from adapt.bench.instruments.verify_cost import time_forwards
    from workers.engine import Engine, EngineConfig
    from workers.pairs import get_pair

    torch.set_num_threads(args.threads)
    pair = get_pair(args.pair)
    pair.prepare()
    engine = Engine(EngineConfig(target=str(pair.target), drafter=None if pair.drafter is None else str(pair.drafter),
                                 dtype=args.dtype, max_batch=1, compile=args.compile, huge_pages=args.huge_pages == "on"))
    points = time_forwards(engine, [args.start], [int(w) for w in args.widths.split(",")], args.repeats)
    return {"huge_pages": engine.huge_pages, "backend": engine.backend.label,
            "ms": {str(p["tokens"]): p["ms"] for p in points}}


def run_child(kind: str, on: bool, args) -> dict:
    if kind == "forwards":
        cmd = [sys.executable, "-m", "adapt.bench.instruments.huge_pages", "--child", "--pair", args.pair,
               "--compile", args.compile, "--dtype", args.dtype, "--widths", args.widths, "--start", str(args.start),
               "--repeats", str(args.repeats), "--threads", str(args.threads), "--huge-pages", "on" if on else "off",
               "--out", "-"]
    else:
        cmd = [sys.executable, "-m", "adapt.cli", "generate", "--pair", args.pair, "--chat", PROMPT, "--json",
               *(["--huge-pages"] if on else [])]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} child (huge pages {'on' if on else 'off'}) failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if kind == "generate":
        s = out["stats"]
        out = {"huge_pages": s["huge_pages"], "backend": s["backend"],
               "tokens_per_s": s["tokens_per_s"], "tau": s["tau"], "tokens": s["tokens"]}
    return dict(out, wall_s=round(time.perf_counter() - t0, 1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--compile", default="aot", choices=("off", "aot", "auto"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--start", type=int, default=150, help="cached positions before the timed forwards' tokens")
    p.add_argument("--widths", default="1,5,17", help="new tokens T per timed forward, comma-separated")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", type=int, default=6, help="pairs of processes (one with huge pages, one without)")
    p.add_argument("--skip-generate", action="store_true", help="time the forwards only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--huge-pages", choices=("on", "off"), default="on", help=argparse.SUPPRESS)  # a child's
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(time_child(args)))
        return 0
    if args.pairs < 1:
        p.error("--pairs: at least 1")

    from adapt.bench.report import commit
    from adapt.profile_cache import cpu_facts
    from workers.huge_pages import thp_mode

    kinds = ("forwards",) if args.skip_generate else ("forwards", "generate")
    pairs = []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        runs = {kind: {("on" if on else "off"): run_child(kind, on, args) for on in order} for kind in kinds}
        ratios = {f"forward_T{w}": round(runs["forwards"]["off"]["ms"][w] / runs["forwards"]["on"]["ms"][w], 3)
                  for w in runs["forwards"]["on"]["ms"]}
        if "generate" in runs:
            gen = runs["generate"]
            ratios["generate_tok_s"] = round(gen["on"]["tokens_per_s"] / gen["off"]["tokens_per_s"], 3)
            ratios["generate_wall"] = round(gen["off"]["wall_s"] / gen["on"]["wall_s"], 3)
        pairs.append({"order": ["on" if o else "off" for o in order], "runs": runs, "on_over_off": ratios})
        print(f"pair {i + 1}: " + ", ".join(f"{k} {v}x" for k, v in ratios.items()), flush=True)
    medians = {k: round(statistics.median(pr["on_over_off"][k] for pr in pairs), 3) for k in pairs[0]["on_over_off"]}
    out = {"instrument": "huge_pages", "pair": args.pair, "compile": args.compile, "dtype": args.dtype,
           "start": args.start, "repeats": args.repeats, "threads": args.threads, "thp_mode": thp_mode(),
           "machine": cpu_facts(), "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "on_over_off_median": medians, "pairs": pairs,
           "meaning": "on_over_off: speed with huge pages over speed without, inside each pair (> 1: huge pages faster)"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("median: " + ", ".join(f"{k} {v}x" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
