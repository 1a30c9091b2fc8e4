"""`adapt compile`: build the compiled decode packages that make `adapt generate` and `adapt serve` faster.

    adapt compile                        # the smollm2 pair, for `adapt generate` (1 row) and `adapt serve` (32 rows)
    adapt compile --max-batch 8          # for `adapt serve --max-batch 8`
    adapt compile --pair demo --dtype float32
    adapt compile --list                 # what is built, for which engine shape
    adapt compile --prune                # remove the packages this installation can no longer load
    adapt compile --clear                # remove every package

A package is the target's decode forward compiled ahead of time by AOTInductor (workers/aot.py):
built once per machine, model and engine shape (a minute or two each for SmolLM2 on 2 cores),
then loaded in about a second by every engine whose `--compile` is `auto` (the default of
`adapt generate` and `adapt serve`: the package when it is built, eager steps otherwise) or `aot`
(built on first use). Packages live in $ADAPT_CACHE_DIR/aot (default ~/.cache/adapt/aot).
"""

from __future__ import annotations

import json
import sys

from adapt.commands import add_pair_arguments


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("compile", help="build the compiled decode packages for adapt generate / adapt serve",
                              description=__doc__.split("\n\n")[0])
    add_pair_arguments(p)
    p.add_argument("--max-batch", type=int, nargs="+", default=[1, 32],
                   help="engine shapes to build for, in rows (default: 1 = adapt generate, 32 = adapt serve's "
                        "default --max-batch)")
    p.add_argument("--max-len", type=int, default=1024, help="the engines' --max-len (default 1024, as theirs)")
    p.add_argument("--dtype", default="auto", help="auto = bfloat16 on CPUs, as adapt generate / serve")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--list", action="store_true", help="list the packages built, then exit")
    p.add_argument("--prune", action="store_true",
                   help="remove the packages no engine of this installation can load (built from other adapt "
                        "code, another torch or package format), then exit")
    p.add_argument("--clear", action="store_true", help="remove every package, then exit")
    p.set_defaults(run=run)


def run(args) -> int:
    from workers.package_cache import list_packages, remove_packages, remove_stale_packages

    if args.list:
        for pkg in list_packages():
            print(json.dumps(pkg))
        return 0
    if args.prune:
        n, mb = remove_stale_packages()
        print(f"removed {n} stale package(s), {mb} MB; kept {len(list_packages())}")
        return 0
    if args.clear:
        print(f"removed {remove_packages()} package(s)")
        return 0
    if any(b < 1 for b in args.max_batch):
        print(f"adapt compile: error: --max-batch must be >= 1, got {args.max_batch}", file=sys.stderr)
        return 2
    import torch

    from workers.engine import Engine, EngineConfig
    from workers.pairs import resolve_models
    from workers.pull import PullError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target, drafter, _ = resolve_models(args.pair, args.target, args.drafter, args.cache_dir)
    except PullError as exc:
        print(f"adapt compile: error: {exc}", file=sys.stderr)
        return 2
    for rows in args.max_batch:
        engine = Engine(EngineConfig(target=str(target), drafter=None if drafter is None else str(drafter),
                                     dtype=args.dtype, device=args.device, max_batch=rows, max_len=args.max_len,
                                     compile="aot", aot_build=True, huge_pages=False))  # builds, decodes nothing
        print(json.dumps({"max_batch": rows, "max_len": args.max_len, **engine.backend.info}), flush=True)
        del engine
    return 0
