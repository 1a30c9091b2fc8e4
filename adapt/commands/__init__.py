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
