"""A code A/B: one `adapt bench` command run alternately on two checkouts, ratios side by side.

Whether a change of the engine or the policy costs speed is a comparison of two versions of the
code on one machine, and a machine here drifts by several percent between runs. This instrument
runs the same benchmark command from each checkout in turn (``--order old,new,old,new``: each
run its own process, the checkout first on ``PYTHONPATH``, every run under this one parent), and
reads from each run the ratios the benchmark itself measured side by side (the adaptive policy
over its baselines inside that run), so that drift between runs cancels in each number:

- ``adapt bench speed``: ``paired["adapt-policy/adapt-ar"]`` medians, per batch size;
- ``adapt bench ab``: each adaptive row's ``paired_ratio`` (over the best static row of the same
  round), per load.

Example (the check the decision code's restructuring must pass, new at >= 0.98x old)::

    python -m adapt.bench.instruments.code_ab --old ../old-checkout --new . --order old,new,old,new \\
        --out results/code-ab/smollm2/speed -- \\
        bench speed --pair smollm2 --prompts models/smollm2/heldout_prompts.jsonl --batch-sizes 1,8 \\
        --num-prompts 8 --rows adapt-ar,adapt-policy --threads 2 --rounds 3 --interleave --compile aot

Each run writes under ``OUT/<label>-<n>/`` (the command gets ``--out`` pointing there: a folder for
``bench speed``, ``ab.json`` in it for ``bench ab``); ``OUT/code_ab.json`` holds every run's commit,
ratios and wall time, and per key the new code's median over the old's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def commit_of(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def is_ab(command: list[str]) -> bool:
    """Whether a run's command is `adapt bench ab` (one JSON file) rather than `bench speed` (a folder)."""
    return command[:2] == ["bench", "ab"]


def run_out(command: list[str], run_dir: Path) -> Path:
    """Where a run's command writes: a folder for `bench speed`, a JSON file for `bench ab`."""
    return run_dir / "ab.json" if is_ab(command) else run_dir


def result_file(command: list[str], run_dir: Path) -> Path:
    """The JSON file a run's command leaves in ``run_dir``: ``ab.json`` or ``speed.json``."""
    return run_dir / ("ab.json" if is_ab(command) else "speed.json")


def ratios_of(command: list[str], run_dir: Path) -> dict[str, float]:
    """The side-by-side ratios a run measured, by key (``batch=B`` or ``load=L:POLICY``)."""
    data = json.loads(result_file(command, run_dir).read_text())
    if is_ab(command):
        return {f"load={r['load']}:{r['policy']}": r["paired_ratio"] for r in data if "paired_ratio" in r}
    paired = data["ratios"]["paired"]["adapt-policy/adapt-ar"]
    return {f"batch={b}": v["median"] for b, v in paired.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m adapt.bench.instruments.code_ab", description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, type=Path, help="the checkout of the reference code")
    p.add_argument("--new", required=True, type=Path, help="the checkout of the code under test")
    p.add_argument("--order", default="old,new,old,new", help="the runs, in order")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--resume", action="store_true", help="read runs whose output is already under --out instead of rerunning them")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then an adapt command, without `adapt` and --out")
    args = p.parse_args(argv)
    command = [c for c in args.command if c != "--"]
    if command[:1] != ["bench"]:
        p.error("the command must be an `adapt bench` command (after --)")
    checkouts = {"old": args.old.resolve(), "new": args.new.resolve()}
    order = args.order.split(",")
    if set(order) - set(checkouts):
        p.error(f"--order takes old and new, got {args.order}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for n, label in enumerate(order, 1):
        where = checkouts[label]
        run_dir = (args.out / f"{label}-{n}").resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(where))
        t0, commit = time.perf_counter(), commit_of(where)  # the commit the run starts from
        out = run_out(command, run_dir)
        if args.resume and result_file(command, run_dir).is_file():
            print(f"[code-ab] run {n}/{len(order)}: {label}: read from {out}", flush=True)
        else:
            print(f"[code-ab] run {n}/{len(order)}: {label} ({commit})", flush=True)
            subprocess.run([sys.executable, "-m", "adapt.cli", *command, "--out", str(out)], cwd=where, env=env,
                           check=True)
        runs.append({"run": n, "code": label, "commit": commit, "seconds": round(time.perf_counter() - t0, 1),
                     "ratios": ratios_of(command, run_dir)})
    keys = sorted({k for r in runs for k in r["ratios"]})
    summary = {}
    for key in keys:
        by = {c: [r["ratios"][key] for r in runs if r["code"] == c and key in r["ratios"]] for c in checkouts}
        if by["old"] and by["new"]:
            old, new = statistics.median(by["old"]), statistics.median(by["new"])
            summary[key] = {"old": by["old"], "new": by["new"], "new_over_old": round(new / old, 3)}
    (args.out / "code_ab.json").write_text(json.dumps({"command": ["adapt", *command], "order": order,
                                                        "runs": runs, "summary": summary}, indent=1) + "\n")
    for key, s in summary.items():
        print(f"{key}: old {s['old']}  new {s['new']}  new/old {s['new_over_old']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
