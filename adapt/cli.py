"""`adapt` command-line entry point: dispatches to the modules in `adapt.commands`."""

from __future__ import annotations

import argparse
import sys

from adapt.commands import optional_module

# subcommand name -> module under adapt.commands (each has add_parser(subparsers) and run(args))
COMMANDS = {
    "generate": "generate",
    "pull": "pull",
    "compile": "compile",
    "train-drafter": "train_drafter",
    "serve": "serve",
    "policy": "policy",
    "bench": "bench",
    "convert-drafter": "convert_drafter",
    "info": "info",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adapt",
        description="Adaptive speculative-diffusion decoding: generate, serve, train drafters, tune policies.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMANDS.values():
        module = optional_module(f"adapt.commands.{module_name}")
        if module is not None:  # None: subcommand not built in this checkout
            module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
