"""The adaptive policy's settings: one pydantic model, read by the policy's constructor, by a
policy file's ``settings`` (`adapt.controller.validate_settings`) and by `adapt policy set`.

Every field has a default, a range and a description (docs/policies.md's settings table is
generated from them: `settings_table`). Types are strict (no ``"2"`` for 2, no 1 for true); a
setting out of range or unknown is a `ValueError` that names it (`check_settings`).

`REMOVED` lists the settings that were measured no better than their alternative and deleted,
each with that measured reason: a policy file that still carries one loads with a warning
(`drop_removed`) and the setting is ignored.
"""

from __future__ import annotations

import json
import warnings
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator

from .suffix_table import check_suffix_accept

# settings deleted because they measured no better than their alternative (docs/benchmarks.md,
# "tried and rejected"): name -> the measured reason
REMOVED: dict[str, str] = {
    "copies_save": "more copies, no more goodput (0.967x against 0.982x static suffix drafting at 2 requests)",
    "copies_drop": "more copies, no more goodput (0.937x against 0.970x static suffix drafting at 2 requests)",
    "suffix_per_request": "per-request suffix recalibration: no gain in interleaved runs",
    "overhead_by_source": "overhead per draft source: worse at 2 and 8 requests; the combined estimate "
                          "keeps copies from widening 8-row steps",
}


def _f(default, description: str, **limits):
    return Field(default=default, description=description, **limits)


class AdaptiveSettings(BaseModel):
    """The adaptive policy's settings (docs/policies.md "Settings"); frozen: a policy swaps in a
    new validated model (`AdaptivePolicy.update`), never edits one."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    steps_grid: Annotated[list[Annotated[int, Field(ge=1)]], Strict(False)] = _f(
        [1, 2], "denoising step counts a row's plan may choose (SmolLM2's file: [1]; its drafter wins "
        "nothing from a second step)", min_length=1)
    allow_no_draft: bool = _f(True, "a row may take a plain step where its draft would not pay for the drafter pass")
    no_draft_margin: float = _f(0.05, "how much better (share) going without a draft must be predicted before a row does; "
                                "below 0 a margin against drafting: a diffusion draft must be predicted 1 / (1 + m) "
                                "times a plain step's tokens per ms (-0.5: twice)", ge=-0.9)
    idle_decay: float = _f(0.98, "pulls a non-drafting row's recent acceptance toward its class's typical value, "
                           "1 - idle_decay^n after n idle steps, so it is offered drafts again", ge=0.0, le=1.0)
    replan_every: int = _f(16, "steps between re-plans of each row's step count while the batch is unchanged", ge=1)
    sla_weight: float = _f(2.0, "weight of lateness: w = (1 + priority_weight * priority) * "
                           "(1 + sla_weight * clamp(lateness - sla_slack, 0, 2))", ge=0.0)
    priority_weight: float = _f(0.1, "weight per unit of the request's priority", ge=0.0)
    sla_slack: float = _f(0.9, "the share of its target a protected row must stay within under a candidate step "
                          "(and the lateness from which a row is weighted up)", gt=0.0)
    sla_reach: bool = _f(True, "lateness raises a row's weight only while its target is within reach")
    sla_clock: Literal["wall", "decode"] = _f(
        "wall", "a row's TPOT as its client measures it (other requests' prefills included: wall), or the sum "
        "of its decode steps (decode)")
    sla_guard: bool = _f(True, "forbids suffix choices that push an on-target row past sla_slack of its target")
    sla_guard_behind: bool = _f(True, "rows already behind their target veto candidates that lower their own "
                                "tokens per ms")
    sla_guard_behind_rows: int = _f(3, "the smallest batch in which that veto applies", ge=1)
    sla_guard_plan: bool = _f(False, "holds the diffusion plan to the same guard as suffix choices")
    flat_share: float = _f(0.1, "where verifying every drafted slot costs less than this share more than verifying "
                           "none, all are verified without evaluating the predictor", ge=0.0)
    use_suffix: bool = _f(True, "rows may take suffix drafts instead of their plan")
    suffix_accept: dict | None = _f(None, "acceptance of suffix drafts by match length and vote share, per "
                                    "temperature class (fitted: adapt.suffix_fit; null: m / (m + 3))")
    suffix_vote: bool = _f(True, "read each copied token's vote share")
    suffix_recalibrate: bool = _f(True, "scale suffix acceptance by won / predicted tokens, learned online")
    suffix_margin: float = _f(0.0, "how much better a suffix choice must be predicted than the plan", ge=0.0)
    suffix_first: bool = _f(False, "every row with a copy takes all of it (as static suffix drafting)")
    diffusion_recalibrate: bool = _f(True, "scale the plan's diffusion acceptance by won / predicted tokens per "
                                     "class and step count")
    overhead_scales: bool = _f(True, "a batch size never seen drafting borrows a smaller bucket's extra, scaled "
                               "up by the rows")
    draft_credit: bool = _f(True, "drafting steps that ran under the cost tables credit diffusion plans")
    cost_by_context: bool = _f(True, "learn what steps take beyond the cost tables per context length bucket "
                               "(512, 1024, 2048 ... tokens of the longest row)")
    hold_max: int = _f(32, "the longest hold of a plain decision where deciding costs a noticeable share of a step",
                       ge=0)
    hold_share: float = _f(0.05, "the share of one row's part of a step above which deciding is held",
                           ge=0.0, le=1.0)
    hold_joins_rows: int | None = _f(8, "a hold survives requests joining from this many rows (null: never)", ge=1)
    hold_price: bool = _f(True, "a copy that would end a hold of plain decisions is priced against plain steps "
                          "without what holding saves (the decision's host time times the share of steps held)")
    span_headroom: int | None = _f(1, "positions denoised past the plan's longest draft (null: the whole block)",
                                   ge=0)
    closed_model: Literal["time", "weight"] = _f(
        "time", "in a closed batch, value a row's tokens by the time they save (time), or by a fixed weight (weight)")
    closed_weight: float = _f(0.3, "the weight of rows ahead of the slowest one with closed_model = weight",
                              ge=0.0, le=1.0)

    @field_validator("suffix_accept")
    @classmethod
    def _table(cls, value):
        return check_suffix_accept(value)


def error_text(exc: ValidationError) -> tuple[str, str]:
    """(the dotted name of the first bad setting, what is wrong with it) of a validation error."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return loc, f"unknown setting (known: {', '.join(sorted(AdaptiveSettings.model_fields))})"
    msg = err["msg"].removeprefix("Value error, ")
    return loc, f"{msg} (got {err['input']!r})"


