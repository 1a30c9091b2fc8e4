"""Engine options crossing into serving (`adapt serve` / `start_stack`, the Ray Serve app's
``engine_options``) are checked against `EngineConfig`'s fields before any worker starts: an
unknown or ill-typed option is a ValueError naming it."""

from __future__ import annotations

import dataclasses

import pytest

from adapt.serving.engine_options import engine_options_model, validate_engine_options


def test_the_model_mirrors_engine_config():
    from workers.engine import EngineConfig

    assert list(engine_options_model().model_fields) == [f.name for f in dataclasses.fields(EngineConfig) if f.init]


@pytest.mark.parametrize("options,match", [
    ({"max_bach": 8}, r"engine_options\.max_bach: unknown engine option \(known: target, drafter, .*max_batch"),
    ({"max_batch": "8"}, r"engine_options\.max_batch: .*integer.*'8'"),
    ({"max_len": 256.0}, r"engine_options\.max_len: .*integer"),
    ({"shape_aware_linear": "yes"}, r"engine_options\.shape_aware_linear: .*boolean"),
    ({"dtype": 16}, r"engine_options\.dtype: .*string"),
    ([("max_batch", 8)], r"engine_options: expected a mapping"),
])
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        validate_engine_options(options)


def test_good_options_pass_through():
    given = {"target": "/m/t", "drafter": None, "max_batch": 64, "max_len": 2048, "dtype": "bfloat16",
             "device": "cuda", "compile": "auto"}
    assert validate_engine_options(given) == given
    assert validate_engine_options({"compile": False}) == {"compile": False}
    assert validate_engine_options(None) == {}


def test_start_stack_refuses_before_starting_anything():
    import ray

    from adapt.serving.launcher import start_stack

    was_up = ray.is_initialized()
    with pytest.raises(ValueError, match=r"engine_options\.max_batchs: unknown engine option"):
        start_stack("/nonexistent/target", None, engine_options={"max_batchs": 4})
    assert ray.is_initialized() == was_up  # refused before Ray was started


def test_serve_app_refuses_bad_engine_options():
    from adapt.serving.deployment import Decoder, app_builder

    args = {"target": "/m/t", "drafter": None, "redis_url": "redis://127.0.0.1:1/0"}
    with pytest.raises(ValueError, match=r"engine_options\.max_len: .*integer.*'2k'"):
        app_builder({**args, "engine_options": {"max_len": "2k"}})
    # the replica checks too (a Decoder built outside app_builder), before loading any model
    with pytest.raises(ValueError, match=r"engine_options\.devcie: unknown engine option"):
        Decoder.func_or_class("/m/t", None, "redis://127.0.0.1:1/0", engine_options={"devcie": "cpu"})
