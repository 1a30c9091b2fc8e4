"""`StoreTraceSink`: the engine's `TraceSink` (``write(records)``) for serving.

The engine calls ``write(records)`` inside its step; this sink only appends to a bounded buffer
(no I/O in the step). A background thread drains the buffer every `flush_s`: it folds the
records into the worker's `WorkerCounters` and appends them to the store's capped trace stream
(Redis Streams with a `RedisStore`). While the store is unreachable the records are dropped and
counted (``trace_records_dropped``): serving never waits for the trace stream.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

from adapt.serving.metrics import WorkerCounters
from adapt.serving.store import StateStore

__all__ = ["StoreTraceSink"]

log = logging.getLogger(__name__)


class StoreTraceSink:
    """Buffered trace sink feeding the store's trace stream and the worker's counters."""

    def __init__(self, store: StateStore | None, counters: WorkerCounters | None = None,
                 max_buffer: int = 50_000, flush_s: float = 0.2, batch: int = 2_000):
        self.store = store
        self.counters = counters if counters is not None else WorkerCounters()
        self._buffer: deque[dict[str, Any]] = deque()
        self._max_buffer = max_buffer
        self._batch = batch
        self._flush_s = flush_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store_ok = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="adapt-trace-sink")
        self._thread.start()

    def write(self, records: list[dict[str, Any]]) -> None:
        """Queue records (called by the engine in its step; never blocks on I/O)."""
        with self._lock:
            self._buffer.extend(records)
            overflow = len(self._buffer) - self._max_buffer
            for _ in range(max(0, overflow)):
                self._buffer.popleft()
        if overflow > 0:
            self.counters.dropped(overflow)

    def flush(self) -> None:
        """Deliver everything buffered now (also called by the background thread)."""
        while True:
            with self._lock:
                n = min(len(self._buffer), self._batch)
                batch = [self._buffer.popleft() for _ in range(n)]
            if not batch:
                return
            self.counters.observe_traces(batch)
            if self.store is None:
                continue
            try:
                self.store.add_traces(batch)
                if not self._store_ok:
                    log.info("trace stream reachable again")
                self._store_ok = True
            except Exception as exc:  # noqa: BLE001 - store down: drop, count, keep serving
                if self._store_ok:
                    log.warning("trace stream unreachable, dropping records: %s", exc)
                self._store_ok = False
                self.counters.dropped(len(batch))

    def _run(self) -> None:
        while not self._stop.wait(self._flush_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.flush()
