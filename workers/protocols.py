"""The decoder worker's two contracts as `typing.Protocol`s (`workers/ray_worker.py`).

- `DecoderEngine`: what `EngineLoop` and `DecoderWorker` use of an engine
  (`workers.engine.Engine` is the one implementation).
- `WorkerPlugin`: what a caller hands a `DecoderWorker` through ``plugin_factory(worker_id)``
  (serving's shared state, policies and SLA verdicts: `adapt.serving.worker_plugin.ServingPlugin`),
  with two optional hooks (`PluginHooks`). `check_plugin` checks an object against it when the
  worker starts and names what is missing, instead of an ``AttributeError`` on some request later.

Both are structural: nothing has to inherit from them. This module imports nothing (the worker
imports nothing of `adapt`, and `adapt` may import this).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

__all__ = ["EngineOutput", "DecoderEngine", "WorkerPlugin", "PluginHooks", "check_plugin", "plugin_hook"]


class EngineOutput(Protocol):
    """One request's tokens of one engine step (`workers.request.RequestOutput`); an ``error``
    attribute (str or None) is read when present."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    stats: dict


class DecoderEngine(Protocol):
    """What the worker needs of an engine. Only the worker's loop thread calls it (contracts §4).
    (Not runtime-checkable: an ``isinstance`` check would read `tokenizer`, which loads one.)"""

    decisions: Any  # the DecisionMaker (workers.decisions), swapped between steps on hot reload
    block: int      # the drafter's block size K (0: autoregressive only)
    max_len: int    # prompt + generated tokens per request
    backend: Any    # the step backend (workers.backends.StepBackend): name, capabilities, packages loaded
    config: Any     # the EngineConfig; ``config.max_batch``: requests decoded at once

    @property
    def tokenizer(self) -> Any: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: Any = None, knobs: Any = None,
                    targets: object = None) -> None:
        """Queue a request; a ``ValueError`` names a bad field (then nothing was queued)."""

    def abort(self, request_id: str) -> Any:
        """Stop a request now and free its slot."""

    def has_unfinished(self) -> bool: ...

    def step(self) -> Sequence[EngineOutput]:
        """Decode one step for every running request; the outputs of requests that got tokens."""

    def warm_up(self) -> dict:
        """Compile the decode steps before serving (a no-op for an eager engine)."""


@runtime_checkable
class WorkerPlugin(Protocol):
    """What serving adds to a decoder worker (the worker calls these in this order)."""

    def trace_sink(self) -> Any:
        """Where the engine writes its per-row trace records (``write(records)``), or None."""

    def decisions(self, engine: DecoderEngine) -> Any:
        """The decision maker to start with (None: keep the engine's own)."""

    def start(self, loop: Any) -> None:
        """The engine loop runs (`workers.ray_worker.EngineLoop`): start heartbeats, subscribe to
        policies (``loop.set_decisions`` / ``loop.between_steps`` swap them between steps)."""

    def prepare(self, request: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """A request -> (its `DecodeKnobs` keyword arguments, the targets its decision maker reads)."""

    def finish(self, request: dict[str, Any], targets: Any, timing: dict[str, Any], stats: dict[str, Any],
               finish_reason: str | None) -> dict[str, Any]:
        """What the final chunk of a finished request adds (e.g. its SLA verdict)."""

    def close(self) -> None:
        """The worker shuts down."""


class PluginHooks(Protocol):
    """Optional hooks of a `WorkerPlugin`: the worker calls each one the plugin has."""

    def on_step(self, step_ms: float, rows: int) -> None:
        """An engine step took ``step_ms`` and produced outputs for ``rows`` requests (loop thread)."""

    def aborted(self, request: dict[str, Any]) -> None:
        """The caller went away (or the router cancelled) before the request finished."""


def _members(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if not name.startswith("_") and callable(value)]


_REQUIRED = _members(WorkerPlugin)
_OPTIONAL = _members(PluginHooks)


def check_plugin(plugin: Any) -> WorkerPlugin:
    """``plugin`` if it has every method of `WorkerPlugin` (and its optional hooks, when present,
    are callable); else a ``TypeError`` naming what is missing."""
    missing = [name for name in _REQUIRED if not callable(getattr(plugin, name, None))]
    broken = [name for name in _OPTIONAL if getattr(plugin, name, None) is not None
              and not callable(getattr(plugin, name))]
    if missing or broken:
        what = [f"missing {', '.join(missing)}"] if missing else []
        what += [f"not callable: {', '.join(broken)}"] if broken else []
        raise TypeError(f"worker plugin {type(plugin).__name__}: {'; '.join(what)} "
                        f"(the contract is workers.protocols.WorkerPlugin: {', '.join(_REQUIRED)}; "
                        f"optional {', '.join(_OPTIONAL)})")
    return plugin


def plugin_hook(plugin: Any, name: str) -> Any:
    """The optional hook ``name`` of ``plugin`` (a `PluginHooks` method), or None when it has none."""
    if name not in _OPTIONAL:
        raise ValueError(f"{name}: not an optional plugin hook (those are {', '.join(_OPTIONAL)})")
    return getattr(plugin, name, None) if plugin is not None else None
