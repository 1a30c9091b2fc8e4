"""`adapt bench NAME`: the benchmarks, each in a module of `adapt.bench` (`BENCHMARKS` names them).

Each benchmark module defines `add_parser(subparsers)` (which sets `run`) and writes JSON plus a plot.
"""

from __future__ import annotations

from adapt.commands import optional_module

BENCHMARKS = ("speed", "policies", "kernels", "ab", "forward_speed", "load", "flood", "report", "startup")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (writes JSON and a plot)")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        module = optional_module(f"adapt.bench.{name}")
        if module is not None:
            module.add_parser(sub)
