"""`adapt policy push|status` and `adapt policy fit --from-redis`: the serving side of policies.

`adapt.commands.policy` (the controller's CLI) calls `add_push_parsers(policy_subparsers)` to
add ``push`` and ``status``, and `add_fit_from_redis_args(fit_parser)` + `run_fit_from_redis(args)`
for ``fit --from-redis URL``.

- ``adapt policy push POLICY.json [--redis-url URL | --ray-address ADDR]``: validate the file
  (`adapt.policy_file`) and publish it as the next version; running workers hot-reload it
  between steps. With a Redis URL it goes straight to Redis; otherwise through the Controller
  deployment of the running application (``adapt serve``'s, with its in-process store). A
  corrupt file is rejected with the field named and the running version stays.
- ``adapt policy fit --from-redis URL [--count N] [--out FILE] [--push]``: refit the predictor on
  the trace stream (newest N records) on top of the current policy.
- ``adapt policy status``: the store's version and the version each worker runs.
"""

from __future__ import annotations

import json
import sys

__all__ = ["add_push_parsers", "add_fit_from_redis_args", "run_fit_from_redis", "run_push", "run_status"]


def add_push_parsers(policy_subparsers) -> None:
    push = policy_subparsers.add_parser("push", help="validate a policy file and publish it to running workers")
    push.add_argument("policy", help="policy JSON file (adapt.policy_file format)")
    _target_args(push)
    push.set_defaults(run=run_push)
    status = policy_subparsers.add_parser("status", help="the published policy version and what each worker runs")
    _target_args(status)
    status.set_defaults(run=run_status)


def _target_args(parser) -> None:
    parser.add_argument("--redis-url", default=None, help="publish through Redis directly")
    parser.add_argument("--ray-address", default="auto", help="Ray cluster of the running server (default: auto)")


def add_fit_from_redis_args(fit_parser) -> None:
    fit_parser.add_argument("--from-redis", metavar="URL", default=None,
                            help="fit on the Redis trace stream of a running server instead of trace files")
    fit_parser.add_argument("--count", type=int, default=None, help="newest N trace records (default: all)")
    fit_parser.add_argument("--push", action="store_true", help="publish the refitted policy as a new version")


def _read_doc(path: str) -> dict:
    from adapt import policy_file

    policy_file.load(path)  # validates; PolicyFileError names the field
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _controller(address: str):
    """The Serve handle of the running application's Controller deployment (`adapt serve`'s, or a
    cluster's application named ``adapt``); ConnectionError when there is none."""
    import ray
    from ray import serve

    from adapt.serving.controller_actor import APP_NAME, CONTROLLER_DEPLOYMENT, NAMESPACE

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        return serve.get_deployment_handle(CONTROLLER_DEPLOYMENT, app_name=APP_NAME)
    except Exception as exc:  # noqa: BLE001 - RayServeException: no Serve, or no such application
        raise ConnectionError(f"no application {APP_NAME!r} with a {CONTROLLER_DEPLOYMENT} on Ray: {exc}") from None


def run_push(args) -> int:
    from adapt.policy_file import PolicyFileError

    try:
        doc = _read_doc(args.policy)
        if args.redis_url:
            from adapt.serving.controller_actor import publish_policy
            from adapt.serving.redis_store import RedisStore

            out = publish_policy(RedisStore(args.redis_url), doc)
        else:
            out = _controller(args.ray_address).push_policy.remote(doc).result(timeout_s=120)
    except (PolicyFileError, ValueError) as exc:
        print(f"policy rejected: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"no running server reachable ({exc}); start `adapt serve` or pass --redis-url", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


def run_status(args) -> int:
    if args.redis_url:
        from adapt.serving.redis_store import RedisStore

        store = RedisStore(args.redis_url)
        loads = store.loads()
        out = {"store_version": store.policy_version(),
               "workers": {w: v.get("policy_version", 0) for w, v in loads.items()}}
    else:
        out = _controller(args.ray_address).policy_status.remote().result(timeout_s=120)
    print(json.dumps(out, indent=1))
    return 0


def run_fit_from_redis(args) -> int:
    """Refit from the Redis trace stream; write `args.out` if set, publish if `args.push`."""
    from adapt import policy_file
    from adapt.serving.controller_actor import fit_policy, publish_policy
    from adapt.serving.redis_store import RedisStore

    store = RedisStore(args.from_redis)
    records = store.read_traces(args.count)
    current = store.get_policy()
    try:
        doc = fit_policy(records, current[1] if current else None)
    except ValueError as exc:
        print(f"fit failed: {exc}", file=sys.stderr)
        return 2
    out_path = getattr(args, "out", None)
    if out_path:
        policy_file.save(policy_file.loads(json.dumps(doc)), out_path)
    summary = {"records": len(records), "policy_version": doc["version"],
               "ece": {h: doc["report"].get(h, {}).get("ece") for h in ("draft", "prior")}}
    if args.push:
        summary.update(publish_policy(store, doc))
    print(json.dumps(summary))
    return 0
