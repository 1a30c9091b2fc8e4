"""The serving application: Ray Serve deployments, for ``adapt serve`` and for a cluster.

One application (`app_builder`) is what runs everywhere: ``adapt serve`` runs it on a local (or
joined) Ray with ``serve.run`` (`adapt.serving.launcher.start_stack`), and a cluster runs it with
``serve run`` / ``serve deploy`` and ``deploy/serve_config.yaml``. Three deployments:

- ``Decoder``: replicas each owning one `workers.ray_worker.DecoderWorker` (engine loop + decision
  function in-process) that heartbeats into the state store and hot-reloads policies from it; on
  a CPU, ``dtype: auto`` is the dtype measured fastest on the replica's machine
  (`adapt.dtype_choice`, kept in its cache directory), which ``/health`` reports per dtype;
  ``adapt serve --num-workers N`` is N replicas, a cluster config a replica per GPU
  (``ray_actor_options: {num_gpus: 1}``), autoscaled on ongoing requests.
- ``Controller``: one replica of `adapt.serving.controller_actor.Controller` (cluster load,
  policy validation and publication, refits from the trace stream). Without a Redis URL it hosts
  the in-process state store, which the other replicas reach through its Serve handle
  (`adapt.serving.controller_actor.ControllerStoreClient`); ``adapt policy push`` finds it by
  name (application ``adapt``, deployment ``Controller``).
- ``Ingress``: the OpenAI-compatible FastAPI app (`adapt.serving.http_app`); it streams from a
  ``Decoder`` handle. Serve's router sends each request to the less loaded of two sampled
  replicas (by ongoing requests), which is least-loaded routing without a central queue, and
  Serve replaces a replica whose process died.

On a cluster a Redis URL is what workers, the controller and the CLI (``adapt policy push
--redis-url``) share load, policies and traces through; on one machine the in-process store will do.

Back-pressure (docs/serving.md, "Back-pressure under Ray Serve"): a flood is answered **429** with ``Retry-After``
and an OpenAI-shaped JSON error, never a 5xx, by our code, not by Serve's proxy:

- the ``Decoder`` deployment runs ``max_ongoing_requests`` requests per replica and lets
  ``max_queued_requests`` more wait in each Ingress's router; beyond that Serve raises
  ``BackPressureError`` in the Ingress, which `ServeBackend` answers 429 ``queue_full``;
- the ``Ingress`` deployment admits ``max_ongoing_requests`` (1000) requests per replica, far more
  than the decoders hold, and its own admission (`adapt.serving.limits.Guard`) answers 429 once
  it holds ``ingress_max_requests`` generation requests (default: 90 % of its
  ``max_ongoing_requests``; with the ``max_queue`` arg, as ``adapt serve --max-queue`` sets it:
  what the Decoder replicas run at once plus ``max_queue``), so the replica always has slots
  left to answer a 429 or ``/health`` and the proxy never has to queue nor refuse (Serve's own
  refusal is a plain-text 503 unless the deployment's ``backpressure_config`` says 429, which
  both deployments set as a last line);
- the code-level defaults below equal ``deploy/serve_config.yaml``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
from typing import Any, AsyncIterator

from ray import serve

from adapt.serving.headers import ApiError

log = logging.getLogger(__name__)

__all__ = ["Decoder", "ControllerDeployment", "Ingress", "ServeBackend", "app_builder", "ingress_admission_limit",
           "DECODER_MAX_ONGOING", "DECODER_MAX_QUEUED", "INGRESS_MAX_ONGOING", "INGRESS_MAX_QUEUED", "RETRY_AFTER_S",
           "HEALTH_CHECK_PERIOD_S", "HEALTH_CHECK_TIMEOUT_S"]

# Code-level defaults; deploy/serve_config.yaml sets the same values (tests/test_serve_flood.py checks).
DECODER_MAX_ONGOING = 64     # = the engine's max_batch: requests one Decoder replica runs at once
DECODER_MAX_QUEUED = 128     # requests waiting for a Decoder replica, per Ingress replica (router); then 429
INGRESS_MAX_ONGOING = 1000   # requests one Ingress replica holds (Serve's limit; beyond it the proxy queues)
INGRESS_MAX_QUEUED = 1000    # requests Serve's proxy queues for the Ingress before refusing them itself
RETRY_AFTER_S = 1            # the Retry-After of every 429
# Serve asks every replica whether it is alive every HEALTH_CHECK_PERIOD_S and replaces one that
# misses HEALTH_CHECK_TIMEOUT_S three times in a row (Serve: 10 s, 30 s). On a loaded 2-core machine
# a replica's answer waits for CPU behind its own engine loop and the other processes: 60 s gives a
# replica that is merely slow twice Serve's margin. A config file's ``health_check_period_s`` /
# ``health_check_timeout_s`` per deployment (or decoder_options / ingress_options) change them;
# the proxies' timeouts are Serve's controller's (`adapt.serving.startup`).
HEALTH_CHECK_PERIOD_S = 10
HEALTH_CHECK_TIMEOUT_S = 60
_HEALTH = {"health_check_period_s": HEALTH_CHECK_PERIOD_S, "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S}


def _backpressure_429() -> dict[str, Any]:
    """Serve's own answer to a full queue as 429 + Retry-After instead of a plain 503, where this
    Ray has ``backpressure_config``; only a last line: our code answers first (module docstring)."""
    if "backpressure_config" not in inspect.signature(serve.deployment).parameters:
        return {}
    from ray.serve.config import BackpressureConfig

    return {"backpressure_config": BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S)}


def ingress_admission_limit(max_ongoing_requests: int) -> int:
    """Generation requests an Ingress replica admits by default: 90 % of its Serve
    ``max_ongoing_requests`` (at least one slot kept for 429 answers and ``/health``)."""
    return max(1, min(max_ongoing_requests - 1, max_ongoing_requests - math.ceil(max_ongoing_requests / 10)))


def _replica_id() -> str:
    ctx = serve.get_replica_context()
    rid = getattr(ctx, "replica_id", None)
    return str(getattr(rid, "unique_id", None) or getattr(ctx, "replica_tag", None) or rid)


@serve.deployment(name="Decoder", max_ongoing_requests=DECODER_MAX_ONGOING, max_queued_requests=DECODER_MAX_QUEUED,
                  ray_actor_options={"num_gpus": 1}, **_HEALTH, **_backpressure_429())
class Decoder:
    """A decoder replica: the engine loop with the decision function in-process. `controller`:
    the Controller deployment's handle, whose in-process store the replica uses when there is
    no `redis_url`."""

    def __init__(self, target: str, drafter: str | None, redis_url: str | None, policy: str | None = None,
                 engine_options: dict[str, Any] | None = None, num_threads: int | None = None,
                 heartbeat_s: float = 0.5, ttl_s: float = 3.0, controller: Any = None):
        from adapt.serving.engine_options import validate_engine_options
        from adapt.serving.worker_plugin import ServingPlugin
        from workers.ray_worker import DecoderWorker

        # checked before any model loads: an unknown or ill-typed option is a ValueError naming it
        config = validate_engine_options({"target": target, "drafter": drafter, **(engine_options or {})})
        config, dtype_choice = _measured_dtype(config, num_threads)
        store = redis_url or _controller_store(controller)
        dtype = config.get("dtype", "auto")
        meta = {"pid": os.getpid(), "node": _node_id(), "dtype": dtype,
                "dtype_reason": dtype_choice["reason"] if dtype_choice else
                "given (engine_options.dtype)" if dtype != "auto" else
                "auto off the CPU: bfloat16, float16 where the GPU has no bfloat16"}
        plugin = functools.partial(ServingPlugin, store=store, policy=policy, heartbeat_s=heartbeat_s,
                                   ttl_s=ttl_s, meta=meta)
        self.worker = DecoderWorker(f"decoder-{_replica_id()}", config, plugin, num_threads)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self.worker.generate(request):
            yield chunk

    def load(self) -> dict[str, Any]:
        return self.worker.load()

    def info(self) -> dict[str, Any]:
        return self.worker.info()

    def __del__(self):
        try:
            self.worker.shutdown()
        except Exception:  # noqa: BLE001 - replica shutting down
            pass


def _measured_dtype(config: dict[str, Any], num_threads: int | None) -> tuple[dict[str, Any], dict | None]:
    """The replica's engine options with ``dtype: "auto"`` on a CPU made this machine's measured
    choice (`adapt.dtype_choice.resolve_engine_dtype`: bfloat16 or float32, timed once per machine
    and model at the worker's thread count and kept in the cache directory; replicas starting
    together measure once), and the choice (None where the dtype was given or the device is a GPU).
    The native cache bounds and the thread count are set first, as the worker sets them, so the
    timing runs as the worker will."""
    import torch

    from adapt.dtype_choice import resolve_engine_dtype
    from workers.native_caches import bound_native_caches

    bound_native_caches()
    if num_threads:
        torch.set_num_threads(int(num_threads))
    config, choice = resolve_engine_dtype(config, say=lambda line: log.info("%s", line))
    if choice is not None:
        log.info("decoder dtype %s (%s): %s", choice["dtype"], "stored choice" if choice["cached"] else "measured",
                 choice["reason"])
    return config, choice


def _controller_store(controller: Any, timeout_s: float = 10.0):
    if controller is None:
        raise ValueError("redis_url: required when the replica is given no Controller handle")
    from adapt.serving.controller_actor import ControllerStoreClient

    return ControllerStoreClient(controller, timeout_s=timeout_s)


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not under Ray
        return None


@serve.deployment(name="Controller", num_replicas=1, max_ongoing_requests=100, ray_actor_options={"num_cpus": 0},
                  graceful_shutdown_wait_loop_s=0.5, **_HEALTH)  # its calls are short: stop without Serve's 2 s wait
class ControllerDeployment:
    """The central controller as a single Serve replica. Without `redis_url` it hosts the
    in-process state store (`store_call`, for `ControllerStoreClient`), and publishes
    `policy_doc` (the application's start policy) into it when it starts."""

    def __init__(self, redis_url: str | None = None, policy_doc: dict[str, Any] | None = None):
        from adapt.serving.controller_actor import Controller

        self.controller = Controller(redis_url)
        if policy_doc is not None and not redis_url:
            self.controller.push_policy(policy_doc)

    def store_call(self, method: str, *args: Any) -> Any:
        return self.controller.store_call(method, *args)

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

    def ping(self) -> bool:
        return True

    def __del__(self):
        try:
            self.controller.shutdown()
        except Exception:  # noqa: BLE001 - replica shutting down
            pass


class ServeBackend:
    """The HTTP app's backend over a ``Decoder`` deployment handle. `loads` (``/health``,
    ``/metrics``) keeps its last view while the store is unreachable, and for `empty_grace_s`
    (the heartbeats' TTL) from the first empty answer after a view with workers: a store that
    restarted empty (the Controller's, or Redis) fills again with the workers' next heartbeats."""

    def __init__(self, decoder: Any, store: Any, retry_after_s: int = RETRY_AFTER_S, empty_grace_s: float = 3.0):
        self.decoder = decoder
        self.store = store
        self.retry_after_s = retry_after_s
        self.empty_grace_s = empty_grace_s
        self._last: dict[str, dict[str, Any]] = {}
        self._empty_since: float | None = None  # monotonic time of the first empty answer after workers

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
            queued = getattr(exc, "max_queued_requests", None)
            raise ApiError(f"server busy: the decoders' queue is full ({queued} requests waiting for a Decoder "
                           f"replica, its max_queued_requests); retry after {self.retry_after_s} s", status=429,
                           type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except Exception as exc:  # noqa: BLE001 - the replica died or was stopped
            raise ApiError(f"decoder replica failed{' mid-stream' if got_any else ''}: {type(exc).__name__}",
                           status=503, type_="server_error", code="worker_died") from None
        finally:
            # With Serve's router in its own loop (the default), cancel() fetches the assignment's
            # result and raises its error again (a BackPressureError): it must not replace ours, or
            # Serve's handler turns it into a plain-text 503.
            try:
                gen.cancel()
            except Exception:  # noqa: BLE001 - the request already failed; nothing to cancel
                pass

    async def loads(self) -> dict[str, dict[str, Any]]:
        import asyncio
        import time

        try:
            fresh = await asyncio.get_running_loop().run_in_executor(None, self.store.loads)
        except Exception:  # noqa: BLE001 - store down or restarting: last view
            return dict(self._last)
        if fresh:
            self._last, self._empty_since = fresh, None
        elif self._last:
            now = time.monotonic()
            self._empty_since = self._empty_since or now
            if now - self._empty_since > self.empty_grace_s:
                self._last = {}
        return dict(self._last)


def _own_max_ongoing_requests() -> int:
    """This replica's Serve ``max_ongoing_requests`` (as deployed, YAML overrides included)."""
    try:
        return int(serve.get_replica_context()._deployment_config.max_ongoing_requests)
    except Exception:  # noqa: BLE001 - not in a replica, or a Ray without the field
        return INGRESS_MAX_ONGOING


@serve.deployment(name="Ingress", max_ongoing_requests=INGRESS_MAX_ONGOING, max_queued_requests=INGRESS_MAX_QUEUED,
                  **_HEALTH, **_backpressure_429())
@serve.ingress()
class Ingress:
    """The OpenAI-compatible HTTP front. max_requests: generation requests this replica admits
    before answering 429 itself; max_running: how many of those the decoders run at once (the
    rest are counted as waiting in ``/health``; None: all running)."""

    def __init__(self, decoder: Any, controller: Any, redis_url: str | None, model_name: str = "adapt",
                 default_tpot_ms: float | None = None, default_quality: str = "lossless",
                 default_max_tokens: int = 64, api_keys: Any = None,
                 max_body_bytes: int | None = None, max_requests: int | None = None,
                 max_running: int | None = None):
        from adapt.serving.auth import ApiKeys
        from adapt.serving.store import open_store
        from adapt.targets import ServerDefaults

        # /health must not wait out a Controller restart: a short timeout, then the last view
        self.backend = ServeBackend(decoder, open_store(redis_url) if redis_url else _controller_store(controller, 2.0))
        self.controller = controller
        self.model_name = model_name
        self.defaults = ServerDefaults(tpot_ms=default_tpot_ms, quality=default_quality)
        self.default_max_tokens = default_max_tokens
        # an `ApiKeys` (digests only, as `adapt serve` passes them) or key strings, plus ADAPT_API_KEY here
        self.api_keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys.from_sources(api_keys)
        self.max_body_bytes = max_body_bytes
        self.max_requests = max_requests or ingress_admission_limit(_own_max_ongoing_requests())
        self.max_running = None if max_running is None else min(max_running, self.max_requests)

    def __serve_build_asgi_app__(self):
        from adapt.serving.http_app import build_app
        from adapt.serving.limits import DEFAULT_MAX_BODY_BYTES, Limits

        # Decoder queue full: 429 from ServeBackend; this replica full: 429 from the Guard, below
        # Serve's max_ongoing_requests so that the proxy never queues nor refuses for it
        running = self.max_running or self.max_requests
        limits = Limits(max_running=running, max_queue=self.max_requests - running, retry_after_s=RETRY_AFTER_S,
                        max_body_bytes=self.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        return build_app(self.backend, model_name=self.model_name, defaults=self.defaults,
                         default_max_tokens=self.default_max_tokens, api_keys=self.api_keys, limits=limits)


def app_builder(args: dict[str, Any]):
    """The Serve application from config ``args`` (what ``adapt serve`` and a cluster's
    ``deploy/serve_config.yaml`` both build):

    - target (required), drafter, policy, model_name, engine_options, num_threads,
      heartbeat_s / ttl_s (the workers' heartbeat period and its expiry), default_tpot_ms,
      default_quality, default_max_tokens;
    - redis_url: the state store shared by every replica and the CLI (required on a cluster);
      without it the Controller replica hosts an in-process store;
    - policy_file: a policy JSON published when the application starts, checked here first
      (`adapt.policy_file`, the settings against its policy: a `PolicyFileError` naming the
      field): into Redis right away with a redis_url, else by the Controller into its new store
      before any Decoder reads it;
    - decoder_options / ingress_options: Serve options of the Decoder / Ingress deployment (e.g.
      ``num_replicas``, ``max_ongoing_requests``, ``max_queued_requests``, ``ray_actor_options``;
      a config file's ``deployments:`` entries override them);
    - api_keys (list, or an `adapt.serving.auth.ApiKeys`; ADAPT_API_KEY in the Ingress replicas'
      environment works too), max_body_bytes (optional);
    - ingress_max_requests: generation requests one Ingress replica admits before answering 429
      itself; default 90 % of its max_ongoing_requests, or, with max_queue (``adapt serve
      --max-queue``; needs a fixed ``decoder_options.num_replicas``), what the Decoder replicas
      run at once (replicas × their max_ongoing_requests) plus max_queue, and then the Decoder's
      own queue is unbounded unless decoder_options sets max_queued_requests.
    """
    from adapt.serving.engine_options import validate_engine_options  # unknown / ill-typed: ValueError naming it

    if not args.get("target"):
        raise ValueError("target: required in the application's args (see deploy/serve_config.yaml)")
    redis_url = str(args["redis_url"]) if args.get("redis_url") else None
    engine_options = validate_engine_options(args.get("engine_options"))
    decoder_options = dict(args.get("decoder_options") or {})  # e.g. {"ray_actor_options": {"num_gpus": 0}}
    ingress_options = dict(args.get("ingress_options") or {})
    max_requests = _positive_int(args, "ingress_max_requests")
    max_running = None
    max_queue = args.get("max_queue")
    if max_queue is not None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue: expected a non-negative integer, got {max_queue!r}")
        replicas = decoder_options.get("num_replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError("max_queue: needs a fixed number of Decoder replicas (decoder_options.num_replicas), "
                             f"got {replicas!r}")
        max_running = replicas * int(decoder_options.get("max_ongoing_requests", DECODER_MAX_ONGOING))
        max_requests = max_requests or max_running + max_queue
        decoder_options.setdefault("max_queued_requests", -1)  # the Ingress's admission is the bound
    if max_requests is not None:  # Serve must let in more than the Ingress admits (429s, /health)
        ingress_options.setdefault("max_ongoing_requests", max(INGRESS_MAX_ONGOING, 2 * max_requests))
    policy_doc = _start_policy(args.get("policy_file"), redis_url)

    controller = ControllerDeployment.bind(redis_url, policy_doc)
    decoder = Decoder.options(**decoder_options).bind(
        str(args["target"]), args.get("drafter"), redis_url, args.get("policy"), engine_options,
        args.get("num_threads"), float(args.get("heartbeat_s", 0.5)), float(args.get("ttl_s", 3.0)),
        None if redis_url else controller)
    return Ingress.options(**ingress_options).bind(
        decoder, controller, redis_url, str(args.get("model_name", "adapt")), args.get("default_tpot_ms"),
        str(args.get("default_quality", "lossless")), int(args.get("default_max_tokens", 64)), args.get("api_keys"),
        args.get("max_body_bytes"), max_requests, max_running)


def _positive_int(args: dict[str, Any], name: str) -> int | None:
    value = args.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _start_policy(path: str | None, redis_url: str | None) -> dict[str, Any] | None:
    """The start policy file, validated as a push is (naming the field); published to Redis now
    when there is one, else returned for the Controller to publish into its in-process store."""
    if not path:
        return None
    from adapt import policy_file
    from adapt.serving.controller_actor import publish_policy
    from adapt.serving.store import InProcessStore, open_store

    doc = policy_file.load(path).to_dict()
    store = open_store(redis_url) if redis_url else InProcessStore()
    try:
        publish_policy(store, doc)  # validates the document and its settings; publishes with Redis
    finally:
        store.close()
    return None if redis_url else doc
