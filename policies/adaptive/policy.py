"""`AdaptivePolicy`: the phases of one step, wired from the package's modules.

Per pass and per row it picks diffusion steps, draft length and leniency to maximise the batch's
*weighted* goodput (`objective`): before drafting, a `plan.Plan` of diffusion steps, then the
draft source of each row (`source`: the plan, or a suffix draft that pays more); between the
two, the span the drafter denoises (`plan.span_of`); after drafting, ``k`` and the rule
(`verify`); after the step, the online corrections learn what it did (`calibration`), and
plain decisions may be held for a few steps (`cadence`). What a step decided is one frozen
`plan.StepDecision` (``self.step``), replaced phase by phase.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from policies.base import Policy, outcome_ms, rows_per_pass
from workers.decisions import DraftIntent
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE, SUFFIX_CODE

from . import objective
from .cadence import Cadence
from .calibration import DiffusionAcceptance, StepCosts, SuffixAcceptance, chosen_only
from .plan import Plan, StepDecision, plan_steps, span_of
from .settings import AdaptiveSettings, check_settings
from .source import take_suffix
from .verify import verify_drafts, with_suffix


class AdaptivePolicy(Policy):
    name = "adaptive"

    def __init__(self, settings: AdaptiveSettings | None = None, **kwargs):
        """``settings`` (an `AdaptiveSettings`) and/or its fields as keywords (which override
        it); the other keywords are `Policy`'s (predictor, cost, block_size, online_cost). A bad
        setting is a `ValueError` naming it."""
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in AdaptiveSettings.model_fields}
        super().__init__(**kwargs)
        base = settings.model_dump() if settings is not None else {}
        self.settings = check_settings({**base, **own})
        self._apply(self.settings)
        self.step = StepDecision()  # what this step decided so far
        self._plan: Plan | None = None  # kept for `replan_every` steps while the batch is the same
        self.cadence = Cadence()
        self.costs = StepCosts()
        self.suffix = SuffixAcceptance()
        self.diffusion = DiffusionAcceptance()
        self.typical_span: float | None = None  # EMA of the spans answered: what drafting costs now
        # λ: weighted value of the marginal verified slot at the last step's optimum (tokens), fixed
        # before the next step's drafting; 0 until the first step
        self.threshold = torch.tensor(0.0)

    def _apply(self, settings: AdaptiveSettings) -> None:
        """Each setting as an attribute of the same name (``steps_grid`` sorted, without repeats;
        ``sla_clock`` into the request book)."""
        for name in AdaptiveSettings.model_fields:
            setattr(self, name, getattr(settings, name))
        self.steps_grid = tuple(sorted(set(settings.steps_grid)))

    def update(self, predictor=None, cost=None, **settings) -> None:
        """`Policy.update`, the policy's settings validated together (`check_settings`)."""
        own = {k: settings.pop(k) for k in list(settings) if k in AdaptiveSettings.model_fields}
        if own:
            self.settings = check_settings({**self.settings.model_dump(), **own})
            self._apply(self.settings)
        super().update(predictor, cost, **settings)

    @property
    def sla_clock(self) -> str:
        """How a row's time per token is measured against its target: "wall" (as the client
        measures it, other requests' prefills included; `RequestBook`) or "decode" (the sum of the
        decode steps it took part in)."""
        return "wall" if self.book.wall_clock else "decode"

    @sla_clock.setter
    def sla_clock(self, value: str) -> None:
        if value not in ("wall", "decode"):
            raise ValueError(f"sla_clock: must be 'wall' or 'decode', got {value!r}")
        self.book.wall_clock = value == "wall"

    # -- the objective (objective.py) ----------------------------------------------------------------
    def weights(self, ctx) -> torch.Tensor:
        return objective.weights(self, ctx)

    def base_weights(self, ctx) -> torch.Tensor:
        return objective.base_weights(self, ctx)

    def closed_time(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        return objective.closed_time(rows, lambda B: self.costs.plain_step_ms(B, self.cost),
                                     self.costs.step_residual.get(("plain", 1), 0.0), self.cost)

    def _ctx(self, rows, device) -> dict:
        ctx = super()._ctx(rows, device)
        plan = self._plan
        if (self.sla_reach and "reach" not in ctx and plan is not None and plan.reach is not None
                and plan.key == tuple(rows.request_ids)):
            ctx["reach"] = plan.reach
        if "tail" not in ctx and getattr(rows, "closed", False):
            objective.add_closed_batch(self, ctx, rows, lambda B: self.costs.plain_step_ms(B, self.cost),
                                       self.costs.step_residual.get(("plain", 1), 0.0), self.cost)
        return ctx

    # -- before drafting -----------------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """True while the policy holds a plain decision (the next step decides nothing)."""
        return self.cadence.holding

    @property
    def reads_suffix(self) -> bool:
        """The engine computes suffix drafts for this policy's next step: not while it holds."""
        return self.use_suffix and self.cadence.left == 0

    def _use_context(self, rows) -> None:
        """The step costs' context bucket for ``rows`` (their longest row's length)."""
        position = getattr(rows, "position", None)
        if self.cost_by_context and position is not None and len(position):
            self.costs.use_context(int(position.max()))

    def before_draft(self, rows):
        self._use_context(rows)
        if self.cadence.holds(rows, self.hold_joins_rows):
            t0 = time.thread_time()
            self.cadence.held()
            intent = DraftIntent.none(len(rows.request_ids))
            self.step = StepDecision(suffix_k=intent.steps)
            self.decision_s += time.thread_time() - t0
            self.steps_decided += 1
            return intent
        broke = self.cadence.broken()
        before = self.decision_s
        intent = super().before_draft(rows)
        saw_all = getattr(rows, "suffix_len", None) is not None or not (self.use_suffix and broke)
        self.cadence.decided(self, rows, not bool(intent.source.any()), 1e3 * (self.decision_s - before),
                             self.costs.plain_ms, saw_all)
        return intent

    def _choose(self, rows, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        B = len(rows.request_ids)
        K = int(getattr(rows, "block_size", 0) or self.block_size)
        self.step = StepDecision()
        if B == 0 or K == 0:
            return torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64)
        if not getattr(rows, "has_drafter", True):  # suffix drafts only (an engine without a drafter)
            steps, extra, toks = torch.zeros(B, dtype=torch.int64), torch.zeros(B), torch.ones(B)
        elif len(self.steps_grid) == 1 and not self.allow_no_draft:
            steps = torch.full((B,), self.steps_grid[0], dtype=torch.int64)
            extra, toks = torch.full((B,), float("inf")), torch.full((B,), float(K + 1))
        else:
            # the step plan moves slowly (recent acceptance, lateness): re-plan every few steps
            # while the batch keeps the same requests
            key = tuple(rows.request_ids)
            if self._plan is not None and self._plan.key == key and self._plan.age < self.replan_every:
                self._plan = self._plan.aged()
            else:
                self._plan = plan_steps(self, rows, ctx, B, K)
            steps, extra, toks = self._plan.steps, self._plan.extra, self._plan.toks
        plan = self._plan
        raw = plan if plan is not None and plan.raw_extra is not None and plan.key == tuple(rows.request_ids) else None
        copy = None  # [B] bool: rows that take their suffix draft (None: none does)
        if self.use_suffix and getattr(rows, "suffix_len", None) is not None and bool((rows.suffix_len > 0).any()):
            copy, self.step = take_suffix(self, rows, ctx, steps, extra, toks)
            if bool(copy.any()):
                steps = torch.where(copy.to(steps.device), 0, steps)
            else:
                copy = None
        if raw is not None:  # what the plan's prior predicts the diffusion rows that stay will win
            if copy is None and steps is raw.steps:  # every planned row stays (raw_extra is 0 off the plan)
                stay = raw.raw_extra
            else:
                stay = torch.where(steps.cpu() > 0, raw.raw_extra, torch.zeros_like(raw.raw_extra))
            self.step = replace(self.step, diffusion_expect=(stay, raw.level))
        source = torch.where(steps > 0, DIFFUSION_CODE, NONE_CODE)
        if copy is not None:
            source = torch.where(copy.to(steps.device), SUFFIX_CODE, source)
        return source, steps

    def _span(self, rows, steps: list[int]) -> int:
        span, flat = span_of(self, rows, steps)
        self.typical_span = span if self.typical_span is None else 0.8 * self.typical_span + 0.2 * span
        self.step = replace(self.step, span=span, flat=flat)
        return span

    @property
    def reads_draft_features(self) -> bool:
        """Whether this step's `after_draft` reads the drafts' features (confidence, entropy,
        margin, which the engine computes only for a reader): not where `span_of` found that
        every drafted slot will be verified (`plan.flat`), which needs no predictor."""
        return self.step.flat is not True

    # -- after drafting ------------------------------------------------------------------------------
    def _verify(self, rows, draft, ctx):
        decision, threshold = verify_drafts(self, rows, draft, ctx, self.step)
        if threshold is not None:
            self.threshold = threshold
        return with_suffix(decision, rows, draft, self.step.suffix_k)

    # -- after the step (calibration.py) --------------------------------------------------------------
    @property
    def suffix_accept_ratio(self) -> float:
        """`calibration.SuffixAcceptance`'s ratio; 1 with ``suffix_recalibrate`` off."""
        return self.suffix.ratio() if self.suffix_recalibrate else 1.0

    @property
    def diffusion_accept_ratio(self) -> torch.Tensor:
        """[2, S] `calibration.DiffusionAcceptance`'s ratio; ones with ``diffusion_recalibrate`` off."""
        S = len(self.steps_grid)
        return self.diffusion.ratio(S) if self.diffusion_recalibrate else torch.ones(2, S, dtype=torch.float64)

    def draft_overhead_at(self, batch: int, source: str = "diffusion", credit: bool | None = None) -> float:
        """`calibration.StepCosts.draft_overhead_at` under this policy's settings."""
        credit = self.draft_credit if credit is None else credit
        return self.costs.draft_overhead_at(batch, source, credit, self.overhead_scales, self.cost)

    @property
    def draft_overhead_ms(self) -> float:
        """`draft_overhead_at` the latest step's batch size, for diffusion drafting."""
        return self.draft_overhead_at(self.costs.batch)

    def _table_ms(self, record, step_ms: float) -> float:
        """A step that verified drafts teaches the cost tables its time less `draft_overhead_at`
        (charged separately): else the tables absorb the drafting path's fixed cost too
        (measured on the demo pair: a verify table steep from 1 to 2 tokens per row and the fixed
        cost counted twice)."""
        outcome = record.outcome
        source = self.costs.step_source(outcome, record.intent.steps)
        if source != "plain":
            return max(step_ms - self.draft_overhead_at(len(outcome.accepted), source, credit=False), 1e-3)
        return step_ms

    def observe(self, record) -> None:
        rows, outcome, steps = record.rows, record.outcome, record.intent.steps
        self._use_context(rows)
        predicted = None  # this step's cost as predicted before `super().observe` nudges the tables
        if self.online_cost:
            predicted = self.cost.step_ms_at(float(outcome.num_tokens), rows_per_pass(steps))
        super().observe(record)
        measured = outcome_ms(outcome)
        source = self.costs.step_source(outcome, steps) if predicted is not None and measured > 0 else None
        self.costs.observe(outcome, measured, predicted, source)
        step = self.step  # its expectations are learned from once
        if step.suffix_expect is not None or step.diffusion_expect is not None or step.suffix_pred is not None:
            self.step = replace(step, suffix_expect=None, diffusion_expect=None, suffix_pred=None)
        # the acceptance corrections learn from the rows the policy chose for: a pinned row drafted
        # (or not) as its request said, so its outcome says nothing of the choice (the step-cost
        # corrections above learn the step as it ran, pins included: a step's time is not per row)
        suffix_expect, diffusion_expect = chosen_only(step.suffix_expect, step.diffusion_expect, record.pinned)
        self.suffix.observe(suffix_expect, outcome.accepted)
        self.diffusion.observe(len(self.steps_grid), diffusion_expect, outcome.accepted, rows.temperature)
        if step.suffix_pred is not None and self.online_cost:  # correct the choice's cost by what the step took
            self.costs.observe_choice(step.suffix_pred, measured)

    def stats(self) -> dict:
        out = super().stats()
        out["held_share"] = self.cadence.held_steps / max(self.steps_decided, 1)
        out["suffix_accept"] = {"drafts": self.suffix.drafts, "ratio": round(self.suffix_accept_ratio, 3)}
        ratio = self.diffusion_accept_ratio.tolist()                                   # [2, S]
        out["diffusion_accept"] = {"drafts": self.diffusion.drafts, "ratio": {
            cls: {str(st): round(r, 3) for st, r in zip(self.steps_grid, ratio[i])} for i, cls in enumerate(("greedy", "sampled"))}}
        # what each kind of step took beyond the cost tables, per batch bucket
        out["step_residual"] = {f"{k}@{b}": round(v, 2) for (k, b), v in sorted(self.costs.step_residual.items())}
        # what each suffix choice predicted its step would take against what it took (plan / wide)
        out["suffix_calibration"] = {f"{k}@{b}": {"steps": int(n), "predicted_ms": round(p / n, 2), "measured_ms": round(m / n, 2)}
                                     for (k, b), (n, p, m) in sorted(self.costs.suffix_calibration.items()) if n}
        return out
