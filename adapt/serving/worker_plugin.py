"""What serving adds to a decoder worker: heartbeats, hot-reloaded policies, traces, SLA verdicts.

`ServingPlugin` is handed to `workers.ray_worker.DecoderWorker` (which imports nothing of
`adapt`) through a picklable factory, ``functools.partial(ServingPlugin, store=..., ...)``; it
implements `workers.protocols.WorkerPlugin` with both optional hooks (``on_step``, ``aborted``),
which the worker checks when it starts (`workers.protocols.check_plugin`). In the worker process it:

- heartbeats the worker's load and counters into the store every `heartbeat_s` with a TTL, so
  the ingress (``/health``, ``/metrics``) and the controller see live load, and a dead worker
  disappears on its own;
- builds the decision maker from the store's current policy (or the named policy) and
  subscribes to new versions: each one is validated (`adapt.policy_file`), built, and swapped in
  between engine steps; a version that fails to load is logged and the old one stays;
- turns the request's SLA (`adapt.targets.RequestTargets`) into the engine's static knobs and
  the `targets` object the decision maker reads;
- judges each finished request against its SLA (*TPOT* = time per output token after the
  first; *TTFT* = time to first token; quality: TVD spent within the per-token budget).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from adapt.serving.metrics import WorkerCounters
from adapt.serving.store import StateStore, open_store
from adapt.serving.trace_sink import StoreTraceSink
from adapt.targets import RequestTargets
from workers.protocols import DecoderEngine

if TYPE_CHECKING:
    from workers.ray_worker import EngineLoop

__all__ = ["ServingPlugin", "decisions_from_policy", "validate_policy_doc"]

log = logging.getLogger(__name__)


def validate_policy_doc(doc: Any):
    """A policy document (JSON object) -> `adapt.policy_file.PolicyFile`, or `PolicyFileError`."""
    from adapt import policy_file

    if not isinstance(doc, dict):
        raise policy_file.PolicyFileError("policy: top level must be a JSON object")
    try:
        text = json.dumps(doc, allow_nan=False)
    except ValueError as exc:
        raise policy_file.PolicyFileError(f"policy: not valid JSON ({exc})") from None
    return policy_file.loads(text)


def decisions_from_policy(policy: Any, block_size: int | None = None, cost: Any = None,
                          name: str | None = None):
    """A `DecisionMaker` for a loaded `PolicyFile` (`adapt.controller.build_policy`), or for the
    registry policy ``name`` when ``policy`` is None; ``cost``: the worker's own profiled
    `CostModel` (a copy is handed in), else the file's (or the policy's stand-in)."""
    from adapt.controller import build_policy
    from adapt.cost_model import CostModel

    extra = {} if not block_size else {"block_size": int(block_size)}
    if cost is not None:
        extra["cost"] = CostModel.from_dict(cost.to_dict())
    return build_policy(name=name, policy=policy, **extra)


def _reload_in_place(current: Any, policy: Any, keep_cost: bool = False) -> bool:
    """Update a running policy of the same class in place (keeps its per-request books and, with
    ``keep_cost``, the cost model it profiled and corrected on this worker)."""
    if current is None or getattr(current, "name", None) != policy.policy or not hasattr(current, "update"):
        return False
    from adapt.controller import reload

    reload(current, policy, keep_cost=keep_cost)
    return True


def _digest(doc: Any) -> str:
    """Content digest of a stored policy document (its own checksum field may be corrupt)."""
    import hashlib

    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _env_flag(name: str) -> bool:
    import os

    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _resolve_store(store: Any) -> StateStore:
    if store is None or isinstance(store, str):
        return open_store(store)
    return store


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux: /proc/self/statm; elsewhere None)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ServingPlugin:
    """See the module docstring. `store`: a Redis URL, None (a private in-process store), or a
    `StateStore` (e.g. `adapt.serving.controller_actor.ControllerStoreClient`)."""

    def __init__(self, worker_id: str, store: Any = None, policy: str | None = None,
                 heartbeat_s: float = 0.5, ttl_s: float = 3.0, meta: dict[str, Any] | None = None,
                 profile_cost: bool = True):
        self.worker_id = worker_id
        self.store = _resolve_store(store)
        self.policy_name = policy
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.meta = dict(meta or {})
        self.counters = WorkerCounters()
        self._sink = StoreTraceSink(self.store, self.counters)
        self._loop = None
        self._stop = threading.Event()
        self._version_lock = threading.Lock()
        self._loaded_version = 0
        self._loaded_checksum = ""
        self._rejected: dict[int, str] = {}
        self._rejected_checksums: dict[int, str] = {}
        self._sub = None
        self._threads: list[threading.Thread] = []
        self._store_ok = True
        self.block_size: int | None = None
        self.profile_cost = profile_cost
        self.cost = None  # this worker's profiled CostModel (adapt.controller.profile_engine)

    # -- the plugin protocol (workers.protocols.WorkerPlugin, PluginHooks) --------------------
    def decisions(self, engine: DecoderEngine | None = None):
        """The decision maker to start with: the store's current policy, else the named one."""
        self.block_size = int(getattr(engine, "block", 0) or 0) or None
        # no drafter, nothing for a policy to choose (and no cost model to profile or read)
        if (self.profile_cost and engine is not None and hasattr(engine, "tcache")
                and getattr(engine, "drafter", None) is not None):
            try:
                from adapt.profile_cache import engine_profile

                # this machine's stored profile for this engine (adapt/profile_cache.py), timed
                # once per machine and model; ADAPT_REPROFILE=1 times it again
                self.cost, info = engine_profile(engine, refresh=_env_flag("ADAPT_REPROFILE"))
                log.info("worker %s cost model %s: verify(1) %.2f ms, overhead %.2f ms (%s)", self.worker_id,
                         "read back" if info["cached"] else f"profiled in {info['built_s']} s",
                         self.cost.verify.at(1.0), self.cost.overhead_ms, info["path"])
            except Exception as exc:  # noqa: BLE001 - profiling is an optimisation; never block start-up
                log.warning("cost profiling failed, using the policy file's cost model: %s", exc)
                self.cost = None
        try:
            current = self.store.get_policy()
        except Exception as exc:  # noqa: BLE001 - store down at start: fall back to the named policy
            log.warning("state store unreachable at start: %s", exc)
            current = None
        if current is not None:
            version, doc = current
            try:
                dm = decisions_from_policy(validate_policy_doc(doc), self.block_size, self.cost)
                self._loaded_version, self._loaded_checksum = version, _digest(doc)
                return dm
            except Exception as exc:  # noqa: BLE001
                self._rejected[version] = str(exc)
                log.error("current policy version %d rejected: %s", version, exc)
        if self.policy_name:
            return decisions_from_policy(None, self.block_size, self.cost, name=self.policy_name)
        return None

    def trace_sink(self) -> StoreTraceSink:
        return self._sink

    def on_step(self, step_ms: float, rows: int) -> None:
        self.counters.observe_step(step_ms)

    def start(self, loop: EngineLoop) -> None:
        self._loop = loop
        loop.policy_version = self._loaded_version
        hb = threading.Thread(target=self._heartbeat_loop, daemon=True, name="adapt-heartbeat")
        hb.start()
        self._threads.append(hb)
        self._sub = self.store.subscribe_policy(self._on_policy_version)

    def prepare(self, request: dict[str, Any]) -> tuple[dict[str, Any], RequestTargets]:
        """Request -> (static knobs for `DecodeKnobs`, the targets object for the decision maker)."""
        targets = RequestTargets.model_validate(request.get("targets") or {})
        knobs: dict[str, Any] = {"quality": str(targets.quality)}
        knobs.update(request.get("decode") or {})
        return knobs, targets

    def finish(self, request: dict[str, Any], targets: RequestTargets, timing: dict[str, Any],
               stats: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        """The SLA verdict of a finished request (also counted for /metrics)."""
        sla = sla_verdict(targets, timing, stats)
        self.counters.observe_request(finish_reason or "unknown", sla)
        return {"sla": sla, "targets": {"tpot_ms": targets.effective_tpot_ms, "ttft_ms": targets.ttft_ms,
                                        "quality": str(targets.quality), "priority": targets.priority,
                                        "tvd_budget_total": targets.tvd_budget_total},
                "policy_version": self._loop.policy_version if self._loop else 0}

    def aborted(self, request: dict[str, Any]) -> None:
        """The client disconnected (or the router cancelled) before the request finished."""
        self.counters.observe_request("abort", None)

    def close(self) -> None:
        self._stop.set()
        if self._sub is not None:
            self._sub.close()
        self._sink.close()
        try:
            self.store.remove_worker(self.worker_id)
        except Exception:  # noqa: BLE001
            pass

    # -- background ------------------------------------------------------------------------------
    def _load_record(self) -> dict[str, Any]:
        record = dict(self._loop.load()) if self._loop else {}
        record.update(self.meta, worker_id=self.worker_id, time=time.time(), counters=self.counters.snapshot(),
                      rejected_policies={str(k): v for k, v in self._rejected.items()}, rss_bytes=_rss_bytes())
        return record

    def heartbeat(self) -> None:
        self.store.put_load(self.worker_id, self._load_record(), self.ttl_s)

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.heartbeat()
                if not self._store_ok:
                    log.info("state store reachable again")
                self._store_ok = True
            except Exception as exc:  # noqa: BLE001 - keep decoding while the store is down
                if self._store_ok:
                    log.warning("heartbeat failed (state store down?): %s", exc)
                self._store_ok = False
            self._stop.wait(self.heartbeat_s)

    def _on_policy_version(self, version: int) -> None:
        """Load, validate and install the store's policy `version` (called from the subscriber thread).

        A policy is identified by its content digest, not only by the store's counter: a Redis that
        restarted empty counts versions from 1 again, and an empty store (version 0) keeps the
        running policy. Raises when the store cannot be read, so the subscription delivers the
        version again (a busy controller's read times out; see `StateStore.subscribe_policy`).
        """
        with self._version_lock:
            if version <= 0:
                return
            try:
                found = self.store.get_policy(version)
            except Exception as exc:
                log.warning("cannot read policy version %d, the subscription retries: %s", version, exc)
                raise
            if found is None:
                return
            doc = found[1]
            checksum = _digest(doc)
            if checksum and checksum == self._loaded_checksum:
                self._loaded_version = version
                if self._loop is not None:
                    self._loop.policy_version = version
                return
            if version in self._rejected and self._rejected_checksums.get(version) == checksum:
                return
            try:
                policy = validate_policy_doc(doc)
                fresh = decisions_from_policy(policy, self.block_size, self.cost)  # builds only if the settings are valid
            except Exception as exc:  # noqa: BLE001 - a bad version never replaces a good one
                self._rejected[version] = str(exc)
                self._rejected_checksums[version] = checksum
                log.error("policy version %d rejected, keeping version %d: %s", version, self._loaded_version, exc)
                return
            self._loaded_version, self._loaded_checksum = version, checksum

            def install(engine) -> None:
                """Same policy class: update in place, keeping its per-request books; else swap."""
                if not _reload_in_place(getattr(engine, "decisions", None), policy, keep_cost=self.cost is not None):
                    engine.decisions = fresh

            self._loop.between_steps(install, version)
            log.info("policy version %d (%s) loaded", version, policy.version)


def sla_verdict(targets: RequestTargets, timing: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """Observed TTFT / TPOT / TVD against the request's targets.

    timing: ``arrival``, ``first`` and ``last`` token times (monotonic seconds), ``tokens``.
    ``met`` is True when every target the request has was met (None entries: no such target).
    """
    tokens = int(timing.get("tokens") or 0)
    first, last, arrival = timing.get("first"), timing.get("last"), timing.get("arrival")
    ttft_ms = (first - arrival) * 1e3 if first is not None and arrival is not None else None
    tpot_ms = (last - first) * 1e3 / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    tvd = float(stats.get("tvd_spent", 0.0) or 0.0)
    tpot_target = targets.effective_tpot_ms
    latency_met = None
    if tpot_target is not None and tpot_ms is not None:
        latency_met = tpot_ms <= tpot_target
    if targets.ttft_ms is not None and ttft_ms is not None:
        latency_met = (latency_met is not False) and ttft_ms <= targets.ttft_ms
    if targets.lossless:
        quality_met = tvd <= 1e-9
    else:
        quality_met = tvd <= targets.quality.eps * max(tokens, 1) + 1e-6
        if targets.tvd_budget_total is not None:
            quality_met = quality_met and tvd <= targets.tvd_budget_total + 1e-6
    met = all(v is not False for v in (latency_met, quality_met))
    return {"met": met, "latency_met": latency_met, "quality_met": quality_met,
            "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3),
            "tpot_ms": None if tpot_ms is None else round(tpot_ms, 3),
            "tvd_spent": tvd, "tokens": tokens}
