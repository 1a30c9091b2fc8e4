"""`adapt bench {speed,policies,kernels}`: benchmarks, each in a module of `adapt.bench`.

Each benchmark module defines `add_parser(subparsers)` (which sets `run`) and writes JSON plus a plot.
"""

from __future__ import annotations

import importlib

BENCHMARKS = ("speed", "policies", "kernels")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (writes JSON and a plot)")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(f"adapt.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"adapt.bench.{name}":
                continue
            raise
        module.add_parser(sub)
