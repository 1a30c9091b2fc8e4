"""A decoder worker: the engine's continuous-batching loop on its own thread, streamed per request.

`EngineLoop` owns an `Engine` (contracts §4) and is the only thread that touches it: callers
enqueue commands (add, abort, swap the decision maker), the loop drains them *between* steps,
runs ``engine.step()`` while anything is unfinished, and hands each request's outputs to that
request's asyncio queue. A new decision maker (a hot-reloaded policy) is swapped in between two
steps, so running requests carry on under the new policy without being dropped.

`DecoderWorker` is the Ray actor around it (``ray.remote(DecoderWorker)``, or the Serve
deployment in `adapt.serving.deployment`): it tokenizes, streams chunks to the router and
detokenizes incrementally (`workers.detokenize`: each chunk decodes only its new tokens). What
serving adds (shared state, policies, SLA verdicts) arrives as a *plugin* built by a factory the
caller passes in, so this module imports nothing of `adapt`.

The engine and plugin contracts are `typing.Protocol`s in `workers.protocols`: `DecoderEngine`
(what this module uses of `workers.engine.Engine`) and `WorkerPlugin` (``trace_sink``,
``decisions``, ``start``, ``prepare``, ``finish``, ``close``; optional hooks ``on_step`` and
``aborted``; `adapt.serving.worker_plugin.ServingPlugin` implements it). A plugin is checked
against it when the worker starts (`workers.protocols.check_plugin` names what is missing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from workers.detokenize import StreamDetokenizer, find_stop
from workers.protocols import DecoderEngine, WorkerPlugin, check_plugin, plugin_hook

log = logging.getLogger(__name__)

__all__ = ["EngineLoop", "DecoderWorker"]


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue living on the actor's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)


class EngineLoop:
    """Runs ``engine.step()`` on a dedicated thread; see the module docstring."""

    def __init__(self, engine: DecoderEngine, on_step: Callable[[float, int], None] | None = None):
        self.engine = engine
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._waiting = 0  # added but not yet stepped
        self.policy_version = 0
        self.steps = 0
        self.healthy = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="adapt-engine-loop")
        self._thread.start()

    # -- called from any thread ---------------------------------------------------------------
    def add(self, request_id: str, args: tuple, stream: _Stream) -> None:
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, args))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def set_decisions(self, decisions: Any, version: int) -> None:
        """Swap the decision maker between two steps (hot reload)."""
        self._commands.put(("decisions", version, decisions))

    def between_steps(self, fn: Callable[[DecoderEngine], Any], version: int) -> None:
        """Run ``fn(engine)`` on the loop thread between two steps (e.g. update the policy in place);
        the loop then reports policy `version`, unless `fn` raised (logged, version unchanged)."""
        self._commands.put(("call", version, fn))

    def load(self) -> dict[str, Any]:
        """Requests held (running + waiting) and the loop's state, for heartbeats and routing."""
        n = len(self._streams)
        return {"running": n - self._waiting, "waiting": self._waiting, "requests": n,
                "steps": self.steps, "policy_version": self.policy_version, "healthy": self.healthy}

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("stop", None, None))
        self._thread.join(timeout=5.0)

    # -- the loop thread ---------------------------------------------------------------------
    def _emit(self, request_id: str, item: dict[str, Any], final: bool = False) -> None:
        stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _apply(self, kind: str, key: Any, payload: Any) -> None:
        if kind == "add":
            try:
                self.engine.add_request(key, *payload)
                self._waiting += 1
            except ValueError as exc:  # the engine's input errors name the field
                self._emit(key, {"error": {"message": str(exc), "status": 400, "param": _field_of(exc)}}, final=True)
            except Exception as exc:  # noqa: BLE001
                log.exception("add_request %s failed", key)
                self._emit(key, {"error": {"message": f"engine error: {exc}", "status": 500}}, final=True)
        elif kind == "abort":
            if key in self._streams:
                try:
                    self.engine.abort(key)
                except Exception:  # noqa: BLE001 - already finished
                    pass
                self._streams.pop(key, None)
        elif kind == "decisions":
            self.engine.decisions = payload
            self.policy_version = int(key)
        elif kind == "call":
            try:
                payload(self.engine)
                self.policy_version = int(key)
            except Exception:  # noqa: BLE001 - a failed reload keeps the running policy
                log.exception("between-steps call for version %s failed", key)

    def _run(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_unfinished()
            try:
                cmd = self._commands.get(timeout=0.05) if idle else self._commands.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    return
                self._apply(*cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if not self.engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep the worker alive
                log.exception("engine step failed")
                for rid in list(self._streams):
                    try:
                        self.engine.abort(rid)
                    except Exception:  # noqa: BLE001
                        pass
                    self._emit(rid, {"error": {"message": f"engine step failed: {exc}", "status": 500}}, final=True)
                continue
            step_ms = (time.perf_counter() - t0) * 1e3
            self.steps += 1
            self._waiting = 0
            if self._on_step is not None:
                self._on_step(step_ms, len(outputs))
            now = time.monotonic()
            for out in outputs:
                self._emit(out.request_id, {"token_ids": list(out.new_token_ids), "finished": bool(out.finished),
                                            "finish_reason": out.finish_reason, "stats": dict(out.stats or {}),
                                            "error": getattr(out, "error", None), "time": now},
                           final=bool(out.finished))


def _field_of(exc: Exception) -> str | None:
    """The field an engine error names (its message starts with it), for the HTTP ``param``."""
    head = str(exc).split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").isalnum() else None


class DecoderWorker:
    """A decoder worker (use as a Ray actor): owns an engine loop; see the module docstring.

    engine_config: keyword arguments of `EngineConfig` (target, drafter, dtype, device, ...).
    plugin_factory: ``factory(worker_id) -> plugin`` (serving's shared state, policies, SLAs), a
    `workers.protocols.WorkerPlugin`; a TypeError names what a plugin lacks, before any model loads.
    num_threads: torch intra-op threads for this worker (cores / workers on a shared machine).
    """

    def __init__(self, worker_id: str | None, engine_config: dict[str, Any],
                 plugin_factory: Callable[[str], WorkerPlugin] | None = None, num_threads: int | None = None):
        from workers.native_caches import bound_native_caches

        bound_native_caches()  # before the first matmul: the libraries read their cache sizes once
        import torch

        from workers.engine import Engine, EngineConfig

        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.worker_id = worker_id or _default_worker_id()
        self.plugin: WorkerPlugin | None = None
        if plugin_factory is not None:
            self.plugin = check_plugin(plugin_factory(self.worker_id))
        self._aborted = plugin_hook(self.plugin, "aborted")
        sink = self.plugin.trace_sink() if self.plugin is not None else None
        self.engine: DecoderEngine = Engine(EngineConfig(**engine_config), decisions=None, trace_sink=sink)
        # compile the decode steps before the cost model is profiled and before any request (no-op if eager)
        self.warm_up = self.engine.warm_up()
        if self.plugin is not None:
            decisions = self.plugin.decisions(self.engine)
            if decisions is not None:
                self.engine.decisions = decisions
        self.tokenizer = self.engine.tokenizer
        from workers.chat import stop_ids

        self._chat_stops = stop_ids(self.tokenizer, chat=True)  # EOS and the template's end-of-turn token
        self.loop = EngineLoop(self.engine, on_step=plugin_hook(self.plugin, "on_step"))
        if self.plugin is not None:
            self.plugin.start(self.loop)

    # -- actor methods ------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "pid": os.getpid(), "node": _node_id(),
                "backend": self.engine.backend.facts(), "warm_up": self.warm_up,
                "max_batch": self.engine.config.max_batch, "max_len": self.engine.max_len}

    def load(self) -> dict[str, Any]:
        return self.loop.load()

    def shutdown(self) -> None:
        if self.plugin is not None:
            self.plugin.close()
        self.loop.close()

    def _prompt_ids(self, request: dict[str, Any]) -> list[int]:
        if request.get("prompt_token_ids") is not None:
            return [int(t) for t in request["prompt_token_ids"]]
        if request.get("messages") is not None:
            return _chat_ids(self.tokenizer, request["messages"])
        return list(self.tokenizer.encode(request["prompt"], add_special_tokens=False))

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request: chunks ``{"text", "token_ids", "finished", ...}`` or one ``{"error"}``."""
        from workers.request import DecodeKnobs, SamplingParams

        rid = request["request_id"]
        arrival = time.monotonic()
        try:
            prompt_ids = self._prompt_ids(request)
            knobs, targets = self.plugin.prepare(request) if self.plugin is not None else ({}, None)
            decode = dict(request.get("decode") or {})  # the knobs the request pins (workers/pins.py)
            knobs = {**knobs, **decode, "pinned": frozenset(decode)}
            knobs.setdefault("draft_len", self.engine.block)
            sampling = SamplingParams(**request.get("sampling", {}))
            if request.get("messages") is not None and not sampling.ignore_eos:  # stop at the end of the turn
                sampling = dataclasses.replace(sampling, stop_token_ids=(*sampling.stop_token_ids, *self._chat_stops))
            args = (prompt_ids, sampling, DecodeKnobs(**knobs), targets)
        except ValueError as exc:
            yield {"error": {"message": str(exc), "status": 400, "param": _field_of(exc)}}
            return
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), arrival)
        self.loop.add(rid, args, stream)
        detok = StreamDetokenizer(self.tokenizer)
        stops = list(request.get("stop") or [])
        first_time, n_tokens, finished, held = None, 0, False, None
        try:
            while not finished:
                item = held if held is not None else await stream.queue.get()
                held, item_time = None, item.get("time")
                # what the engine produced meanwhile goes out in the same chunk: a consumer that
                # fell behind catches up in one message instead of one per engine step
                while not item.get("finished") and not item.get("error") and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    if nxt.get("error"):
                        held = nxt
                        break
                    item = {**nxt, "token_ids": item["token_ids"] + nxt["token_ids"]}
                if item.get("error") and not item.get("token_ids"):
                    err = item["error"]
                    finished = True  # the engine already dropped the request: nothing to abort
                    yield {"error": err if isinstance(err, dict) else {"message": str(err), "status": 500}}
                    return
                ids = item["token_ids"]
                if ids and first_time is None:
                    first_time = item_time
                n_tokens += len(ids)
                finished = item["finished"]
                reason = item.get("finish_reason")
                delta = detok.add(ids, finished)
                if stops:
                    cut = find_stop(detok.text, stops, start=len(detok.text) - len(delta))
                    if cut is not None:
                        delta = delta[: max(0, len(delta) - (len(detok.text) - cut))]
                        if not finished:
                            self.loop.abort(rid)
                        finished, reason = True, "stop"
                chunk: dict[str, Any] = {"text": delta, "token_ids": ids, "finished": finished,
                                         "worker": self.worker_id}
                if finished:
                    timing = {"arrival": arrival, "first": first_time, "last": item["time"], "tokens": n_tokens}
                    chunk.update(finish_reason=reason, stats=item.get("stats") or {},
                                 usage={"prompt_tokens": len(prompt_ids), "completion_tokens": n_tokens,
                                        "total_tokens": len(prompt_ids) + n_tokens})
                    if self.plugin is not None:
                        chunk.update(self.plugin.finish(request, targets, timing, chunk["stats"], reason))
                yield chunk
        finally:
            if not finished:  # the client went away or the router cancelled: free the engine slot
                self.loop.abort(rid)
                if self._aborted is not None:
                    self._aborted(request)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Apply the tokenizer's chat template, or a plain ``role: content`` transcript when it has none."""
    from workers.chat import chat_prompt_ids

    return chat_prompt_ids(tokenizer, messages)


def _default_worker_id() -> str:
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not under Ray
        return None
