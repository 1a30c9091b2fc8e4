"""Least-loaded routing of requests to decoder worker actors.

The router keeps a handle on every worker actor and, per request, picks the live worker with
the smallest load. A worker's load is the larger of what its last heartbeat in the state store
says (requests held: running + waiting, which includes requests sent by other routers) and the
requests this router has in flight on it (fresh between heartbeats). A worker whose stream
failed (its actor died) is skipped until it answers a ping again; while the store is down the
router keeps routing on its own counts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, AsyncIterator

from adapt.serving.headers import ApiError
from adapt.serving.store import StateStore

__all__ = ["ActorRouter", "score"]

log = logging.getLogger(__name__)


def score(store_load: dict[str, Any] | None, inflight: int) -> float:
    """Load of a worker: requests held per its heartbeat, or in flight from here if larger."""
    held = 0 if store_load is None else int(store_load.get("requests", 0))
    return float(max(held, inflight))


class ActorRouter:
    """Routes requests to Ray actors running `workers.ray_worker.DecoderWorker` (the `Backend` of
    `adapt.serving.http_app`)."""

    def __init__(self, workers: dict[str, Any], store: StateStore, refresh_s: float = 0.1,
                 revive_s: float = 2.0):
        self.workers = dict(workers)
        self.store = store
        self.refresh_s = refresh_s
        self.revive_s = revive_s
        self.inflight = {w: 0 for w in self.workers}
        self.routed = {w: 0 for w in self.workers}
        self._dead: dict[str, float] = {}
        self._loads: dict[str, dict[str, Any]] = {}
        self._loads_time = 0.0
        self.store_ok = True
        self._tie = itertools.count()

    async def loads(self) -> dict[str, dict[str, Any]]:
        """Live workers' load records from the store (cached for `refresh_s`; last view if down)."""
        now = time.monotonic()
        if now - self._loads_time >= self.refresh_s:
            self._loads_time = now
            try:
                self._loads = await asyncio.get_running_loop().run_in_executor(None, self.store.loads)
                self.store_ok = True
            except Exception as exc:  # noqa: BLE001 - store down: route on local counts
                if self.store_ok:
                    log.warning("state store unreachable, routing on local counts: %s", exc)
                self.store_ok = False
        return dict(self._loads)

    async def _revive(self) -> None:
        import ray

        now = time.monotonic()
        for wid, since in list(self._dead.items()):
            if now - since < self.revive_s:
                continue
            self._dead[wid] = now
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.workers[wid].load.remote().future()), 1.0)
                del self._dead[wid]
                log.info("worker %s answers again", wid)
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                pass

    async def pick(self) -> str:
        """The least-loaded live worker (ties broken round-robin)."""
        if self._dead:
            await self._revive()
        loads = await self.loads()
        live = [w for w in self.workers if w not in self._dead]
        if not live:
            raise ApiError("no decoder worker is available", status=503, type_="server_error", code="no_workers")
        if self.store_ok and loads:
            # a worker the store has no heartbeat of (while others have) is starting or gone
            beating = [w for w in live if w in loads]
            live = beating or live
        tie = next(self._tie)
        return min(live, key=lambda w: (score(loads.get(w), self.inflight[w]), (hash(w) + tie) % len(self.workers)))

    async def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Chunks of `request` from the least-loaded worker (see `adapt.serving.http_app.Backend`)."""
        import ray

        wid = await self.pick()
        handle = self.workers[wid]
        self.inflight[wid] += 1
        self.routed[wid] += 1
        gen = handle.generate.options(num_returns="streaming").remote(request)
        got_any, done = False, False
        try:
            async for ref in gen:
                try:
                    chunk = await ref
                except ray.exceptions.RayActorError as exc:
                    raise self._died(wid, exc, got_any) from None
                got_any = True
                done = bool(chunk.get("finished") or chunk.get("error"))
                yield chunk
            if not done:
                raise ApiError(f"worker {wid} ended the stream early", status=502, type_="server_error",
                               code="worker_failed")
        except ray.exceptions.RayActorError as exc:
            raise self._died(wid, exc, got_any) from None
        finally:
            self.inflight[wid] -= 1
            if not done:
                try:
                    ray.cancel(gen)
                except Exception:  # noqa: BLE001 - already finished or the actor is gone
                    pass

    def _died(self, wid: str, exc: Exception, got_any: bool) -> ApiError:
        self._dead[wid] = time.monotonic()
        log.warning("worker %s failed: %s", wid, exc)
        return ApiError(f"decoder worker {wid} died{' mid-stream' if got_any else ''}: {type(exc).__name__}",
                        status=503, type_="server_error", code="worker_died")
