"""After drafting: how many drafted tokens ``k`` each row verifies, and under which rule.

Each ε row gets the ε-TVD rule with its leniency (its ε, capped by the total budget left, only
where the draft probabilities are true conditionals and T > 0); lossless rows get their exact
rule. Survival under that rule, times the row weight, ranks every slot of the batch and
`greedy_prefix` admits slots while Θ_w rises. Sampled lossless rows whose draft features may
depend on their own earlier draws (REJECTION after s > 1 left-to-right denoising) are decided by
a per-row threshold instead: position ``j`` is verified iff ``w_r a_{r,j} ≥ λ``, with ``λ``
fixed before drafting, so that the decision at ``j`` reads only positions ``≤ j``
(non-anticipating). Suffix rows verify their copy with its exact rule (`with_suffix`).
"""

from __future__ import annotations

import torch

from kernels.rules import Rule
from policies.base import make_verify_decision, no_draft_decision, rows_per_pass
from policies.common import step_leniency
from policies.greedy import greedy_prefix
from policies.static import rules_from

from .objective import base_weights, weights
from .plan import StepDecision, flat, lam


def verify_drafts(p, rows, draft, ctx, step: StepDecision):
    """(the verify decision, λ for the next step or None) for the drafted ``draft`` of ``rows``
    under this step's ``step`` (its span and flatness, as `span_of` found them)."""
    B, K = draft.confidence.shape
    dev = draft.confidence.device
    rpp = rows_per_pass(draft.steps)
    max_s = len(rpp)
    if max_s == 0:  # no row drafted: every row emits its one target token
        return no_draft_decision(rows, dev), None
    span = min(K, step.span or K)  # the positions the drafter denoised (0 confidence past them)
    flat_now = step.flat  # as `span_of` found it where it was asked (then the engine computed no features)
    if flat_now is None:
        flat_now = flat(p, B, span, rpp)
    if flat_now:
        # verifying every drafted slot costs nearly nothing more (memory-bound, or a short span
        # on a CPU): verify them all, without evaluating the predictor
        k = torch.where(draft.steps > 0, span, 0).to(torch.int64)
        rule, param = rules_from(draft, step_leniency(ctx, k, draft, rows.temperature))
        return make_verify_decision(k, rule, param, rows), None
    pred = p._predictor_on(dev)
    w = weights(p, ctx).to(dev)
    base = base_weights(p, ctx).to(dev).sum()                                   # the tokens every row emits
    temp = rows.temperature.to(dev)
    drafted = draft.steps > 0
    eps = step_leniency(ctx, torch.full((B,), K, device=dev), draft, temp)       # [B] or None
    lossless = eps is None
    match = draft.exact_rule == int(Rule.MATCH)
    if lossless:
        eps = torch.zeros(B, device=dev)
    else:
        match = match & (eps == 0)
    a = pred.survival(draft.confidence, draft.entropy, draft.margin, temp, rows.recent_accept.to(dev),
                      draft.steps, match, eps) * drafted[:, None]                 # [B, K]
    values = w[:, None] * torch.cummin(a, dim=1).values                           # [B, K]
    # rows whose features may depend on their own earlier draws: a per-row threshold fixed before drafting
    draft_ms = p.cost.draft_ms_at(rpp)
    cost_fn = lambda tokens: p.cost.step_ms(tokens.cpu()).to(dev) + draft_ms  # noqa: E731
    if max_s > 1 and bool(ctx["left_to_right"].any()):
        sensitive = (temp > 0) & (eps == 0) & (draft.exact_rule == int(Rule.REJECTION)) & (draft.steps > 1)
        floor = lam(p, float(base), B).to(dev)
        k_sens = torch.where(sensitive, (values >= floor).sum(1), torch.zeros(B, dtype=torch.int64, device=dev))
        sens_gain = (values * (values >= floor) * sensitive[:, None]).sum()
        k_greedy, theta = greedy_prefix(values * (~sensitive)[:, None], base + sens_gain, B + k_sens.sum(),
                                        cost_fn, "argmax")
        k = torch.where(sensitive, k_sens, k_greedy).to(torch.int64)
    else:
        k, theta = greedy_prefix(values, base, B, cost_fn, "argmax")
    # λ for the next step: Θ_w at the optimum times the marginal ms of one more verified token
    tokens = float(B + k.sum())
    dms = (p.cost.step_ms_at(tokens + 8.0) - p.cost.step_ms_at(tokens)) / 8.0
    threshold = theta.cpu().float() * max(dms, 0.0)
    if not bool(torch.isfinite(threshold)):  # a non-finite λ would keep every later plan from drafting
        threshold = None
    rule, param = rules_from(draft, None if lossless else torch.where(k > 0, eps, torch.zeros_like(eps)))
    return make_verify_decision(k, rule, param, rows), threshold


def with_suffix(decision, rows, draft, suffix_k: torch.Tensor | None):
    """The verify decision with suffix rows' draft lengths ``suffix_k`` [B] (chosen in `source.take_suffix`) and exact rules."""
    from workers.draft_sources import SUFFIX_CODE

    if suffix_k is None or draft.source is None:
        return decision
    suffix = draft.source == SUFFIX_CODE
    if not bool(suffix.any()):
        return decision
    dev = decision.draft_len.device
    k = torch.where(suffix, suffix_k.to(dev), decision.draft_len)
    rule = torch.where(suffix, draft.exact_rule.to(decision.rule.dtype), decision.rule)
    zero = torch.zeros_like(decision.param)
    return make_verify_decision(k, rule, torch.where(suffix, zero, decision.param), rows,
                                torch.where(suffix, zero, decision.param2))
