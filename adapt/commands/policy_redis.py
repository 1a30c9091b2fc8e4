"""`adapt policy fit --from-redis URL`: extends the controller's `fit` subcommand (picked up by
`adapt.commands.policy`) so that it can read the trace stream of a running server.

With ``--from-redis`` the ``--traces`` option is not needed; ``--push`` also publishes the result.
The implementation lives in `adapt.serving.policy_commands`.
"""

from __future__ import annotations

from adapt.commands import policy as _policy

_base_fit = _policy.SUBCOMMANDS.get("fit")


def _add_fit_with_redis(subparsers) -> None:
    from adapt.serving.policy_commands import add_fit_from_redis_args, run_fit_from_redis

    _base_fit(subparsers)
    fit = subparsers.choices["fit"]
    for action in fit._actions:
        if action.dest == "traces":
            action.required = False
    add_fit_from_redis_args(fit)
    run_files = fit.get_default("run")

    def run(args) -> int:
        if args.from_redis:
            return run_fit_from_redis(args)
        if not args.traces:
            fit.error("one of --traces or --from-redis is required")
        return run_files(args)

    fit.set_defaults(run=run)


if _base_fit is not None:
    _policy.register_subcommand("fit", _add_fit_with_redis)
