"""The policy interface: a `DecisionMaker` (docs/contracts.md §5) with memory and timing.

A *policy* answers the engine's three calls every step, for every row of the batch
(workers/decisions.py):

- ``before_draft(rows) -> DraftIntent``: each row's draft source and diffusion steps ``s``, and
  the span: the most drafted tokens a diffusion row may verify this step, so the drafter
  denoises only that many block positions;
- ``after_draft(rows, intent, draft) -> VerifyDecision``: after drafting, the draft length ``k``
  to verify and the acceptance rule with its parameters (the leniency); not asked on a step
  where no row drafts (there is nothing to verify);
- ``observe(record)``: what happened (`workers.step_record.StepRecord`: the intent as applied,
  accepted drafts, TVD spent, step time).

`Policy` implements the bookkeeping every policy needs (per-request targets and SLA progress,
budgets, decision timing, online cost correction) and leaves two methods to subclasses:
`_steps(rows, ctx)` (diffusion passes per row, 0 = no draft; or `_choose(rows, ctx)` for a
policy that picks other draft sources too) and `_verify(rows, draft, ctx)`, with an optional
third, `_span(rows, steps)`. Policies never import `adapt`: a fitted
acceptance predictor and step-cost model are handed in (`predictor=`, `cost=`; see
`adapt.controller.build_policy`), with simple built-in stand-ins from `policies.defaults`.

Every policy must keep three promises, whatever it optimises:
1. lossless rows get only exact rules (GREEDY, REJECTION, MATCH as `kernels.rules.exact_rules`
   picks; the engine applies `kernels.rules.enforce_rules` to every answer whatever it says);
2. ε rows spend at most ε per token and never more than their total budget left;
3. for sampled lossless rows, the draft length of position ``j`` depends only on features of
   positions ``≤ j`` and on other rows (non-anticipation; docs/controller.md).
"""

from __future__ import annotations

import time

import torch

from kernels.rules import Rule
from policies.common import RequestBook
from policies.defaults import ConfidenceSurvival, LinearCost


def make_verify_decision(draft_len: torch.Tensor, rule: torch.Tensor, param: torch.Tensor, rows,
                         param2: torch.Tensor | None = None):
    """Build the engine's `VerifyDecision` (imported lazily: the engine package is heavier).

    ``k`` is capped at ``remaining − 1`` (the engine does the same: the bonus token needs room).
    Rows that verify nothing (k = 0) get MATCH (sampled) or GREEDY (T = 0): their one token is the
    target's own sample under every rule, and neither needs the draft probabilities."""
    from workers.decisions import VerifyDecision

    remaining = getattr(rows, "remaining", None)
    if remaining is not None:
        draft_len = torch.minimum(draft_len, (remaining.to(draft_len.device) - 1).clamp_min(0))
    none = draft_len <= 0
    rule = torch.where(none, _plain_rule(rows, rule.device).to(rule.dtype), rule)
    param = param.masked_fill(none, 0.0)
    if param2 is None:
        param2 = torch.zeros_like(param)
    return VerifyDecision(draft_len=draft_len.to(torch.int64), rule=rule.to(torch.int32),
                          param=param.to(torch.float32), param2=param2.to(torch.float32))


def no_draft_decision(rows, device):
    """The decision for a step in which no row drafted: verify nothing; each row emits the
    target's own token (GREEDY at T = 0, MATCH otherwise, as `make_verify_decision` gives k = 0
    rows), in a handful of ops (the autoregressive steady state of a policy)."""
    from workers.decisions import VerifyDecision

    B = len(rows.request_ids)
    zeros = torch.zeros(B, device=device)
    return VerifyDecision(draft_len=torch.zeros(B, dtype=torch.int64, device=device),
                          rule=_plain_rule(rows, device), param=zeros, param2=zeros)


def _plain_rule(rows, device) -> torch.Tensor:
    """[B] int32 rule of a row that verifies nothing: GREEDY at T = 0, MATCH otherwise (under
    either, its one token is the target's own sample and no draft probabilities are read)."""
    return torch.where(rows.temperature.to(device) > 0, int(Rule.MATCH), int(Rule.GREEDY)).to(torch.int32)


