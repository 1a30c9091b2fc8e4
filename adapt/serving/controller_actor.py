"""The central controller (the ``Controller`` Serve deployment): cluster load, versioned policies, refits.

The control plane of `docs/architecture.md`: it is never on a request's path. It

- aggregates the live load of every worker from their heartbeats (`cluster_load`);
- validates and publishes policies (`push_policy`): a document that fails
  `adapt.policy_file` validation, or whose settings its policy does not take
  (`adapt.controller.validate_settings`), is rejected with an error naming the field, and the current
  version stays; a valid one becomes a new store version that every worker hot-reloads;
- refits the acceptance predictor (and the cost tables) from the trace stream on demand
  (`fit_from_traces`) and publishes the result as a new version.

Without a Redis URL it hosts the `InProcessStore` itself, and the Decoder and Ingress replicas
reach it through `ControllerStoreClient`, which implements the same `StateStore` interface with
calls on the deployment's Serve handle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

from adapt.serving.store import StateStore, Subscription, open_store

__all__ = ["Controller", "ControllerStoreClient", "APP_NAME", "CONTROLLER_DEPLOYMENT", "NAMESPACE", "publish_policy",
           "fit_policy"]

log = logging.getLogger(__name__)

APP_NAME = "adapt"                  # the Serve application `adapt serve` runs
CONTROLLER_DEPLOYMENT = "Controller"  # its controller's deployment (`adapt policy push` calls it by name)
NAMESPACE = "adapt"                 # the Ray namespace `adapt serve` starts or joins Ray in
_STORE_METHODS = {"put_load", "loads", "remove_worker", "put_policy", "get_policy", "policy_version",
                  "add_traces", "read_traces", "trace_len", "ping"}


def publish_policy(store: StateStore, doc: Any) -> dict[str, Any]:
    """Validate a policy document and publish it as a new version; returns its versions.

    Raises `adapt.policy_file.PolicyFileError` (naming the field: ``policy.settings.NAME`` for a
    setting its policy does not know or of the wrong type) and leaves the store unchanged when the
    document is invalid.
    """
    from adapt.controller import validate_settings
    from adapt.serving.worker_plugin import decisions_from_policy, validate_policy_doc

    policy = validate_policy_doc(doc)
    validate_settings(policy.policy, policy.settings)
    decisions_from_policy(policy)  # the policy class must accept the setting values, too
    version = store.put_policy(doc)
    return {"store_version": version, "policy_version": policy.version, "policy": policy.policy}


def fit_policy(records: list[dict[str, Any]], base_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Refit the predictor and cost tables on trace records (`adapt.commands.policy.fit_policy`);
    returns a new policy document keeping `base_doc`'s policy name and settings (the current
    policy), or the defaults when there is none."""
    from adapt.commands.policy import fit_policy as fit_policy_file
    from adapt.serving.worker_plugin import validate_policy_doc

    name, settings = "adaptive", {}
    if base_doc is not None:
        try:
            base = validate_policy_doc(base_doc)
            name, settings = base.policy, dict(base.settings)
        except ValueError as exc:
            log.warning("current policy invalid, refitting on defaults: %s", exc)
    policy = fit_policy_file(records, policy=name, settings=settings)
    policy.report.update(source="trace stream", records_used=len(records))
    return policy.to_dict()


