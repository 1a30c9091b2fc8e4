"""Per-request service targets: what each request asks of the decoder.

A request carries two kinds of target, and the controller (`adapt.controller`, `policies/`) chooses
every step's diffusion steps, draft length and acceptance rule so that each request meets them:

- **latency target**: a ceiling on *TPOT* (time per output token, ms) seen by that request, given
  either directly (`tpot_ms`) or as a floor on per-user throughput (`tokens_per_s`, i.e.
  ``tpot_ms = 1000 / tokens_per_s``); optionally a ceiling on *TTFT* (time to first token).
- **quality target**: ``lossless`` (the output distribution is exactly the target model's: only
  exact acceptance rules are ever used) or ``tvd=E`` (a lenient rule may be used, spending at most
  ``E`` total-variation distance per emitted token; see `kernels.Rule.EPS_TVD`), optionally with a
  total TVD budget for the whole request (sequence TV is bounded by the sum of per-token TVs).

`RequestTargets` is the external, validated form (pydantic; the serving layer builds it from SLA
headers, e.g. ``x-adapt-tpot-ms: 40``, ``x-adapt-quality: tvd=0.05``). `ServerDefaults` fills in
what a request leaves unset. Invalid values raise `pydantic.ValidationError` (a `ValueError`)
whose message names the field.

This module imports only pydantic, so `import adapt.targets` stays light.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kernels.rules import LENIENT_RULE, spec_of

__all__ = ["QualityTarget", "RequestTargets", "ServerDefaults", "parse_quality"]

MAX_TVD_PER_TOKEN = spec_of(LENIENT_RULE).params[0].hi  # the lenient rule's eps range (kernels/rules.py): 1


class QualityTarget(BaseModel):
    """A request's quality target.

    ``mode == "lossless"``: the output distribution must equal the target model's (``eps == 0``).
    ``mode == "tvd"``: each emitted token may depart from the target's distribution by at most
    ``eps`` in total-variation distance (TVD, ``½‖p' − p‖₁``), the leniency the ε-TVD rule spends.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["lossless", "tvd"] = Field(
        "lossless", description="'lossless' (exact target distribution) or 'tvd' (per-token TVD budget eps)."
    )
    eps: float = Field(
        0.0, ge=0.0, le=MAX_TVD_PER_TOKEN,
        description="Per-token TVD budget; 0 for lossless, in (0, 1] for mode 'tvd'.",
    )

    @model_validator(mode="after")
    def _check(self) -> "QualityTarget":
        if self.mode == "lossless" and self.eps != 0.0:
            raise ValueError("quality.eps: must be 0 for a lossless quality target")
        if self.mode == "tvd" and not self.eps > 0.0:
            raise ValueError("quality.eps: must be > 0 for a 'tvd=E' quality target (use 'lossless' for 0)")
        return self

    @property
    def lossless(self) -> bool:
        """True when only exact acceptance rules may be used."""
        return self.mode == "lossless"

    def __str__(self) -> str:
        return "lossless" if self.lossless else f"tvd={self.eps:g}"


def parse_quality(value: object) -> QualityTarget:
    """Parse ``"lossless"``, ``"tvd=0.05"`` (or ``"tvd:0.05"``), a mapping, or a `QualityTarget`.

    Raises `ValueError` naming ``quality`` on anything else.
    """
    if isinstance(value, QualityTarget):
        return value
    if isinstance(value, dict):
        return QualityTarget(**value)
    if not isinstance(value, str):
        raise ValueError(f"quality: expected 'lossless' or 'tvd=E', got {value!r}")
    text = value.strip().lower()
    if text in ("lossless", "exact"):
        return QualityTarget()
    for sep in ("=", ":"):
        head, found, tail = text.partition(sep)
        if found and head.strip() == "tvd":
            try:
                eps = float(tail)
            except ValueError:
                raise ValueError(f"quality: cannot parse the TVD budget in {value!r}") from None
            if not math.isfinite(eps) or not 0.0 < eps <= MAX_TVD_PER_TOKEN:
                raise ValueError(f"quality: TVD budget must be in (0, {MAX_TVD_PER_TOKEN:g}], got {value!r}")
            return QualityTarget(mode="tvd", eps=eps)
    raise ValueError(f"quality: expected 'lossless' or 'tvd=E', got {value!r}")


