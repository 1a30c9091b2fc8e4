"""SLA guards: candidate steps that would push a row off its latency (TPOT) target are worth 0,
and a row whose target is out of reach is not weighted up.

A row *meets* its TPOT target ``T`` when its time so far per token stays within ``T``; it is
*protected* under the plan when it meets ``T`` there; *behind* when it does not.
"""

from __future__ import annotations

import torch

from .objective import planned_extra


def behind_veto(s, B: int) -> bool:
    """Whether rows behind their target veto what slows them in a step of ``B`` rows
    (`keeps_targets`' ``behind``): with `sla_guard_behind`, in batches of at least
    `sla_guard_behind_rows` rows (in a smaller batch a copy widens the step little, and
    declining it costs its own row's tokens)."""
    return s.sla_guard_behind and B >= s.sla_guard_behind_rows


def plan_keeps(s, rows, ctx, ms: torch.Tensor, order: torch.Tensor, cur_gain: torch.Tensor,
               new_gain: torch.Tensor, w_base: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B + 1] `keeps_targets` for a level of the plan (`sla_guard_plan`): candidate ``n`` admits
    the first ``n`` rows of ``order`` to the level, at ``ms`` [B + 1] predicted; each row's
    expected tokens are its one token plus its planned extra tokens (`planned_extra`;
    ``cur_gain`` [B] before the level, ``new_gain`` [B] admitted to it)."""
    B = len(order)
    rank = torch.argsort(order.cpu())                                               # [B] place in `order`
    w_base, w = w_base.cpu(), w.cpu()
    now = 1.0 + planned_extra(cur_gain.cpu(), w_base, w)                            # [B] expected tokens
    then = 1.0 + planned_extra(new_gain.cpu(), w_base, w)
    n = torch.arange(B + 1)                                                         # [C] rows admitted
    tokens = torch.where(rank[:, None] < n[None, :], then[:, None], now[:, None])   # [B, C]
    return keeps_targets(ctx, ms.cpu(), tokens, rows.remaining, s.sla_slack, behind_veto(s, B))


def reachable(rows, ctx, best_extra: torch.Tensor, plain_ms: float) -> torch.Tensor:
    """[B] whether each row can still meet its TPOT target (`sla_reach`): the pace its remaining
    tokens need, ``(T · (n + R) − elapsed) / R`` ms per token (``R`` = ``rows.remaining``), is no
    faster than a plain step of this batch (``plain_ms``) bringing it ``1 + best_extra`` tokens
    [B] (its most expected extra tokens of a draft, over the whole block at the best step
    count). A row out of reach gains nothing from being weighted up: the tokens its weight buys
    cost the batch's throughput and meet no target. Measured (load 32): drafting for ~11 rows
    two to three times behind a 39 ms target, in 90 ms plain steps, took steps to 218 ms for 45
    tokens (0.21 tokens/ms against 0.35 plain). Rows without a target count as within reach."""
    if not ctx.get("targeted", True):  # no row has a target: all within reach
        return torch.ones(len(rows.request_ids), dtype=torch.bool)
    T = ctx["tpot_ms"].cpu()                                                       # [B] inf = none
    left = rows.remaining.cpu().float().clamp_min(1.0)                              # [B]
    n, elapsed = ctx["tokens"].cpu().float(), ctx["elapsed_ms"].cpu().float()       # [B]
    need = (T * (n + left) - elapsed) / left                                        # [B] ms per token
    return ~torch.isfinite(T) | (need * (1.0 + best_extra.float()) >= plain_ms)


def keeps_targets(ctx: dict, ms: torch.Tensor, tokens: torch.Tensor,
                  remaining: torch.Tensor | None = None, slack: float = 1.0, behind: bool = False) -> torch.Tensor:
    """[C] whether candidate step ``c`` (predicted ``ms`` [C], expected tokens per row ``tokens``
    [B, C], column 0 the plan) keeps every row that meets its TPOT target under the plan within
    ``slack`` times it (a headroom for what the prediction does not know: the prefills to come,
    the noise of step times). A row with ``elapsed`` ms and ``n`` tokens so far meets a target
    ``T`` after a step of ``t`` ms that brings it ``e`` tokens when both
      - now: ``elapsed + t ≤ T · (n + e)``, and
      - at the end (with ``remaining`` [B], the tokens it may still emit): ``elapsed + t +
        (remaining − e) · pace ≤ T · (n + remaining)``, finishing at the plan's step time
        plus the batch's stall per token so far (``Σ stall_ms / Σ n`` over the rows: time outside
        decode steps, other requests' prefills; 0 under the decode clock). The batch's rate, not
        the row's own: one prefill early in a row's life would read as a stall of hundreds of ms
        per token for the rest of it.
    A protected row (one that meets ``T`` = its target under the plan) must meet ``slack · T``
    under the candidate; with ``slack < 1`` a protected row already past ``slack · T`` under the
    plan rules out every widening step (the plan, column 0, stays the choice). Rows without a
    target do not constrain; rows already behind it under the plan do not either (their weight in
    the objective does), unless ``behind``: then such a row vetoes every candidate that lowers its
    own expected tokens per ms (``tokens / ms`` below the plan's), so drafting for others (or a
    draft of its own that is not predicted to pay) does not put it further behind."""
    if not ctx.get("targeted", True):  # no row has a target: nothing to keep
        return torch.ones(ms.shape[0], dtype=torch.bool)
    target = ctx["tpot_ms"].cpu()[:, None]                                            # [B, 1] inf = none
    elapsed, count = ctx["elapsed_ms"].cpu()[:, None], ctx["tokens"].cpu()[:, None]   # [B, 1]
    finish = left = None
    if remaining is not None:
        left = remaining.cpu().float()[:, None]                                       # [B, 1]
        rate = ctx["stall_ms"].cpu().sum() / count.sum().clamp_min(1.0)               # [] stall ms per token
        pace = ms[0] + rate                                                           # [] ms per later token
        finish = elapsed + ms[None, :] + (left - tokens).clamp_min(0.0) * pace        # [B, C]

    def meets(T: torch.Tensor) -> torch.Tensor:                                        # [B, C]
        ok = elapsed + ms[None, :] <= T * (count + tokens)
        return ok if finish is None else ok & (finish <= T * (count + left))

    protected = meets(target)[:, :1]                                                  # [B, 1]
    keeps = ~(protected & ~meets(slack * target)).any(0)                              # [C]
    if behind:
        late = torch.isfinite(target) & ~protected                                    # [B, 1] behind under the plan
        rate = tokens / ms.clamp_min(1e-6)[None, :]                                   # [B, C] own tokens per ms
        keeps = keeps & ~(late & (rate < rate[:, :1] * (1.0 - 1e-6))).any(0)
    return keeps