class Controller:
    """The controller's state and methods (wrapped by `adapt.serving.deployment.ControllerDeployment`)."""

    def __init__(self, store_url: str | None = None, refresh_s: float = 0.25, trace_maxlen: int | None = None):
        kwargs = {} if trace_maxlen is None else {"trace_maxlen": trace_maxlen}
        self.store_url = store_url
        self.store = open_store(store_url, **kwargs)
        self.refresh_s = refresh_s
        self._cluster: dict[str, Any] = {"workers": {}, "time": 0.0, "store_ok": False}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._aggregate_loop, daemon=True, name="adapt-controller")
        self._thread.start()

    # -- the in-process store, for ControllerStoreClient -------------------------------------------
    def store_call(self, method: str, *args: Any) -> Any:
        if method not in _STORE_METHODS:
            raise ValueError(f"method: {method!r} is not a store method")
        return getattr(self.store, method)(*args)

    # -- load --------------------------------------------------------------------------------------
    def _aggregate_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                loads = self.store.loads()
                ok = True
            except Exception:  # noqa: BLE001 - store down: keep the last view, mark it stale
                loads, ok = None, False
            with self._lock:
                if loads is not None:
                    self._cluster = {"workers": loads, "time": time.time(), "store_ok": True}
                else:
                    self._cluster["store_ok"] = ok

    def cluster_load(self) -> dict[str, Any]:
        """Totals over live workers plus each worker's load (without counters)."""
        with self._lock:
            workers = self._cluster["workers"]
            view = {w: {k: v for k, v in load.items() if k != "counters"} for w, load in workers.items()}
            return {"workers": view, "num_workers": len(view),
                    "running": sum(int(v.get("running", 0)) for v in view.values()),
                    "waiting": sum(int(v.get("waiting", 0)) for v in view.values()),
                    "time": self._cluster["time"], "store_ok": self._cluster["store_ok"]}

    # -- policies ----------------------------------------------------------------------------------
    def push_policy(self, doc: dict[str, Any]) -> dict[str, Any]:
        return publish_policy(self.store, doc)

    def policy_status(self) -> dict[str, Any]:
        """The store's current version and the version each live worker runs."""
        with self._lock:
            workers = dict(self._cluster["workers"])
        return {"store_version": self.store.policy_version(),
                "workers": {w: v.get("policy_version", 0) for w, v in workers.items()},
                "rejected": {w: v.get("rejected_policies", {}) for w, v in workers.items() if v.get("rejected_policies")}}

    def fit_from_traces(self, count: int | None = None, push: bool = True) -> dict[str, Any]:
        """Refit on the newest `count` trace records (all when None); publish when `push`."""
        records = self.store.read_traces(count)
        current = self.store.get_policy()
        doc = fit_policy(records, current[1] if current else None)
        out: dict[str, Any] = {"records": len(records), "report": doc["report"], "policy_version": doc["version"]}
        if push:
            out.update(publish_policy(self.store, doc))
        out["doc"] = doc
        return out

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self._stop.set()
        self.store.close()


class ControllerStoreClient(StateStore):
    """`StateStore` over the Controller deployment's in-process store (no Redis URL given), through
    its Serve handle: what the Decoder and Ingress replicas use, and `adapt.serving.launcher.Stack`.

    Calls block (``DeploymentResponse.result``); one made on a thread that runs an event loop (a
    replica's constructor runs on its user-code loop) is made from a helper thread, so it cannot
    stall that loop's own Serve calls. An unreachable controller is a `ConnectionError`, which
    the worker plugin and the HTTP front already treat as "store down".
    """

    def __init__(self, controller: Any, timeout_s: float = 10.0, poll_s: float = 0.5):
        self.controller = controller
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        def call() -> Any:
            return self.controller.store_call.remote(method, *args).result(timeout_s=timeout_s or self.timeout_s)

        try:
            if _in_event_loop():
                with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="adapt-store") as pool:
                    return pool.submit(call).result()
            return call()
        except Exception as exc:  # noqa: BLE001 - replica restarting, gone, or timed out
            raise ConnectionError(f"controller store unreachable: {type(exc).__name__}: {exc}") from exc

    def put_load(self, worker_id, load, ttl_s):
        return self._call("put_load", worker_id, load, ttl_s)

    def loads(self):
        return self._call("loads")

    def remove_worker(self, worker_id):  # at shutdown, when the controller may be gone already: brief
        return self._call("remove_worker", worker_id, timeout_s=1.0)

    def put_policy(self, doc):
        return self._call("put_policy", doc)

    def get_policy(self, version=None):
        out = self._call("get_policy", version)
        return None if out is None else (int(out[0]), out[1])

    def policy_version(self):
        return int(self._call("policy_version"))

    def add_traces(self, records):
        return self._call("add_traces", records)

    def read_traces(self, count=None):
        return self._call("read_traces", count)

    def trace_len(self):
        return int(self._call("trace_len"))

    def ping(self) -> bool:
        try:
            return bool(self._call("ping"))
        except ConnectionError:
            return False

    def subscribe_policy(self, callback: Callable[[int], None]) -> Subscription:
        """Polls the version every `poll_s` (Serve calls have no push channel); a version whose
        callback raised (its read timed out on a busy controller) is delivered again on the next poll."""
        stop = threading.Event()

        def poll() -> None:
            last = -1
            while not stop.is_set():
                try:
                    version = self.policy_version()
                    if version != last:
                        callback(version)
                        last = version
                except Exception:  # noqa: BLE001 - controller busy or restarting: polled again
                    pass
                stop.wait(self.poll_s)

        threading.Thread(target=poll, daemon=True, name="adapt-policy-poll").start()
        return Subscription(stop.set)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
