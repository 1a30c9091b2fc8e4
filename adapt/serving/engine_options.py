"""Engine options checked where they cross into serving: `adapt serve` / `start_stack` and the
Ray Serve application's ``engine_options`` (``deploy/serve_config.yaml``).

A decoder worker builds ``workers.engine.EngineConfig(**config)`` in its own process (a Serve
Decoder replica), so a misspelt or ill-typed option used to surface there, late and as a bare
``TypeError`` from a dataclass. `validate_engine_options` checks them on the caller's side
against a pydantic model that mirrors `EngineConfig`'s fields (built from the dataclass itself,
so it cannot drift from it): an unknown option or a value of the wrong type is a ``ValueError``
naming the field (``engine_options.max_bach: unknown engine option (known: ...)``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

__all__ = ["engine_options_model", "validate_engine_options"]


@functools.lru_cache(maxsize=1)
def engine_options_model() -> type[BaseModel]:
    """The pydantic model of `workers.engine.EngineConfig`: the same field names and types, no
    other field (``extra="forbid"``), strict types (no ``"64"`` for 64, no 1 for ``True``)."""
    from workers.engine import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=f.default_factory)
        else:
            default = ...
        fields[f.name] = (hints[f.name], default)
    return create_model("EngineOptions", __config__=ConfigDict(extra="forbid", strict=True), **fields)


def validate_engine_options(options: Any, where: str = "engine_options") -> dict[str, Any]:
    """``options`` (keyword arguments of `EngineConfig`, e.g. target, drafter, max_batch) checked:
    the options given, with validated values; `where` prefixes the field in errors."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"{where}: expected a mapping of engine options, got {type(options).__name__}")
    model = engine_options_model()
    try:
        return model.model_validate(options).model_dump(exclude_unset=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"][:1])
        if err["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields)
            raise ValueError(f"{where}.{loc}: unknown engine option (known: {known})") from None
        raise ValueError(f"{where}.{loc}: {err['msg']} (got {err['input']!r})") from None
