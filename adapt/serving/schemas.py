"""OpenAI-compatible request bodies (pydantic) and their translation into worker requests.

Supported: ``/v1/completions`` (``prompt`` as text or token ids) and ``/v1/chat/completions``
(``messages``), ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (extension),
``seed``, ``stop``, ``stream`` (+ ``stream_options.include_usage``), ``n = 1``. Extensions:
``sla`` (see `adapt.serving.headers`) and ``decode`` (the knobs the request pins over the
server's policy: ``steps``, ``draft_len``, ``source``, ``commit_order``; workers/pins.py).
Unknown fields are rejected with an error naming them.

OpenAI fields this server does not implement (`UNSUPPORTED`: tools, logit_bias, best_of,
response_format, ...) are accepted only at the value that changes nothing (``null``, ``{}``,
``1``, ...); any other value is answered 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapt.serving.headers import ApiError

__all__ = ["CompletionRequest", "ChatRequest", "ChatMessage", "DecodeBody", "UNSUPPORTED"]

# OpenAI request fields that are not implemented -> the values that leave the output unchanged
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
}


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    # type-exact: 1.0 or True must not pass for best_of = 1, nor 0 for False
    return any(type(value) is type(a) and value == a for a in allowed)


class DecodeBody(BaseModel):
    """Decode knobs a request pins: every decode step of the request keeps each one given,
    whatever the server's policy; the policy decides the rest each step (workers/pins.py).
    Values above the drafter's block are clamped to it (reported in ``decode_stats.pin_clamps``)."""

    model_config = ConfigDict(extra="forbid")

    steps: int | None = Field(None, ge=0, le=64, description="Diffusion steps per drafted block (0 = no drafts).")
    draft_len: int | None = Field(None, ge=0, le=64, description="Drafted tokens verified per step (0 = no drafts).")
    commit_order: Literal["confidence", "left-to-right"] | None = Field(
        None, description="Order in which the drafter commits masked positions.")
    source: Literal["diffusion", "suffix", "none"] | None = Field(
        None, description="Where drafts come from: the diffusion drafter, the suffix drafter (text copied "
                          "from the prompt and output), or none (no drafts).")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Model name (see GET /v1/models); optional.")
    max_tokens: int | None = Field(None, ge=1, le=8192, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=4.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off); an extension.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Seed of the request's generator.")
    stop: str | list[str] | None = Field(None, description="Stop strings (up to 4).")
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only n = 1 is supported.")
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported (must be 0).")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported (must be 0).")
    sla: dict[str, Any] | None = Field(None, description="SLA targets (same as the X-SLA-* headers).")
    decode: DecodeBody | None = Field(None, description="Pinned static decode knobs.")

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        """Drop unimplemented OpenAI fields at their neutral value; reject any other value by name
        (an `ApiError`, which pydantic lets through, so that ``param`` names the field)."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, allowed in UNSUPPORTED.items():
            if name in out:
                if not _neutral(out[name], allowed):
                    shown = ", ".join("null" if a is None else repr(a) for a in allowed)
                    raise ApiError(f"{name}: not supported by this server (allowed: {shown})", param=name,
                                   code="unsupported_parameter")
                del out[name]
        return out

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if isinstance(value, list) and (len(value) > 4 or not all(isinstance(s, str) and s for s in value)):
            raise ValueError("at most 4 non-empty stop strings")
        if isinstance(value, str) and not value:
            raise ValueError("stop string must not be empty")
        return value

    def stop_list(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens or default_max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}


class CompletionRequest(_Common):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] = Field(..., description="Prompt text or token ids.")
    echo: bool = Field(False, description="Not supported (must be false).")
    logprobs: int | None = Field(None, le=0, description="Not supported.")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if all(isinstance(v, str) for v in value):
                if len(value) != 1:
                    raise ValueError("only one prompt per request is supported")
                return value[0]
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
                raise ValueError("token ids must be non-negative integers")
        elif not value:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _echo(cls, value):
        if value:
            raise ValueError("echo is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    logprobs: bool = Field(False, description="Not supported (must be false).")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        if value:
            raise ValueError("logprobs is not supported")
        return value

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        out = super().sampling(default_max_tokens)
        if self.max_completion_tokens is not None and self.max_tokens is None:
            out["max_tokens"] = self.max_completion_tokens
        return out
