"""Start the serving application on this machine's Ray (``adapt serve``, the tests).

`start_stack` brings up (or joins) Ray, starts Serve with its HTTP proxy on ``host:port`` and
runs the one serving application (`adapt.serving.deployment.app_builder`, the same that
``serve deploy deploy/serve_config.yaml`` runs on a cluster) with ``num_workers`` Decoder
replicas, each with ``torch`` threads = cores / workers; it returns once every replica is up,
reporting each stage to `progress` (Ray, Serve, the replicas as they come up). Serve's
proxy readiness and health-check timeouts are the ones a loaded machine needs
(`adapt.serving.startup`). A start that fails raises `adapt.serving.startup.StartupError` (one
line: the cause and the fix) after stopping what it started: Serve, and Ray when it started it.
`HttpServer` runs a FastAPI app with uvicorn on a background thread (the in-process tests, which
put one decoder worker behind `adapt.serving.http_app.build_app` without Ray).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from adapt.serving.startup import StartupError, one_line_cause, serve_controller_env
from adapt.targets import ServerDefaults

__all__ = ["Stack", "start_stack", "HttpServer"]

log = logging.getLogger(__name__)


@dataclass
class Stack:
    """A running serving application (see `start_stack`): its URL, the Serve handles of its
    Controller and Decoder deployments, and the state store every replica shares."""

    url: str
    controller: Any
    decoder: Any
    store: Any
    app_name: str
    owns_ray: bool = False
    owns_serve: bool = False

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            if self.owns_serve:
                serve.shutdown()
            else:  # a Serve that was running before: remove only this application
                serve.delete(self.app_name)
        except Exception as exc:  # noqa: BLE001 - e.g. Serve's controller slow to stop on a loaded machine
            if not self.owns_ray:
                raise
            log.warning("Serve did not shut down cleanly (%s); stopping Ray, which stops it", one_line_cause(exc))
        finally:
            if self.owns_ray:
                ray.shutdown()


# Serve's router places a request on a replica by its queue length: from its own cache (what it
# sent) or, for a replica not in it, by asking the replica, with 0.1 s to answer by default. On a
# machine whose cores the decoders keep busy the answer is often later; the replica then stays out
# of the cache, and every request goes to the replicas in it until they are full (two workers, six
# requests: all six on one, seen here). A second to answer keeps every replica in the running.
_ROUTER_ENV = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "1.0"}


def start_stack(target: str, drafter: str | None, *, num_workers: int = 1, redis_url: str | None = None,
                policy: str | None = None, policy_file: str | None = None, model_name: str = "adapt-demo",
                defaults: ServerDefaults | None = None, engine_options: dict[str, Any] | None = None,
                ray_address: str | None = None, num_cpus: int | None = None, worker_cpus: float = 1.0,
                worker_resources: dict[str, float] | None = None, num_threads: int | None = None,
                heartbeat_s: float = 0.5, ttl_s: float = 3.0, default_max_tokens: int = 64,
                api_keys: Any = None, max_queue: int | None = None, max_body_bytes: int | None = None,
                host: str = "127.0.0.1", port: int = 0, app_name: str = "adapt",
                progress: Callable[[str], None] | None = None, start_timeout_s: float = 600.0,
                on_ray_started: Callable[[], None] | None = None) -> Stack:
    """Run the serving application on Ray; see the module docstring.

    worker_resources: custom Ray resources every Decoder replica takes (e.g. ``{"decoder_slot":
    1}`` with one such slot per node pins one replica per node).
    api_keys: `adapt.serving.auth.ApiKeys` (or key strings) every ``/v1`` route requires (None: open;
    ADAPT_API_KEY in the Ingress replica's environment still counts). defaults: the server's
    ``tpot_ms`` and ``quality`` for requests that set none.
    max_queue: generation requests allowed to wait beyond what the workers run at once
    (workers × max_batch) before the ingress answers 429 (None: the Ingress's default admission);
    max_body_bytes: largest request body (413 above; None: `adapt.serving.limits.DEFAULT_MAX_BODY_BYTES`).
    engine_options: keyword arguments of `workers.engine.EngineConfig` (max_batch, max_len, dtype,
    ...), checked first (`adapt.serving.engine_options`: an unknown or ill-typed one is a
    ValueError naming it, before Ray or any worker starts); so is the policy file.
    A worker whose process dies is replaced by Serve (it reloads the models and the store's
    current policy); port 0 picks a free port.
    progress: called with a line per start-up stage (default: logged). start_timeout_s: how long
    the application may take to run every replica before the start fails (StartupError).
    on_ray_started: called once this process has started (or joined) Ray, whose start puts its
    own SIGTERM handler in place (a stack dump and an abort): a caller that stops on SIGTERM puts
    its handler back there.
    """
    import ray
    from ray import serve

    from adapt.serving.controller_actor import CONTROLLER_DEPLOYMENT, NAMESPACE, ControllerStoreClient
    from adapt.serving.deployment import Decoder, app_builder
    from adapt.serving.engine_options import validate_engine_options
    from adapt.serving.store import open_store

    # checked before anything starts: an unknown or ill-typed option is a ValueError naming it
    engine_options = validate_engine_options(engine_options)
    max_batch = int(engine_options.get("max_batch", _engine_default("max_batch")))
    say = progress or log.info
    local = not ray.is_initialized() and not ray_address
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    elif local:  # a local Ray has no Serve yet: the port must be free for its proxy
        _check_port_free(host, port)
    owns_ray = False
    if not ray.is_initialized():
        say(f"starting Ray ({'joining ' + ray_address if ray_address else 'local, %d CPUs' % (num_cpus or os.cpu_count() or 1)})")
        try:
            if ray_address:
                ray.init(address=ray_address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=True)
            else:
                _init_local_ray(num_cpus or os.cpu_count() or 1, NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - Ray raises bare Exceptions here
            if ray.is_initialized():
                ray.shutdown()
            fix = ("start the cluster first (`ray start --head`) or check the address" if ray_address else
                   "free some CPU, or start Ray yourself (`ray start --head`) and pass --ray-address auto")
            raise StartupError(f"Ray did not start ({one_line_cause(exc)}); fix: {fix}") from exc
        owns_ray = True
        say("Ray is up")
        if on_ray_started is not None:
            on_ray_started()
    cores = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    threads = num_threads or max(1, cores // max(1, num_workers))
    defaults = defaults or ServerDefaults()
    actor_options: dict[str, Any] = {"num_cpus": worker_cpus, "num_gpus": 0}  # the GPU comes from the engine's device
    if worker_resources:
        actor_options["resources"] = dict(worker_resources)
    args = {"target": str(target), "drafter": None if drafter is None else str(drafter), "redis_url": redis_url,
            "policy": policy, "policy_file": policy_file, "model_name": model_name, "engine_options": engine_options,
            "num_threads": threads, "heartbeat_s": heartbeat_s, "ttl_s": ttl_s,
            "default_tpot_ms": defaults.tpot_ms, "default_quality": str(defaults.quality),
            "default_max_tokens": default_max_tokens, "api_keys": api_keys, "max_body_bytes": max_body_bytes,
            "max_queue": max_queue,
            # a replica being stopped checks for unfinished requests every 0.5 s (Serve: 2 s)
            "decoder_options": {"num_replicas": num_workers, "max_ongoing_requests": max_batch,
                                "ray_actor_options": actor_options, "graceful_shutdown_wait_loop_s": 0.5},
            "ingress_options": {"ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": _ROUTER_ENV}},
                                "graceful_shutdown_wait_loop_s": 0.5}}
    owns_serve = False
    try:
        if local:  # a fixed set of nodes: a replica no node can hold would wait for ever
            _check_placeable(actor_options, num_workers)
        app = app_builder(args)  # checks the policy file (and publishes it to Redis) before Serve starts
        owns_serve = not _serve_running()
        if owns_serve:
            say(f"starting Serve (its controller and the HTTP proxy on {host}:{port})")
        try:
            serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port},
                        controller_options={"runtime_env": {"env_vars": serve_controller_env()}})
        except Exception as exc:  # noqa: BLE001 - the proxy missed its readiness check, or died
            ready = serve_controller_env()["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]
            raise StartupError(
                f"Serve's HTTP proxy on {host}:{port} did not become ready ({one_line_cause(exc)}); fix: free some "
                f"CPU or raise RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (now {ready} s), and check that nothing "
                f"else holds port {port}") from exc
        say(f"Serve is up; deploying application {app_name!r}: Controller, Ingress, {num_workers} Decoder "
            "replica(s) (each loads the models)")
        # no access log line per request (as uvicorn at "warning" before)
        serve.run_many([serve.RunTarget(app, name=app_name, route_prefix="/",
                                        logging_config={"enable_access_log": False})],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
        _wait_running(app_name, start_timeout_s, say)
    except BaseException:
        try:
            if owns_serve:
                serve.shutdown()
            elif _serve_running():
                serve.delete(app_name)
        except Exception:  # noqa: BLE001 - the start's own error is the one to report
            log.exception("cleaning up after a failed start")
        if owns_ray:
            ray.shutdown()
        raise
    controller = serve.get_deployment_handle(CONTROLLER_DEPLOYMENT, app_name=app_name)
    decoder = serve.get_deployment_handle(Decoder.name, app_name=app_name)
    store = open_store(redis_url) if redis_url else ControllerStoreClient(controller)
    return Stack(url=f"http://{host}:{port}", controller=controller, decoder=decoder, store=store,
                 app_name=app_name, owns_ray=owns_ray, owns_serve=owns_serve)


def _engine_default(name: str) -> Any:
    import dataclasses

    from workers.engine import EngineConfig

    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise StartupError(f"port {port} on {host} is in use ({exc.strerror}); fix: pass another --port, or stop "
                               "the process that holds it") from None


def _check_placeable(actor_options: dict[str, Any], num_workers: int) -> None:
    """A StartupError when no node of this Ray can hold one Decoder replica (Serve would wait for
    resources for ever)."""
    import ray

    need = {"CPU": float(actor_options.get("num_cpus") or 0), **actor_options.get("resources", {})}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if any(all(node.get(k, 0.0) >= v for k, v in need.items() if v > 0) for node in nodes):
        return
    have = ", ".join(f"{k}={max((n.get(k, 0.0) for n in nodes), default=0):g}" for k in need)
    wanted = ", ".join(f"{k}={v:g}" for k, v in need.items())
    raise StartupError(f"no Ray node can hold a Decoder replica: each needs {wanted}, the largest node has {have}; "
                       "fix: lower --worker-cpus (or join a cluster with such a node: --ray-address)")


def _wait_running(app_name: str, timeout_s: float, say: Callable[[str], None], poll_s: float = 0.5) -> None:
    """Wait until Serve reports application `app_name` RUNNING, reporting replica counts as they
    change; a StartupError when it fails to deploy or `timeout_s` passes first."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    summary = ""
    while True:
        status = serve.status()
        app = status.applications.get(app_name)
        if app is not None:
            state = str(getattr(app.status, "value", app.status))
            if state == "RUNNING":
                say(f"application {app_name!r} is running")
                return
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                detail = [line.strip() for line in (app.message or "").splitlines() if line.strip()]
                for dep in app.deployments.values():
                    detail += [line.strip() for line in (dep.message or "").splitlines() if line.strip()]
                cause = detail[-1] if detail else state
                raise StartupError(f"application {app_name!r} failed to start ({state}: {cause[:300]}); fix: see the "
                                   "error it names (the replica's log is under /tmp/ray/session_latest/logs/serve)")
            summary = "; ".join(f"{name} " + ", ".join(f"{n} {str(getattr(k, 'value', k)).lower()}"
                                                       for k, n in dep.replica_states.items())
                                for name, dep in sorted(app.deployments.items()) if dep.replica_states)
            if summary:
                say(f"replicas: {summary}")
        if time.monotonic() > deadline:
            raise StartupError(f"application {app_name!r} not running after {timeout_s:g} s (replicas: "
                               f"{summary or 'none yet'}); fix: free some CPU or memory, or raise --start-timeout-s")
        time.sleep(poll_s)


def _serve_running() -> bool:
    """Whether a Serve controller already runs on this Ray (then only our application is removed)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


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
