"""What a row's tokens are worth: the weights of the policy's objective, the batch's *weighted*
goodput ``Θ_w = Σ_r w_r E[r] / step_ms``.

A row's *extra* tokens (drafted tokens it wins beyond the one every step emits) weigh 1, more
for higher priority, up to ``1 + 2·sla_weight`` when far behind its latency target
(*urgency*); in a *closed batch* (nothing waits, nothing will join: `RowState.closed`) they are
weighed by the step time they save instead. Every function reads the step's ``ctx`` (per-row
targets, budgets and lateness, `policies.common.RequestBook`) and keeps what it computes there,
so a step computes each weight once.
"""

from __future__ import annotations

import torch


def weights(s, ctx) -> torch.Tensor:
    """[B] what a row's extra tokens are worth: its `urgency`, times its weight in a closed
    batch (``ctx["tail"]``: `closed_time`, or `tail` under ``closed_model = "weight"``).
    ``s``: the policy's settings."""
    if "w" not in ctx:
        ctx["w"] = urgency(s, ctx)
        if "tail" in ctx:
            ctx["w"] = ctx["w"] * ctx["tail"]
    return ctx["w"]


def base_weights(s, ctx) -> torch.Tensor:
    """[B] what the one token a row emits in every step is worth: `weights`, except in a closed
    batch under ``closed_model = "time"``, where a plain step's tokens are worth the whole step."""
    if "tail_base" not in ctx:
        return weights(s, ctx)
    if "w_base" not in ctx:
        ctx["w_base"] = urgency(s, ctx) * ctx["tail_base"]
    return ctx["w_base"]


def urgency(s, ctx) -> torch.Tensor:
    """[B] 1, more for higher priority, up to 1 + 2·sla_weight when far behind target; with
    `sla_reach`, lateness counts only for rows whose target is within reach (``ctx["reach"]``,
    set by the plan)."""
    if "urgency" not in ctx:
        behind = (ctx["lateness"] - s.sla_slack).clamp(0.0, 2.0)
        if "reach" in ctx:
            behind = torch.where(ctx["reach"].to(behind.device), behind, torch.zeros_like(behind))
        ctx["urgency"] = ((1.0 + s.priority_weight * ctx["priority"]).clamp_min(0.1)
                          * (1.0 + s.sla_weight * behind))
    return ctx["urgency"]


def add_closed_batch(s, ctx, rows, plain_step_ms, residual_1: float, cost) -> None:
    """Put a closed batch's weights into ``ctx`` (``tail`` and, under the time model,
    ``tail_base``); an open batch's ctx is left as it is."""
    if "tail" in ctx or not getattr(rows, "closed", False):
        return
    dev = ctx["lateness"].device
    if s.closed_model == "time" and len(rows.request_ids) > 1:
        ctx["tail"], ctx["tail_base"] = (t.to(dev) for t in closed_time(rows, plain_step_ms, residual_1, cost))
    else:
        ctx["tail"] = tail(rows, s.closed_weight).to(dev)


def closed_time(rows, plain_step_ms, residual_1: float, cost) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] extra-token weights, [B] base weights) of a **closed batch** valued by the time its
    tokens save (``closed_model = "time"``). With the plain step of ``B`` rows
    ``T_B = T0 + B·δ`` (``δ`` what one more row adds, ``T0`` the rest; ``T_B`` measured,
    ``plain_step_ms(B)``; ``T_1`` the cost model's with its residual ``residual_1``), the batch's
    time is ``T0`` per step until its last row exits plus ``δ`` per step for each row still
    running. So a row's extra token saves ``δ`` (its own share of a later step), and the extra
    token of the batch's *unique* last row (the most tokens left, ahead of the next row by
    ``gap``) also saves ``T0`` (a whole later step), counted in full for ``gap`` >= 2 and in
    part below; a plain step is worth its whole ``T_B``. In units of an open batch's token
    (``T_B / B``): every row's base weight is 1, a row's extra tokens weigh ``B·δ / T_B`` (on
    SmolLM2 here at 8 rows ~0.4–0.5) and the unique last row's ``B·(δ + T0·min(1, gap / 2)) /
    T_B`` (up to ~5). Rows level at the end end together, so none of them alone shortens the
    batch: their extra tokens weigh ``B·δ / T_B`` like the others'. (Weighing a closed batch by
    its end instead measured 0.909x against 0.954x at batch 8, docs/benchmarks.md.)"""
    B = len(rows.request_ids)
    T_B = max(plain_step_ms(B), 1e-3)
    T_1 = float(cost.step_ms_at(1.0)) + residual_1
    delta = min(max((T_B - T_1) / (B - 1), 0.0), T_B / B)
    T0 = T_B - B * delta
    left = rows.remaining.float().cpu()                                                  # [B]
    top = left.max()
    last = left >= top                                                                   # [B] the most left
    extra = torch.full((B,), B * delta / T_B)
    if int(last.sum()) == 1:
        gap = float(top - left[~last].max())
        extra = torch.where(last, B * (delta + T0 * min(1.0, gap / 2.0)) / T_B, extra)
    return extra, torch.ones(B)


def tail(rows, closed_weight: float) -> torch.Tensor:
    """[B] what a row's tokens are worth in a closed batch under ``closed_model = "weight"``: 1
    for the rows with the most tokens left (the batch's *tail*: the batch ends when they do),
    ``closed_weight`` for rows ahead of them. A token of a row ahead only brings its exit
    forward, which saves what that row adds to each later step, not a step of the batch.
    Measured without it (8 equal-length requests): the policy widened steps by 21 % for 3 %
    fewer steps, 0.935x autoregressive decoding."""
    B = len(rows.request_ids)
    if closed_weight >= 1.0 or B < 2:
        return torch.ones(B)
    left = rows.remaining.float().cpu()                                                  # [B]
    return torch.where(left >= left.max(), torch.ones(B), torch.full((B,), closed_weight))


def planned_extra(gain: torch.Tensor, w_base: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B] the extra tokens a plan expects of each row from its weighted gain ``gain`` [B]
    (``w_base`` [B] for the one token every step emits, ``w`` [B] per extra token; a row whose
    extra tokens weigh 0, in a closed batch, has none)."""
    return (gain - w_base) / w.clamp_min(1e-9)
