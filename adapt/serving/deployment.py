"""Ray Serve deployments, for ``serve run`` / ``serve deploy`` on an existing (multi-node) cluster.

Three deployments make one application (`app_builder`; config in ``deploy/serve_config.yaml``):

- ``Decoder``: a replica per GPU (``ray_actor_options: {num_gpus: 1}``), autoscaled on ongoing
  requests; each replica is a `workers.ray_worker.DecoderWorker` (engine loop + decision
  function in-process) heartbeating into Redis and hot-reloading policies from it.
- ``Controller``: one replica of `adapt.serving.controller_actor.Controller` (cluster load,
  policy validation and publication, refits from the Redis trace stream).
- ``Ingress``: the OpenAI-compatible FastAPI app (`adapt.serving.http_app`); it streams from a
  ``Decoder`` handle. Serve's router sends each request to the less loaded of two sampled
  replicas (by ongoing requests), which is least-loaded routing without a central queue.

On a cluster a Redis URL is required: it is how workers, the controller and the CLI
(``adapt policy push --redis-url``) share load, policies and traces.
"""

from __future__ import annotations

import functools
from typing import Any, AsyncIterator

from ray import serve

from adapt.serving.headers import ApiError

__all__ = ["Decoder", "ControllerDeployment", "Ingress", "ServeBackend", "app_builder"]


def _replica_id() -> str:
    ctx = serve.get_replica_context()
    rid = getattr(ctx, "replica_id", None)
    return str(getattr(rid, "unique_id", None) or getattr(ctx, "replica_tag", None) or rid)


@serve.deployment(name="Decoder", max_ongoing_requests=64, ray_actor_options={"num_gpus": 1})
class Decoder:
    """A decoder replica: the engine loop with the decision function in-process."""

    def __init__(self, target: str, drafter: str | None, redis_url: str, policy: str | None = None,
                 engine_options: dict[str, Any] | None = None, num_threads: int | None = None,
                 heartbeat_s: float = 0.5, ttl_s: float = 3.0):
        from adapt.serving.worker_plugin import ServingPlugin
        from workers.ray_worker import DecoderWorker

        plugin = functools.partial(ServingPlugin, store=redis_url, policy=policy, heartbeat_s=heartbeat_s,
                                   ttl_s=ttl_s)
        from adapt.serving.engine_options import validate_engine_options

        config = validate_engine_options({"target": target, "drafter": drafter, **(engine_options or {})})
        self.worker = DecoderWorker(f"decoder-{_replica_id()}", config, plugin, num_threads)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.worker.generate(request):
            yield chunk

    def load(self) -> dict[str, Any]:
        return self.worker.load()

    def __del__(self):
        try:
            self.worker.shutdown()
        except Exception:  # noqa: BLE001 - replica shutting down
            pass


@serve.deployment(name="Controller", num_replicas=1, ray_actor_options={"num_cpus": 0})
class ControllerDeployment:
    """The central controller as a single Serve replica."""

    def __init__(self, redis_url: str):
        from adapt.serving.controller_actor import Controller

        self.controller = Controller(redis_url)

    def cluster_load(self) -> dict[str, Any]:
        return self.controller.cluster_load()

    def push_policy(self, doc: dict[str, Any]) -> dict[str, Any]:
        return self.controller.push_policy(doc)

    def policy_status(self) -> dict[str, Any]:
        return self.controller.policy_status()

    def fit_from_traces(self, count: int | None = None, push: bool = True) -> dict[str, Any]:
        out = self.controller.fit_from_traces(count, push)
        out.pop("doc", None)
        return out


class ServeBackend:
    """The HTTP app's backend over a ``Decoder`` deployment handle."""

    def __init__(self, decoder: Any, store: Any):
        self.decoder = decoder
        self.store = store
        self._last: dict[str, dict[str, Any]] = {}

    async def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        from ray.serve.exceptions import BackPressureError

        gen = self.decoder.options(stream=True).generate.remote(request)
        got_any = False
        try:
            async for chunk in gen:
                got_any = True
                yield chunk
        except ApiError:
            raise
        except BackPressureError as exc:  # the Decoder deployment's max_queued_requests
            raise ApiError(f"server busy: the decoders' queues are full ({exc.max_queued_requests} waiting); "
                           "retry after 1 s", status=429, type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except Exception as exc:  # noqa: BLE001 - the replica died or was stopped
            raise ApiError(f"decoder replica failed{' mid-stream' if got_any else ''}: {type(exc).__name__}",
                           status=503, type_="server_error", code="worker_died") from None
        finally:
            gen.cancel()

    async def loads(self) -> dict[str, dict[str, Any]]:
        import asyncio

        try:
            self._last = await asyncio.get_running_loop().run_in_executor(None, self.store.loads)
        except Exception:  # noqa: BLE001 - Redis down: last view
            pass
        return dict(self._last)


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """The OpenAI-compatible HTTP front."""

    def __init__(self, decoder: Any, controller: Any, redis_url: str, model_name: str = "adapt",
                 default_tpot_ms: float | None = None, default_quality: str = "lossless",
                 default_max_tokens: int = 64, api_keys: list[str] | None = None,
                 max_body_bytes: int | None = None):
        from adapt.serving.store import open_store
        from adapt.targets import ServerDefaults

        self.backend = ServeBackend(decoder, open_store(redis_url))
        self.controller = controller
        self.model_name = model_name
        self.defaults = ServerDefaults(tpot_ms=default_tpot_ms, quality=default_quality)
        self.default_max_tokens = default_max_tokens
        self.api_keys = list(api_keys or [])
        self.max_body_bytes = max_body_bytes

    def __serve_build_asgi_app__(self):
        from adapt.serving.auth import ApiKeys
        from adapt.serving.http_app import build_app
        from adapt.serving.limits import DEFAULT_MAX_BODY_BYTES, Limits

        # the queue limit is the Decoder deployment's max_queued_requests (answered 429 by ServeBackend)
        limits = Limits(max_running=None, max_body_bytes=self.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        return build_app(self.backend, model_name=self.model_name, defaults=self.defaults,
                         default_max_tokens=self.default_max_tokens,
                         api_keys=ApiKeys.from_sources(self.api_keys), limits=limits)


def app_builder(args: dict[str, Any]):
    """The Serve application from config ``args``: target, drafter, redis_url (required);
    policy, model_name, engine_options, num_threads, default_tpot_ms, default_quality,
    default_max_tokens, decoder_options (Serve options of the Decoder deployment), api_keys (list;
    ADAPT_API_KEY in the Ingress replicas' environment works too), max_body_bytes (optional)."""
    from adapt.serving.engine_options import validate_engine_options  # unknown / ill-typed: ValueError naming it

    missing = [k for k in ("target", "redis_url") if not args.get(k)]
    if missing:
        raise ValueError(f"{missing[0]}: required in the application's args (see deploy/serve_config.yaml)")
    redis_url = str(args["redis_url"])
    decoder_options = dict(args.get("decoder_options") or {})  # e.g. {"ray_actor_options": {"num_gpus": 0}}
    decoder = Decoder.options(**decoder_options).bind(str(args["target"]), args.get("drafter"), redis_url, args.get("policy"),
                           validate_engine_options(args.get("engine_options")), args.get("num_threads"))
    controller = ControllerDeployment.bind(redis_url)
    return Ingress.bind(decoder, controller, redis_url, str(args.get("model_name", "adapt")),
                        args.get("default_tpot_ms"), str(args.get("default_quality", "lossless")),
                        int(args.get("default_max_tokens", 64)), args.get("api_keys"), args.get("max_body_bytes"))
