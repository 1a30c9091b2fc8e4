"""`adapt policy push POLICY` and `adapt policy status` (picked up by `adapt.commands.policy`).

The implementation lives in `adapt.serving.policy_commands`.
"""

from __future__ import annotations


def add_parser(subparsers) -> None:
    from adapt.serving.policy_commands import add_push_parsers

    add_push_parsers(subparsers)
