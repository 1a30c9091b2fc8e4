"""`StateStore` on Redis: expiring load keys, versioned policies with pub/sub, a capped stream.

Keys (all under a prefix, default ``adapt``):

| key | type | what |
|---|---|---|
| ``{p}:workers`` | set | ids of workers that ever heartbeated (pruned when their load key expired) |
| ``{p}:load:{id}`` | string, PX ttl | the worker's load record (JSON) |
| ``{p}:policy:version`` | string | the current policy version (INCR) |
| ``{p}:policy:{v}`` | string | policy document version v (JSON) |
| ``{p}:policy`` | pub/sub channel | the new version number, published on every put |
| ``{p}:traces`` | stream | one entry per trace record, field ``r`` = JSON, capped with MAXLEN (~ when large) |

Only JSON is written and read: nothing from Redis is ever unpickled. Connection failures raise
`StoreUnavailable` (a `ConnectionError`), so callers can keep serving while Redis is down.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import Any, Callable

import redis

from adapt.serving.store import DEFAULT_TRACE_MAXLEN, POLICY_HISTORY, RETRY_S, StateStore, Subscription

__all__ = ["RedisStore", "StoreUnavailable"]


class StoreUnavailable(ConnectionError):
    """The state store could not be reached."""


def _wrap_errors(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            raise StoreUnavailable(f"redis at {self.url} unreachable: {exc}") from exc

    return wrapper


class RedisStore(StateStore):
    """The serving state on Redis (see the module docstring)."""

    def __init__(self, url: str, prefix: str = "adapt", trace_maxlen: int = DEFAULT_TRACE_MAXLEN,
                 timeout_s: float = 1.0):
        self.url = url
        self.prefix = prefix
        self.trace_maxlen = int(trace_maxlen)
        self._timeout_s = timeout_s
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       decode_responses=True)
        self._subs: list[tuple[threading.Event, threading.Thread]] = []

    def __reduce__(self):  # ship the URL, not the connection pool, to Ray actors
        return (RedisStore, (self.url, self.prefix, self.trace_maxlen, self._timeout_s))

    def _k(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

    # -- load ---------------------------------------------------------------------------
    @_wrap_errors
    def put_load(self, worker_id: str, load: dict[str, Any], ttl_s: float) -> None:
        payload = json.dumps(load)
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self._k("load", worker_id), payload, px=max(1, int(ttl_s * 1000)))
        pipe.sadd(self._k("workers"), worker_id)
        pipe.execute()

    @_wrap_errors
    def loads(self) -> dict[str, dict[str, Any]]:
        ids = sorted(self._r.smembers(self._k("workers")))
        if not ids:
            return {}
        values = self._r.mget([self._k("load", w) for w in ids])
        out, expired = {}, []
        for wid, value in zip(ids, values):
            if value is None:
                expired.append(wid)
            else:
                out[wid] = json.loads(value)
        if expired:
            self._r.srem(self._k("workers"), *expired)
        return out

    @_wrap_errors
    def remove_worker(self, worker_id: str) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.delete(self._k("load", worker_id))
        pipe.srem(self._k("workers"), worker_id)
        pipe.execute()

    # -- policies -------------------------------------------------------------------------
    @_wrap_errors
    def put_policy(self, doc: dict[str, Any]) -> int:
        if not isinstance(doc, dict):
            raise TypeError(f"policy: expected a JSON object, got {type(doc).__name__}")
        payload = json.dumps(doc)
        version = int(self._r.incr(self._k("policy", "version")))
        pipe = self._r.pipeline(transaction=True)
        pipe.set(self._k("policy", version), payload)
        if version > POLICY_HISTORY:
            pipe.delete(self._k("policy", version - POLICY_HISTORY))
        pipe.publish(self._k("policy"), str(version))
        pipe.execute()
        return version

    @_wrap_errors
    def get_policy(self, version: int | None = None) -> tuple[int, dict[str, Any]] | None:
        if version is None:
            version = self.policy_version()
            if version == 0:
                return None
        value = self._r.get(self._k("policy", int(version)))
        return None if value is None else (int(version), json.loads(value))

    @_wrap_errors
    def policy_version(self) -> int:
        return int(self._r.get(self._k("policy", "version")) or 0)

    def subscribe_policy(self, callback: Callable[[int], None]) -> Subscription:
        stop = threading.Event()
        thread = threading.Thread(target=self._listen, args=(callback, stop), daemon=True,
                                  name="adapt-policy-subscriber")
        self._subs.append((stop, thread))
        thread.start()
        return Subscription(stop.set)

    def _listen(self, callback: Callable[[int], None], stop: threading.Event) -> None:
        """Subscribe; after every (re)connect report the current version (missed messages, or one
        whose callback raised)."""
        channel = self._k("policy")
        while not stop.is_set():
            pubsub = self._r.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(channel)
                callback(self.policy_version())
                while not stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message and message.get("type") == "message":
                        try:
                            version = int(message["data"])
                        except (TypeError, ValueError):
                            continue
                        callback(version)
            except Exception:  # noqa: BLE001 - Redis down, or the callback could not read the version
                stop.wait(RETRY_S)  # then reconnect and resync with the current version
            finally:
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass

    # -- traces -----------------------------------------------------------------------------
    @_wrap_errors
    def add_traces(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        pipe = self._r.pipeline(transaction=False)
        key = self._k("traces")
        approximate = self.trace_maxlen >= 10_000  # '~' trims whole nodes: cheap, exact enough when large
        for record in records:
            pipe.xadd(key, {"r": json.dumps(record)}, maxlen=self.trace_maxlen, approximate=approximate)
        pipe.execute()

    @_wrap_errors
    def read_traces(self, count: int | None = None) -> list[dict[str, Any]]:
        key = self._k("traces")
        if count is None:
            entries = self._r.xrange(key)
        elif count <= 0:
            return []
        else:
            entries = list(reversed(self._r.xrevrange(key, count=int(count))))
        return [json.loads(fields["r"]) for _, fields in entries]

    @_wrap_errors
    def trace_len(self) -> int:
        return int(self._r.xlen(self._k("traces")))

    def ping(self) -> bool:
        try:
            return bool(self._r.ping())
        except (redis.exceptions.RedisError, OSError):
            return False

    def close(self) -> None:
        for stop, _ in self._subs:
            stop.set()
        for _, thread in self._subs:
            thread.join(timeout=2.0)
        self._r.close()
