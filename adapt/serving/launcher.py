"""Start a serving stack: Ray, the controller actor, decoder worker actors, the HTTP server.

`start_stack` brings up (or joins) Ray, starts the controller (named `adapt-controller` in
namespace `adapt`, so `adapt policy push` finds it) and `num_workers` decoder workers, each with
``torch`` threads = cores / workers, and returns a `Stack` whose `app` is the FastAPI app over a
least-loaded `ActorRouter`. `HttpServer` runs that app with uvicorn on a background thread
(tests, the load benchmark); ``adapt serve`` runs it in the foreground.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from adapt.targets import ServerDefaults

__all__ = ["Stack", "start_stack", "HttpServer"]

log = logging.getLogger(__name__)


@dataclass
class Stack:
    """A running serving stack (see `start_stack`)."""

    controller: Any
    workers: dict[str, Any]
    router: Any
    app: Any
    store: Any
    owns_ray: bool = False
    worker_ids: list[str] = field(default_factory=list)

    def shutdown(self) -> None:
        import ray

        for handle in self.workers.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - already dead
                pass
            ray.kill(handle, no_restart=True)
        try:
            ray.get(self.controller.shutdown.remote(), timeout=5)
        except Exception:  # noqa: BLE001
            pass
        ray.kill(self.controller, no_restart=True)
        if self.owns_ray:
            ray.shutdown()


def start_stack(target: str, drafter: str | None, *, num_workers: int = 1, redis_url: str | None = None,
                policy: str | None = None, policy_file: str | None = None, model_name: str = "adapt-demo",
                defaults: ServerDefaults | None = None, engine_options: dict[str, Any] | None = None,
                ray_address: str | None = None, num_cpus: int | None = None, worker_cpus: float = 1.0,
                worker_resources: list[dict[str, float]] | None = None, num_threads: int | None = None,
                heartbeat_s: float = 0.5, ttl_s: float = 3.0, default_max_tokens: int = 64,
                max_restarts: int = 3, name_prefix: str = "adapt-worker", api_keys: Any = None,
                max_queue: int | None = None, max_body_bytes: int | None = None) -> Stack:
    """Start the controller and `num_workers` decoder workers; see the module docstring.

    worker_resources: per worker, custom Ray resources to pin it (e.g. ``{"node_b": 1}``).
    max_restarts: how often Ray replaces a worker whose process died (it reloads the models under
    the same name; the router takes it back once it answers); -1 = always.
    api_keys: `adapt.serving.auth.ApiKeys` every ``/v1`` route requires (None: open).
    max_queue: generation requests allowed to wait beyond what the workers run at once
    (workers × max_batch) before the ingress answers 429 (None: no limit); max_body_bytes:
    largest request body (413 above; None: `adapt.serving.limits.DEFAULT_MAX_BODY_BYTES`).
    engine_options: keyword arguments of `workers.engine.EngineConfig` (max_batch, max_len, dtype,
    ...), checked first (`adapt.serving.engine_options`: an unknown or ill-typed one is a
    ValueError naming it, before Ray or any worker starts).
    """
    import ray

    from adapt.serving.controller_actor import CONTROLLER_NAME, NAMESPACE, ActorStoreClient, Controller
    from adapt.serving.engine_options import validate_engine_options
    from adapt.serving.http_app import build_app
    from adapt.serving.limits import DEFAULT_MAX_BODY_BYTES, Limits
    from adapt.serving.router import ActorRouter
    from adapt.serving.store import open_store
    from adapt.serving.worker_plugin import ServingPlugin
    from workers.ray_worker import DecoderWorker

    # checked before anything starts: an unknown or ill-typed option is a ValueError naming it
    engine_config = validate_engine_options({"target": str(target), "drafter": None if drafter is None else str(drafter),
                                             **(engine_options or {})})
    owns_ray = False
    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
        else:
            _init_local_ray(num_cpus or os.cpu_count() or 1, NAMESPACE)
        owns_ray = True
    cores = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    threads = num_threads or max(1, cores // max(1, num_workers))

    controller = ray.remote(Controller).options(name=CONTROLLER_NAME, namespace=NAMESPACE, num_cpus=0,
                                                max_concurrency=16, get_if_exists=False).remote(redis_url)
    ray.get(controller.ping.remote(), timeout=60)
    worker_store: Any = redis_url if redis_url else ActorStoreClient(controller)
    if policy_file:
        from adapt import policy_file as pf_module

        doc = pf_module.load(policy_file).to_dict()
        ray.get(controller.push_policy.remote(doc))

    handles: dict[str, Any] = {}
    for i in range(num_workers):
        wid = f"{name_prefix}-{i}"
        plugin = functools.partial(ServingPlugin, store=worker_store, policy=policy, heartbeat_s=heartbeat_s,
                                   ttl_s=ttl_s, meta={"index": i})
        options: dict[str, Any] = dict(name=wid, namespace=NAMESPACE, num_cpus=worker_cpus, max_concurrency=1000,
                                       max_restarts=max_restarts)
        if worker_resources and i < len(worker_resources):
            options["resources"] = worker_resources[i]
        handles[wid] = ray.remote(DecoderWorker).options(**options).remote(wid, engine_config, plugin, threads)
    infos = ray.get([h.info.remote() for h in handles.values()], timeout=600)  # engines loaded

    store = open_store(redis_url) if redis_url else ActorStoreClient(controller)
    router = ActorRouter(handles, store)
    limits = Limits(max_running=sum(int(i["max_batch"]) for i in infos), max_queue=max_queue,
                    max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES)
    app = build_app(router, model_name=model_name, defaults=defaults, default_max_tokens=default_max_tokens,
                    api_keys=api_keys, limits=limits)
    app.state.controller = controller
    return Stack(controller=controller, workers=handles, router=router, app=app, store=store, owns_ray=owns_ray,
                 worker_ids=list(handles))


def _init_local_ray(num_cpus: int, namespace: str, attempts: int = 3) -> None:
    """Start a local Ray; retried because on an overloaded machine its agents can start too slowly
    for the raylet's start-up deadline ("node timed out during startup")."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=False)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception here
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            log.warning("Ray start-up timed out (attempt %d of %d), retrying", attempt, attempts)
            ray.shutdown()


class HttpServer:
    """uvicorn serving `app` on a background thread (`url` once started)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="adapt-http")

    def start(self, timeout_s: float = 30.0) -> "HttpServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"HTTP server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
