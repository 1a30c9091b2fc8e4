"""Subcommands of the `adapt` CLI. Each module defines `add_parser(subparsers)`, which adds its parser and calls
`parser.set_defaults(run=run)` with a `run(args) -> int` function.

Modules are imported lazily by `adapt.cli` so that `adapt --help` stays fast and a subcommand's
heavy imports (torch, ray, redis) happen only when it runs.
"""
