"""Subcommands of the `adapt` CLI. Each module defines `add_parser(subparsers)`, which adds its parser and calls
`parser.set_defaults(run=run)` with a `run(args) -> int` function.

Modules are imported lazily by `adapt.cli` so that `adapt --help` stays fast and a subcommand's
heavy imports (torch, ray, redis) happen only when it runs.
"""

import importlib
from types import ModuleType


def optional_module(name: str) -> ModuleType | None:
    """Import `name`, or return None when that module itself is absent from this checkout.

    A missing dependency *inside* the module still raises, so a broken install is not hidden."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise


def add_pair_arguments(p) -> None:
    """`--pair`, `--target`, `--drafter` and `--cache-dir`: the models a command runs
    (`workers.pairs.resolve_models` reads them)."""
    from workers.pairs import DEFAULT_PAIR, PAIRS

    p.add_argument("--pair", default=DEFAULT_PAIR, choices=PAIRS,
                   help=f"named model pair (default {DEFAULT_PAIR}; workers/pairs.py)")
    p.add_argument("--target", default=None, help="target model directory (default: the pair's)")
    p.add_argument("--drafter", default=None,
                   help="drafter directory (default: the pair's, if it has one and the target is the pair's); "
                        "'none' = autoregressive")
    p.add_argument("--cache-dir", default=None, help="where pulled models live (default: $ADAPT_CACHE_DIR or ~/.cache/adapt)")