class Policy:
    """Base class of every policy. Subclasses set `name` and implement `_steps` and `_verify`."""

    name = "base"
    reads_draft_features = True  # `_verify` reads the drafts' confidence, entropy and margin
    reads_suffix = False         # `_steps` reads no suffix drafts

    def __init__(self, predictor=None, cost=None, block_size: int = 16, online_cost: bool = True):
        self.predictor = predictor if predictor is not None else ConfidenceSurvival()
        self.cost = cost if cost is not None else LinearCost()
        self.block_size = int(block_size)
        self.online_cost = bool(online_cost)
        self.book = RequestBook()
        self.decision_s = 0.0
        self.steps_decided = 0
        self._devices: dict[str, object] = {}
        self.throughput = 0.0  # EMA of emitted tokens per ms, the Θ used as a marginal value

    # -- hot reload ------------------------------------------------------------------------------
    def update(self, predictor=None, cost=None, **settings) -> None:
        """Swap in a new predictor / cost model / settings between steps."""
        if predictor is not None:
            self.predictor = predictor
            self._devices.clear()
        if cost is not None:
            self.cost = cost
        for key, value in settings.items():
            if not hasattr(self, key):
                raise ValueError(f"{key}: not a setting of policy {self.name!r}")
            setattr(self, key, value)

    def _predictor_on(self, device: torch.device):
        key = str(device)
        if key not in self._devices:
            to = getattr(self.predictor, "to", None)
            self._devices[key] = to(device) if to else self.predictor
        return self._devices[key]

    def _ctx(self, rows, device) -> dict:
        """Per-row targets, budgets and lateness for this step (computed once per RowState)."""
        cached = getattr(self, "_ctx_cache", None)
        if cached is not None and cached[0] is rows and cached[1] == str(device):
            return cached[2]
        ctx = self.book.tensors(rows, device)
        self._ctx_cache = (rows, str(device), ctx)
        return ctx

    # -- the DecisionMaker protocol --------------------------------------------------------------
    def before_draft(self, rows):
        """The step's `DraftIntent`: `_choose` per row, and `_span` where some row drafts by
        diffusion and the engine denoises partial blocks (``rows.fixed_span`` False)."""
        from workers.decisions import DraftIntent

        t0 = time.thread_time()
        device = rows.temperature.device
        ctx = self._ctx(rows, device)
        source, steps = self._choose(rows, ctx)
        self.steps_decided += 1
        span = 0
        if not rows.fixed_span:
            steps_host = steps.tolist()
            if any(s > 0 for s in steps_host):
                span = self._span(rows, steps_host)
        self.decision_s += time.thread_time() - t0
        return DraftIntent(source.to(torch.int64).cpu(), steps.to(torch.int64).cpu(), span)

    def after_draft(self, rows, intent, draft):
        t0 = time.thread_time()
        if draft.confidence.device.type != "cpu":  # decide on the host: one read of the features, none after
            draft = draft.to_host()
        self.block_size = int(draft.confidence.shape[1]) or self.block_size
        ctx = self._ctx(rows, draft.confidence.device)
        decision = self._verify(rows, draft, ctx)
        self.decision_s += time.thread_time() - t0
        return decision

    def observe(self, record) -> None:
        """Learn from the step `record` (its applied intent: the steps each row really drafted
        with, pins included): the request book, the throughput Θ, the online cost tables."""
        t0 = time.thread_time()
        self._ctx_cache = None  # this step's context is stale now
        rows, outcome, steps = record.rows, record.outcome, record.intent.steps
        step_ms = outcome_ms(outcome)
        if getattr(outcome, "any_verified", None) is False:  # a plain step: one token per row, nothing to read
            self.book.observe_plain(rows, step_ms)
            emitted_sum = float(len(rows.request_ids))
        else:
            emitted = torch.as_tensor(outcome.accepted).cpu() + 1
            verified = torch.where(steps > 0, torch.as_tensor(outcome.verified).cpu(), 0)  # diffusion drafts only
            self.book.observe(rows, emitted, step_ms, verified)
            emitted_sum = float(emitted.sum())
        if step_ms > 0:
            rate = emitted_sum / step_ms
            self.throughput = rate if self.throughput == 0 else 0.8 * self.throughput + 0.2 * rate
        if self.online_cost:
            self.cost.observe(float(outcome.num_tokens), rows_per_pass(steps), self._table_ms(record, step_ms))
        self.decision_s += time.thread_time() - t0

    def _table_ms(self, record, step_ms: float) -> float:
        """The part of a measured step the cost tables should learn (all of it here; a policy
        that models a fixed cost separately takes it out)."""
        return step_ms

    # -- to implement ----------------------------------------------------------------------------
    def _choose(self, rows, ctx: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's draft source code and diffusion steps ([B] int64 each): rows with `_steps`
        s > 0 draft by diffusion in s passes, the others draft nothing."""
        from workers.draft_sources import DIFFUSION_CODE, NONE_CODE

        steps = self._steps(rows, ctx).to(torch.int64).clamp(min=0)
        return torch.where(steps > 0, DIFFUSION_CODE, NONE_CODE), steps

    def _steps(self, rows, ctx: dict) -> torch.Tensor:
        raise NotImplementedError

    def _verify(self, rows, draft, ctx: dict):
        raise NotImplementedError

    def _span(self, rows, steps: list[int]) -> int:
        """The intent's span (``steps``: `_steps`' answer, host ints): the whole block (a policy that picks draft lengths after drafting, from
        features of every position, needs them all)."""
        return int(getattr(rows, "block_size", 0) or self.block_size)

    # -- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        n = max(self.steps_decided, 1)
        return {"policy": self.name, "steps_decided": self.steps_decided,
                "decision_ms_per_step": 1e3 * self.decision_s / n}


def outcome_ms(outcome) -> float:
    """Wall time of a step in ms (`StepOutcome.step_time` is in seconds)."""
    ms = getattr(outcome, "step_ms", None)
    return float(ms) if ms is not None else 1e3 * float(outcome.step_time)


def rows_per_pass(steps) -> list[int]:
    """steps: [B] diffusion steps per row (tensor or list) -> rows in each denoising pass 1..max(s)."""
    values = steps.tolist() if hasattr(steps, "tolist") else list(steps)
    top = max(values, default=0)
    counts = [0] * (top + 2)
    for v in values:
        if v > 0:
            counts[v] += 1
    out, running = [], 0
    for level in range(top, 0, -1):
        running += counts[level]
        out.append(running)
    return out[::-1]
