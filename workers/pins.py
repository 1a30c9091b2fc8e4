"""Per-request decode pins: the knobs a request fixed, held over whatever decision maker runs.

A **pin** is a knob of `DecodeKnobs` that the caller fixed (`DecodeKnobs.pinned`: the HTTP
``decode`` body extension, the CLI's --steps / --draft-len / --draft-source, `DecodeKnobs.pin`
in Python). The engine applies pins here, between the decision maker's answers and drafting or
verifying, so that every policy keeps them the same way, per row, per step:

- ``draft_len: 0`` or ``source: "none"``: the row drafts nothing; no drafted token of any
  source is verified for it;
- ``source: "suffix"`` (or any source but diffusion and none, workers/draft_sources.py): the
  row takes that source's draft; ``steps: s`` (s > 0): it drafts by diffusion in s passes;
  ``steps: 0`` (without such a source): it drafts nothing;
  ``source: "diffusion"``: it drafts by diffusion, in the decision maker's s (or the knobs'
  when the decision maker chose not to draft it by diffusion);
- ``draft_len: k`` (k > 0): the row verifies k drafted tokens (and drafts, from the decision
  maker's source, or the knobs' when the decision maker chose not to draft it);
- ``commit_order``: the engine reads it from the knobs on every step anyway.

A row that drafts because of a pin where its decision maker chose otherwise (**forced**) gets its
knobs' draft length (the block unless pinned) and its exact rule: the decision maker's answers
for it were made for another draft. Levers that are not pinned stay the decision maker's.

**Clamps** (each counted per request, `workers.decode_log.DecodeLog`): a pinned value above the
block (the drafter's K; the suffix drafter's cap) is clamped to it when the request is added
(`clamp_to_block`); a pinned draft length is cut to the tokens left minus one (the bonus token
needs room; a row with one token left drafts nothing) and to the draft its source has (a suffix
draft may be shorter, or empty).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from workers import draft_sources
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE
from workers.request import PIN_FIELDS

FREE = -9        # RowPins.source: the decision maker chooses the row's draft source and steps
DRAFT = -3       # RowPins.source: some draft (draft_len pinned > 0), the decision maker's source


@dataclass(frozen=True)
class RowPins:
    """One request's pins as the engine applies them. source: the row's draft source code when
    fixed (workers/draft_sources.py), or `FREE` / `DRAFT` (see the module docstring); steps: the
    pinned diffusion passes of a diffusion row (0: the decision maker's); draft_len: the pinned
    k, -1 when free; fallback_source / fallback_steps: the source (and passes) a row takes when a
    pin makes it draft where its decision maker did not (the knobs' own source, diffusion in
    `knobs.steps` passes, at least 1, unless the knobs name another source); knob_draft_len: the
    k such a row verifies (the knobs' draft length); shown: the pins as applied, for the
    request's stats; block_clamps: how many pinned values were clamped to the block."""

    source: int = FREE
    steps: int = 0
    draft_len: int = -1
    fallback_source: int = DIFFUSION_CODE
    fallback_steps: int = 1
    knob_draft_len: int = 0
    shown: tuple = ()
    block_clamps: int = 0

    @property
    def any(self) -> bool:
        return self.source != FREE


NO_PINS = RowPins()


def clamp_to_block(knobs, block: int, width: int):
    """(knobs, clamped): pinned ``steps`` above the drafter's block `block` and a pinned
    ``draft_len`` above the widest draft of its source (`block` for diffusion, `width` for
    other sources) set to that bound; ``clamped`` counts them."""
    change = {}
    if "steps" in knobs.pinned and 0 < block < knobs.steps:
        change["steps"] = block
    cap = (block or width) if knobs.source in ("diffusion", "none") else width
    if "draft_len" in knobs.pinned and knobs.draft_len > cap:
        change["draft_len"] = cap
    return (dataclasses.replace(knobs, **change) if change else knobs), len(change)


def row_pins(knobs, block_clamps: int = 0) -> RowPins:
    """A request's `RowPins` from its (block-clamped) knobs."""
    p = knobs.pinned
    shown = tuple((name, getattr(knobs, name)) for name in PIN_FIELDS if name in p)
    k = knobs.draft_len if "draft_len" in p else -1
    steps = 0
    if k == 0 or ("source" in p and knobs.source == "none"):
        source, k = NONE_CODE, 0
    elif "source" in p and knobs.source != "diffusion":  # a copy-like source
        source = draft_sources.by_name(knobs.source).code
    elif "steps" in p:
        source, steps = (DIFFUSION_CODE, knobs.steps) if knobs.steps > 0 else (NONE_CODE, 0)
        k = 0 if source == NONE_CODE else k
    elif "source" in p:
        source = DIFFUSION_CODE  # in the decision maker's steps
    elif k > 0:
        source = DRAFT
    else:
        source = FREE
    if knobs.source in ("diffusion", "none"):
        fallback = (DIFFUSION_CODE, max(knobs.steps, 1))
    else:
        fallback = (draft_sources.by_name(knobs.source).code, 0)
    return RowPins(source, steps, k, *fallback, knobs.draft_len, shown, block_clamps)


@dataclass(frozen=True)
class StepPins:
    """The running rows' pins in one step (host tensors [B]) and what they did to the decision
    maker's intent: ``forced`` rows draft where (or how) the decision maker did not choose."""

    source: torch.Tensor          # [B] int64 RowPins.source
    steps: torch.Tensor           # [B] int64 pinned diffusion passes, 0 free
    draft_len: torch.Tensor       # [B] int64 pinned k, -1 free
    knob_draft_len: torch.Tensor  # [B] int64
    fallback_source: torch.Tensor  # [B] int64
    fallback_steps: torch.Tensor  # [B] int64
    forced: torch.Tensor          # [B] bool

    @classmethod
    def of(cls, pins: list[RowPins]) -> "StepPins | None":
        """The step's pins, or None when no running row pins anything (nothing to apply)."""
        if not any(p.any for p in pins):
            return None
        t = torch.tensor([[p.source, p.steps, p.draft_len, p.knob_draft_len, p.fallback_source, p.fallback_steps]
                          for p in pins], dtype=torch.int64)  # [B, 6]
        return cls(*t.unbind(1), torch.zeros(len(pins), dtype=torch.bool))

    @property
    def pinned(self) -> torch.Tensor:
        """[B] bool (host): rows whose request pinned some knob (`StepRecord.pinned`)."""
        return self.source != FREE

    def apply(self, source: torch.Tensor, steps: torch.Tensor, remaining: torch.Tensor
              ) -> "tuple[torch.Tensor, torch.Tensor, StepPins]":
        """The source codes and diffusion steps [B] (host) each row drafts with: the decision
        maker's (``source``, ``steps``: 0 on rows not drafting by diffusion), overridden by the
        pins; `remaining` [B]: tokens each row may still emit (a pinned row with one left drafts
        nothing). Returns them with these pins, their ``forced`` rows marked."""
        code, fb_src = self.source, self.fallback_source
        fb_steps = torch.where(fb_src == DIFFUSION_CODE, self.fallback_steps, 0)
        fixed = code >= 0
        src = torch.where(fixed, code, source)
        st = torch.where(fixed, self.steps, steps)
        # diffusion pinned without its steps: the decision maker's passes where it drafts by diffusion
        own = (code == DIFFUSION_CODE) & (self.steps == 0)
        st = torch.where(own, torch.where(source == DIFFUSION_CODE, steps, self.fallback_steps.clamp(min=1)), st)
        # some draft pinned: the decision maker's source where it drafts, else the knobs' own
        fallback = (code == DRAFT) & (source == NONE_CODE)
        src, st = torch.where(fallback, fb_src, src), torch.where(fallback, fb_steps, st)
        pinned = code != FREE
        src = torch.where(pinned & (remaining <= 1), NONE_CODE, src)
        st = torch.where(src == DIFFUSION_CODE, st, 0)
        forced = pinned & ((src != source) | (st != steps)) & (src != NONE_CODE)
        return src, st, dataclasses.replace(self, forced=forced)

    def span(self, steps: torch.Tensor) -> int:
        """The most drafted tokens a pinned diffusion row (s > 0) verifies this step (0: none)."""
        want = torch.where(self.draft_len >= 0, self.draft_len, torch.where(self.forced, self.knob_draft_len, 0))
        want = torch.where(steps > 0, want, 0)
        return int(want.max()) if len(want) else 0

    def apply_verify(self, k: torch.Tensor, rule: torch.Tensor, param: torch.Tensor, param2: torch.Tensor,
                     exact_rule: torch.Tensor):
        """The decision maker's draft lengths and rules [B] (on any device), with pinned draft
        lengths and, for forced rows and rows the pin makes verify where the decision maker
        verified nothing, the knobs' draft length and the row's exact rule with parameters 0.
        Returns (k, rule, param, param2) on k's device; the engine then caps k by the draft
        each row has and its tokens left."""
        dev = k.device
        pk, kk, forced = self.draft_len.to(dev), self.knob_draft_len.to(dev), self.forced.to(dev)
        own = forced | ((pk > 0) & (k <= 0))
        k = torch.where(pk >= 0, pk, torch.where(forced, kk, k))
        exact = exact_rule.to(device=dev, dtype=rule.dtype)
        rule = torch.where(own, exact, rule)
        param = torch.where(own, torch.zeros_like(param), param)
        param2 = torch.where(own, torch.zeros_like(param2), param2)
        return k, rule, param, param2


def pin_clamp(pins: RowPins, steps: int, draft_len: int, remaining: int) -> str | None:
    """Why a decode step cut a row's pins, or None if it kept them: a pinned draft length
    verified shorter, or pinned diffusion steps not run. 'tokens_left': the row had fewer than
    k + 1 tokens left (one, for pinned steps alone); 'draft': its source's draft was shorter (a
    suffix draft, possibly empty)."""
    want = pins.draft_len
    if not ((want > 0 and draft_len < want) or (pins.steps > 0 and steps != pins.steps)):
        return None
    return "tokens_left" if remaining - 1 < max(want, 1) else "draft"
