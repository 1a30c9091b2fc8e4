"""Shared serving state: worker load and heartbeats, versioned policies, the trace stream.

Three kinds of state are shared between the decoder workers, the ingress and the controller:

- **load** (one JSON object per worker: queue depth, running rows, counters) written every
  heartbeat with an expiry (TTL). A worker whose heartbeat expired is gone from `loads()`; the
  ingress's ``/health`` and ``/metrics`` stop showing it and the controller stops counting it.
- **policies**: JSON documents with a monotonically increasing *version*. `put_policy` stores a
  new version and notifies subscribers; workers hot-reload it between engine steps.
- **traces**: a capped append-only stream of trace records (contracts §6); the oldest records
  fall off when it is full. Refits of the predictor read it.

`StateStore` is the interface; `InProcessStore` implements it in memory for one process (and is
what the Controller replica hosts when no Redis URL is given); `adapt.serving.redis_store.RedisStore`
implements it on Redis. Everything stored is JSON: nothing is ever unpickled from shared state.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

__all__ = ["StateStore", "InProcessStore", "Subscription", "open_store", "DEFAULT_TRACE_MAXLEN"]

DEFAULT_TRACE_MAXLEN = 100_000
POLICY_HISTORY = 16  # older policy versions are deleted
RETRY_S = 0.5  # a policy subscriber that raised is called again after this long

log = logging.getLogger(__name__)


class Subscription:
    """A handle on a running policy subscription; `close()` stops it."""

    def __init__(self, stop: Callable[[], None]):
        self._stop = stop

    def close(self) -> None:
        self._stop()


class StateStore(abc.ABC):
    """Interface of the shared serving state (see the module docstring)."""

    # -- load and heartbeats -------------------------------------------------------------
    @abc.abstractmethod
    def put_load(self, worker_id: str, load: dict[str, Any], ttl_s: float) -> None:
        """Record a worker's load; it expires after `ttl_s` seconds unless refreshed."""

    @abc.abstractmethod
    def loads(self) -> dict[str, dict[str, Any]]:
        """Live workers' last load records (expired ones are gone)."""

    @abc.abstractmethod
    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker at once (clean shutdown)."""

    # -- versioned policies --------------------------------------------------------------
    @abc.abstractmethod
    def put_policy(self, doc: dict[str, Any]) -> int:
        """Store `doc` as the new current policy and notify subscribers; returns its version (≥ 1)."""

    @abc.abstractmethod
    def get_policy(self, version: int | None = None) -> tuple[int, dict[str, Any]] | None:
        """(version, doc) of `version` (default: the current one), or None if there is none."""

    @abc.abstractmethod
    def policy_version(self) -> int:
        """The current policy version (0 when none was ever pushed)."""

    @abc.abstractmethod
    def subscribe_policy(self, callback: Callable[[int], None]) -> Subscription:
        """Call `callback(version)` (from a background thread) whenever a new version is put.

        Subscribers may miss notifications while the store is unreachable; on reconnecting they
        are called with the current version, so a subscriber must treat the callback as "check
        the current version" and ignore versions it already has. A callback that raises (it could
        not read the version) is called again, with that version or a newer one, after
        `RETRY_S`, until it returns or the subscription is closed.
        """

    # -- trace stream --------------------------------------------------------------------
    @abc.abstractmethod
    def add_traces(self, records: list[dict[str, Any]]) -> None:
        """Append trace records to the capped stream."""

    @abc.abstractmethod
    def read_traces(self, count: int | None = None) -> list[dict[str, Any]]:
        """The newest `count` records (all when None), oldest first."""

    @abc.abstractmethod
    def trace_len(self) -> int:
        """Number of records in the stream."""

    # -- misc ----------------------------------------------------------------------------
    def ping(self) -> bool:
        """True when the store answers."""
        return True

    def close(self) -> None:
        """Release connections and stop background threads."""


def _json_roundtrip(obj: dict[str, Any], what: str) -> dict[str, Any]:
    """Copy `obj` through JSON, as the Redis store would, so both stores accept the same things."""
    if not isinstance(obj, dict):
        raise TypeError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return json.loads(json.dumps(obj))


class InProcessStore(StateStore):
    """The store in memory, for one process; thread-safe. Same semantics as `RedisStore`."""

    def __init__(self, trace_maxlen: int = DEFAULT_TRACE_MAXLEN):
        self._lock = threading.Lock()
        self._loads: dict[str, tuple[float, dict[str, Any]]] = {}  # id -> (expires_at, load)
        self._policies: dict[int, dict[str, Any]] = {}
        self._version = 0
        self._traces: deque[dict[str, Any]] = deque(maxlen=trace_maxlen)
        self._subscribers: list[Callable[[int], None]] = []

    def put_load(self, worker_id: str, load: dict[str, Any], ttl_s: float) -> None:
        load = _json_roundtrip(load, "load")
        with self._lock:
            self._loads[str(worker_id)] = (time.monotonic() + float(ttl_s), load)

    def loads(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            for wid in [w for w, (exp, _) in self._loads.items() if exp <= now]:
                del self._loads[wid]
            return {w: json.loads(json.dumps(load)) for w, (_, load) in self._loads.items()}

    def remove_worker(self, worker_id: str) -> None:
        with self._lock:
            self._loads.pop(str(worker_id), None)

    def put_policy(self, doc: dict[str, Any]) -> int:
        doc = _json_roundtrip(doc, "policy")
        with self._lock:
            self._version += 1
            version = self._version
            self._policies[version] = doc
            for old in [v for v in self._policies if v <= version - POLICY_HISTORY]:
                del self._policies[old]
            subscribers = list(self._subscribers)
        for callback in subscribers:
            threading.Thread(target=self._notify, args=(callback, version), daemon=True).start()
        return version

    def _notify(self, callback: Callable[[int], None], version: int) -> None:
        """Call `callback(version)` until it returns, it is unsubscribed, or a newer version is out."""
        while True:
            try:
                callback(version)
                return
            except Exception as exc:  # noqa: BLE001 - the subscriber could not take it: retried
                log.warning("policy subscriber failed on version %d, retrying: %s", version, exc)
            time.sleep(RETRY_S)
            with self._lock:
                if callback not in self._subscribers or self._version != version:
                    return  # the newer version's own notification takes over

    def get_policy(self, version: int | None = None) -> tuple[int, dict[str, Any]] | None:
        with self._lock:
            v = self._version if version is None else int(version)
            doc = self._policies.get(v)
            return None if doc is None else (v, json.loads(json.dumps(doc)))

    def policy_version(self) -> int:
        with self._lock:
            return self._version

    def subscribe_policy(self, callback: Callable[[int], None]) -> Subscription:
        with self._lock:
            self._subscribers.append(callback)

        def stop() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return Subscription(stop)

    def add_traces(self, records: list[dict[str, Any]]) -> None:
        copies = [_json_roundtrip(r, "trace record") for r in records]
        with self._lock:
            self._traces.extend(copies)

    def read_traces(self, count: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._traces)
        return items if count is None else items[-int(count):] if count > 0 else []

    def trace_len(self) -> int:
        with self._lock:
            return len(self._traces)


def open_store(url: str | None, **kwargs: Any) -> StateStore:
    """A store for `url`: `RedisStore` for ``redis://`` / ``rediss://`` / ``unix://`` URLs,
    `InProcessStore` for None or ``memory://``."""
    if url is None or url in ("", "memory://"):
        return InProcessStore(**{k: v for k, v in kwargs.items() if k == "trace_maxlen"})
    if url.startswith(("redis://", "rediss://", "unix://")):
        from adapt.serving.redis_store import RedisStore

        return RedisStore(url, **kwargs)
    raise ValueError(f"redis_url: expected redis://host:port[/db], rediss://, unix:// or memory://, got {url!r}")
