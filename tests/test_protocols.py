"""The decoder worker's contracts (`workers.protocols`): the engine has what the worker uses, the
serving plugin has what the worker calls, and a plugin that lacks a method is refused by name
when the worker starts, before any model loads."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from workers.protocols import DecoderEngine, PluginHooks, WorkerPlugin, check_plugin, plugin_hook


def _members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def test_the_engine_has_what_the_worker_uses(tmp_path):
    from tests.tiny_models import make_tiny_pair
    from workers.engine import Engine, EngineConfig

    target, drafter = make_tiny_pair(tmp_path)
    engine = Engine(EngineConfig(target=str(target), drafter=str(drafter), max_batch=2, max_len=128))
    for name in sorted(_members(DecoderEngine)):
        assert inspect.getattr_static(engine, name, None) is not None, name  # static: no tokenizer load
    assert engine.block == 16 and engine.config.max_batch == 2 and engine.backend.name == "eager"


def test_the_serving_plugin_satisfies_the_contract():
    from adapt.serving.worker_plugin import ServingPlugin

    plugin = ServingPlugin("w0", store=None, heartbeat_s=60)
    try:
        assert check_plugin(plugin) is plugin and isinstance(plugin, WorkerPlugin)
        assert all(callable(plugin_hook(plugin, name)) for name in _members(PluginHooks))
    finally:
        plugin.close()


class _NoHooks:
    def trace_sink(self):
        return None

    def decisions(self, engine):
        return None

    def start(self, loop):
        pass

    def prepare(self, request):
        return {}, None

    def finish(self, request, targets, timing, stats, finish_reason):
        return {}

    def close(self):
        pass


def test_check_plugin_names_what_is_missing():
    assert check_plugin(_NoHooks()) is not None and plugin_hook(_NoHooks(), "aborted") is None  # hooks optional
    assert plugin_hook(None, "on_step") is None

    class NoPrepare(_NoHooks):
        prepare = None

    with pytest.raises(TypeError, match=r"worker plugin NoPrepare: missing prepare \(the contract is "
                                        r"workers\.protocols\.WorkerPlugin"):
        check_plugin(NoPrepare())

    class BadHook(_NoHooks):
        on_step = 3

    with pytest.raises(TypeError, match="not callable: on_step"):
        check_plugin(BadHook())
    with pytest.raises(TypeError, match=r"missing trace_sink, decisions, start, prepare, finish, close"):
        check_plugin(object())
    with pytest.raises(ValueError, match="not an optional plugin hook"):
        plugin_hook(_NoHooks(), "prepare")


def test_the_worker_refuses_a_bad_plugin_before_loading_models():
    from workers.ray_worker import DecoderWorker

    with pytest.raises(TypeError, match="worker plugin object: missing trace_sink"):
        DecoderWorker("w", {"target": "/nonexistent/model"}, lambda worker_id: object())


def test_a_plugin_without_optional_hooks_still_serves(tmp_path):
    """on_step and aborted are optional: a worker runs with a plugin that has neither."""
    from tests.tiny_models import make_tiny_pair
    from workers.ray_worker import DecoderWorker

    target, _ = make_tiny_pair(tmp_path)
    worker = DecoderWorker("w", {"target": str(target), "drafter": None, "max_batch": 2, "max_len": 128},
                           lambda worker_id: _NoHooks(), num_threads=1)

    async def run():
        gen = worker.generate({"request_id": "r", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 4}})
        first = await gen.__anext__()
        await gen.aclose()  # the client leaves before the request finished: no aborted hook to call
        return first

    try:
        assert "error" not in asyncio.run(run())
    finally:
        worker.shutdown()
