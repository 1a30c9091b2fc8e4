"""What one decode step did, as the decision maker and the engine's observers see it.

A `StepRecord` is built once per decode step, after its one host read and the rows' commit, and
handed to `DecisionMaker.observe` and then to every `StepObserver` in `Engine.observers` (the
only way a benchmark or an instrument sees a step: nothing wraps or patches the engine).

**Phases** of a decode step (`StepRecord.times`, seconds, from the engine's clock):
- ``decide``: `before_draft`, the rows' pins applied to its intent;
- ``draft``: the drafts of every source (the diffusion drafter's passes, suffix copies);
- ``choose``: `after_draft` and the step's plan (draft lengths, rules, ragged layout);
- ``forward``: the target forward over each row's anchor and verified drafts;
- ``accept``: verification (or the next token's sampling) and the step's one host read;
- ``conclude``: the rows' commit, emitted tokens, stop checks, traces and `observe`. It is set
  after `observe` returns: the decision maker sees every phase but this one, observers all six.
On a step where no row drafts, ``draft`` and ``choose`` are 0. CPU work is synchronous, so these
are the phases' costs on a CPU; on CUDA they are host times (kernels may still run) unless
`Engine.sync_phases` is set, which synchronises the device at each boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from workers.decisions import DraftIntent, RowState, StepOutcome
from workers.step_batch import StepPlan

PHASES = ("decide", "draft", "choose", "forward", "accept", "conclude")


@dataclass(frozen=True)
class StepRecord:
    """One decode step: its index (`Engine.step_count`), the `rows` as the step began, the
    `intent` as the engine applied it (pins, empty drafts, the span denoised), the `plan` after
    drafting (None on a step where no row drafted), the `outcome`, `pinned` rows (whose request
    pinned knobs: what the decision maker chose for them was overridden wherever it differed) and
    the phase `times` (`PHASES`, seconds)."""

    step: int
    rows: RowState
    intent: DraftIntent
    plan: StepPlan | None
    outcome: StepOutcome
    pinned: torch.Tensor                         # [B] bool (host)
    times: dict = field(default_factory=dict)    # phase -> seconds

    @classmethod
    def of(cls, rows: RowState, intent: DraftIntent, outcome: StepOutcome, step: int = 0) -> "StepRecord":
        """A record without pins, plan or times (what a trace replay or a test knows of a step)."""
        return cls(step, rows, intent, None, outcome, torch.zeros(len(rows.request_ids), dtype=torch.bool))


class StepObserver(Protocol):
    """What `Engine.observers` hold: told of every decode step (after the decision maker's
    `observe`) and every prefill (its wall seconds and the requests it prefilled)."""

    def on_step(self, record: StepRecord) -> None: ...
    def on_prefill(self, seconds: float, rows: int) -> None: ...