def check_settings(values: dict) -> AdaptiveSettings:
    """The settings ``values`` validated; a `ValueError` names the first bad one
    (``"hold_max: Input should be greater than or equal to 0 (got -1)"``)."""
    try:
        return AdaptiveSettings.model_validate(values)
    except ValidationError as exc:
        loc, what = error_text(exc)
        raise ValueError(f"{loc}: {what}") from None


def drop_removed(settings: dict, where: str = "policy.settings") -> dict:
    """``settings`` without the `REMOVED` ones, each dropped with a warning that names it and
    why it went (so that older policy files keep loading)."""
    for key in sorted(set(settings) & set(REMOVED)):
        warnings.warn(f"{where}.{key}: removed setting, ignored ({REMOVED[key]})", UserWarning, stacklevel=3)
    return {k: v for k, v in settings.items() if k not in REMOVED}


def settings_table() -> str:
    """docs/policies.md's settings table (markdown), generated from `AdaptiveSettings`."""
    lines = ["| setting | default | range | effect |", "|---|---|---|---|"]
    for name, info in AdaptiveSettings.model_fields.items():
        lines.append(f"| `{name}` | `{_json(info.default)}` | {_range(info)} | {info.description} |")
    return "\n".join(lines)


def _json(value) -> str:
    return json.dumps(value)


def _range(info) -> str:
    ann = info.annotation
    text = str(ann)
    if ann is bool:
        return "bool"
    if "Literal" in text:
        return ", ".join(f'`"{a}"`' for a in ann.__args__)
    if "dict" in text:
        return "table or null"
    lo = hi = None
    strict_lo = False
    for meta in info.metadata:
        lo = getattr(meta, "ge", lo)
        if getattr(meta, "gt", None) is not None:
            lo, strict_lo = meta.gt, True
        hi = getattr(meta, "le", hi)
    kind = "int" if "int" in text and "float" not in text else "float"
    if "list" in text:
        return "list of ints ≥ 1, not empty"
    if lo is not None and hi is not None:
        out = f"[{lo}, {hi}]"
    elif lo is not None:
        out = f"{kind} {'>' if strict_lo else '≥'} {lo}"
    else:
        out = kind
    return out + (" or null" if "None" in text else "")