class RequestTargets(BaseModel):
    """One request's latency and quality targets (all optional; `ServerDefaults` fills gaps).

    Use `RequestTargets(tpot_ms=40, quality="tvd=0.05")`; `quality` accepts the strings of
    `parse_quality`. `effective_tpot_ms` is the latency ceiling the controller works with.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tpot_ms: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="Ceiling on the mean time per output token seen by this request, in ms.",
    )
    tokens_per_s: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="Floor on this request's decode throughput in tokens/s (TPOT ceiling = 1000 / tokens_per_s ms).",
    )
    ttft_ms: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="Ceiling on the time to first token, in ms (checked for SLA attainment).",
    )
    quality: QualityTarget = Field(
        default_factory=QualityTarget,
        description="'lossless' or 'tvd=E' (per-token TVD budget E in (0, 1]).",
    )
    tvd_budget_total: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="Optional total TVD budget over the whole request (sum of per-token TVD spent); needs quality 'tvd=E'.",
    )
    priority: int = Field(
        0, ge=-100, le=100,
        description="Scheduling priority, higher first among requests equally behind target (default 0).",
    )

    @field_validator("quality", mode="before")
    @classmethod
    def _parse_quality(cls, value: object) -> QualityTarget:
        return parse_quality(value)

    @model_validator(mode="after")
    def _check(self) -> "RequestTargets":
        if self.tvd_budget_total is not None and self.quality.lossless:
            raise ValueError("tvd_budget_total: a total TVD budget needs quality 'tvd=E', not 'lossless'")
        return self

    @property
    def effective_tpot_ms(self) -> float | None:
        """The TPOT ceiling in ms: the tighter of `tpot_ms` and ``1000 / tokens_per_s`` (None if neither)."""
        ceilings = [c for c in (self.tpot_ms, None if self.tokens_per_s is None else 1000.0 / self.tokens_per_s)
                    if c is not None]
        return min(ceilings) if ceilings else None

    @property
    def lossless(self) -> bool:
        return self.quality.lossless

    def with_defaults(self, defaults: "ServerDefaults") -> "RequestTargets":
        """Fill every unset field from the server defaults (a request's own values win)."""
        update: dict[str, object] = {}
        if self.tpot_ms is None and self.tokens_per_s is None:
            update["tpot_ms"] = defaults.tpot_ms
        if self.ttft_ms is None:
            update["ttft_ms"] = defaults.ttft_ms
        fields_set = self.model_fields_set
        if "quality" not in fields_set:
            update["quality"] = defaults.quality
        if self.tvd_budget_total is None and not QualityTarget.model_validate(
                update.get("quality", self.quality)).lossless:
            update["tvd_budget_total"] = defaults.tvd_budget_total
        if "priority" not in fields_set:
            update["priority"] = defaults.priority
        return RequestTargets.model_validate({**self.model_dump(), **update})

    @classmethod
    def from_headers(cls, headers: dict[str, str], prefix: str = "x-adapt-") -> "RequestTargets":
        """Build targets from HTTP headers ``{prefix}tpot-ms``, ``tokens-per-s``, ``ttft-ms``,
        ``quality``, ``tvd-budget-total``, ``priority`` (case-insensitive; absent ones stay unset)."""
        lower = {k.lower(): v for k, v in headers.items()}
        values: dict[str, object] = {}
        for name in cls.model_fields:
            key = prefix + name.replace("_", "-")
            if key in lower:
                values[name] = lower[key]
        return cls.model_validate(values)


class ServerDefaults(BaseModel):
    """Server-wide defaults for the targets a request leaves unset (`RequestTargets.with_defaults`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tpot_ms: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="Default TPOT ceiling in ms (None: no latency target).",
    )
    ttft_ms: float | None = Field(
        None, gt=0.0, allow_inf_nan=False, description="Default TTFT ceiling in ms (None: none)."
    )
    quality: QualityTarget = Field(
        default_factory=QualityTarget, description="Default quality target ('lossless' unless set)."
    )
    tvd_budget_total: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="Default total TVD budget for 'tvd=E' requests (None: only the per-token budget).",
    )
    priority: int = Field(0, ge=-100, le=100, description="Default priority.")

    @field_validator("quality", mode="before")
    @classmethod
    def _parse_quality(cls, value: object) -> QualityTarget:
        return parse_quality(value)
