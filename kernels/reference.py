"""Torch reference for the per-position part of verification (the CPU hot path of the engine).

Verification is split in two (see `kernels.verify`):

1. *Per position* (this module, and `kernels.triton_verify` which must agree with it): for
   every target row i (a draft position, or a row's bonus position) decide
   `accept[i]` (keep the drafted token), `token[i]` (what is emitted if the row stops here:
   the recovered token at a draft position, the bonus token at a bonus position) and
   `tvd[i]` (the TV distance between the distribution of the token emitted at this position
   and p; 0 for exact rules and bonus positions).
2. *Per row* (`kernels.verify._assemble`, shared by both backends): first rejection, padded
   output, TVD summed over the positions the row decided.

Sampling inverts the CDF at one uniform: a sample of a non-negative weight vector w (not
necessarily normalised) at u ~ U[0, 1) is the first v whose cumulative weight exceeds u · Σw,
the cumulative sums in float64 (`inverse_cdf` below). An entry with w = 0 is never drawn (adding
0 leaves the sum as it was); where a residual has no positive mass at all (possible only through
rounding), the target p is sampled instead. One uniform per draw, where the exponential race
(argmax w / E, E ~ Exp(1)) needed a vocabulary of noise: on CPU, drawing that noise and racing
cost ~0.4 ms a sampled row at V = 49,152 (9.8 against 2.3 ms for a 32-row plain step
with 16 sampled rows).

Every decision compares quantities computed elementwise in the same float32 order as the
Triton kernel; the vocabulary reductions (TV, entropy, ...) may differ in summation order, and
so may the float64 cumulative sums of a draw (the Triton kernel scans in blocks): two backends
then draw different tokens only where u · Σw falls within float64 rounding (~1e-16 relative) of
a cumulative sum.
"""

from __future__ import annotations

import torch

from kernels.rules import NEEDS_DRAFT_PROBS, Rule


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sample of each row of `weights` [R, V] (>= 0) at its uniform `u` [R] in [0, 1).

    Returns (token [R] int64, total [R] f64): the first v with cumsum(w)[v] > u · total, total
    = Σw (the last cumulative sum); total == 0 means the row had no mass (token V − 1 then).
    u < 1 keeps u · total below the total, so a token always exists where total > 0, and it
    has w > 0."""
    cdf = weights.to(torch.float64).cumsum(-1)                         # [R, V]
    total = cdf[:, -1]
    x = u.to(torch.float64) * total                                     # [R]
    token = torch.searchsorted(cdf, x[:, None], right=True).squeeze(1)
    return token.clamp_max(weights.shape[-1] - 1), total


def _sample_or_target(weights, p, u):
    """`inverse_cdf` over `weights`; rows without mass fall back to p."""
    token, total = inverse_cdf(weights, u)
    empty = total <= 0
    if bool(empty.any()):
        token[empty] = inverse_cdf(p[empty], u[empty])[0]
    return token


def positions_reference(
    tok: torch.Tensor,          # [R] int64   drafted token per target row (-1 at bonus rows)
    draft_idx: torch.Tensor,    # [R] int64   row of draft_probs / uniforms (-1 at bonus rows)
    rule: torch.Tensor,         # [R] int32   rule of the request owning the target row
    param: torch.Tensor,        # [R] f32
    param2: torch.Tensor,       # [R] f32
    uniforms: torch.Tensor,     # [N] f32
    target_probs: torch.Tensor, # [R, V] f32  (R = N + B)
    draft_probs,                # [N, V] f32 or None
    sample_u: torch.Tensor,     # [R] f32 U[0, 1), or [M] with noise_rows: each draw's uniform
    noise_rows=None,            # [R] int64 noise row of each target row, or None (row i reads row i)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-target-row decisions: (accept [R] bool, token [R] int64, tvd [R] f32).

    Rows are processed in groups of one rule (draft and bonus rows together); a group that is
    the whole batch reads p in place, without copies. In the rules' formulas a bonus row is a
    draft row with q = 0 and no draft: every residual is then p itself, so the draw returns the
    bonus sample, and its accept flag and TVD are masked out.
    """
    num_rows = target_probs.shape[0]
    accept, token, tvd, is_draft, u_all = per_row_outputs(draft_idx, uniforms, target_probs)

    for rid in Rule:
        in_group = rule == rid
        rows = in_group.nonzero().squeeze(-1)                            # [n] target rows
        if rows.numel() == 0:
            continue
        whole = rows.numel() == num_rows

        def take(t):
            return t if whole else t.index_select(0, rows)

        draft = take(is_draft)                                           # [n]
        x = take(tok).clamp_min(0)[:, None]                              # [n, 1]
        p = take(target_probs)                                           # [n, V]
        if rid == Rule.GREEDY:
            us = None
        elif noise_rows is None:
            us = take(sample_u)                                          # [n]
        else:
            us = sample_u.index_select(0, take(noise_rows))              # [n]
        q = None
        if rid in NEEDS_DRAFT_PROBS or (rid == Rule.TYPICAL and draft_probs is not None):
            q = torch.zeros_like(p)                                      # [n, V], 0 at bonus rows
            if draft_probs is not None:                                  # (None: rows without drafts)
                q[draft] = draft_probs if whole else draft_probs.index_select(0, take(draft_idx)[draft])
        a, y, d = _decide(rid, p, q, us, x, draft, take(u_all), take(param), take(param2))
        a = a & draft
        if whole:
            accept, token = a, y
            if d is not None:
                tvd = torch.where(draft, d, 0.0).to(torch.float32)
        else:
            accept[rows] = a
            token[rows] = y
            if d is not None:
                tvd[rows] = torch.where(draft, d, 0.0).to(torch.float32)
    return accept, token, tvd


def per_row_outputs(draft_idx, uniforms, target_probs):
    """Zeroed outputs per target row (accept [R] bool, token [R] int64, tvd [R] f32), which rows
    are draft rows (is_draft [R]) and each draft row's coin (u [R], 0 at bonus rows)."""
    R, device = target_probs.shape[0], target_probs.device
    is_draft = draft_idx >= 0
    u = torch.zeros(R, dtype=torch.float32, device=device)
    u[is_draft] = uniforms
    return (torch.zeros(R, dtype=torch.bool, device=device), torch.zeros(R, dtype=torch.int64, device=device),
            torch.zeros(R, dtype=torch.float32, device=device), is_draft, u)


def _decide(rid, p, q, us, x, draft, u, prm, prm2):
    """(accept [n], token [n], tvd [n] or None) for n target rows sharing rule `rid`: the rule's
    accept decision and TVD (`decide_accept`) and the token each row emits if it stops there
    (`emit_token`), at every row."""
    px = p.gather(1, x).squeeze(1)                                       # [n]
    qx = None if q is None else q.gather(1, x).squeeze(1)                # [n]
    acc, d, y = decide_accept(rid, p, q, x, px, qx, u, prm, prm2)
    if y is None:
        y = emit_token(rid, p, q, us, x, draft, px)
    return acc, y, d


# rules whose accept decision or TVD reads q over the whole vocabulary (REJECTION reads only q(x))
READS_Q_ROWS = frozenset({Rule.EPS_TVD, Rule.LAMBDA, Rule.SGLANG, Rule.TYPICAL})


def decide_accept(rid, p, q, x, px, qx, u, prm, prm2):
    """(accept [n] bool, tvd [n] or None, token [n] or None) of n target rows sharing rule `rid`,
    from p [n, V], the drafted tokens x [n, 1], px = p(x) and qx = q(x) [n] (None where the rule
    reads no q), q [n, V] (needed only by `READS_Q_ROWS`; None for TYPICAL means no q) and the
    coins u [n]. The token is given
    only where the accept decision computes it anyway (GREEDY: argmax p); otherwise
    `emit_token` gives it. No rule's accept reads the draw's uniform."""
    if rid == Rule.GREEDY:
        y = p.argmax(-1)
        return y == x.squeeze(1), None, y
    if rid == Rule.MATCH:  # a sample of p equals x with probability p(x): one coin decides it
        return u < px, None, None
    if rid == Rule.TYPICAL:
        plogp = torch.where(p > 0, p * torch.log(p), torch.zeros((), device=p.device))
        entropy = -plogp.sum(-1)                                         # [n]
        thr = torch.minimum(prm, prm2 * torch.exp(-entropy))
        acc = px > thr
        if q is None:                                                    # TVD given the drafted token
            d = torch.where(acc, 1.0 - px, torch.zeros_like(px))
        else:
            qa = torch.where(p > thr[:, None], q, torch.zeros((), device=p.device))
            mass = qa.sum(-1, keepdim=True)                              # [n, 1] accepted mass
            d = 0.5 * (qa - mass * p).abs().sum(-1)
        return acc, d, None
    if rid == Rule.REJECTION:
        return u * qx < px, None, None                                   # P = min(1, p/q) for u ~ U[0, 1)
    if rid == Rule.EPS_TVD:
        tv = torch.sub(p, q).clamp_(min=0.0).sum(-1)                     # [n] TV(p, q) = sum (p - q)+
        ratio = torch.where(tv > prm, prm / tv, torch.ones_like(tv))     # share of the gap closed
        acc = ((px >= qx) & (px > 0)) | (tv <= prm) | (u * qx < px + ratio * (qx - px))
        return acc, torch.minimum(prm, tv), None
    if rid == Rule.LAMBDA:
        lam = prm
        acc = u * (lam * qx) < px
        accepted_mass = torch.where(p >= lam[:, None] * q, q, p / lam[:, None])   # q * min(1, p/(lam q))
        return acc, (accepted_mass - p).clamp_min(0.0).sum(-1), None
    if rid == Rule.SGLANG:
        t_acc, t_single = prm, prm2
        acc = (px >= t_single) | (u * t_acc < px)
        # Output law: q(v) a(v) + p(v) (C - c(v)), c(v) = q(v) (1 - a(v)) / (1 - p(v)), C = sum c.
        one = torch.ones((), device=p.device)
        a_v = torch.where(p >= t_single[:, None], one, torch.minimum(one, p / t_acc[:, None]))
        c_v = torch.where(a_v < 1, q * (1 - a_v) / (1 - p), torch.zeros((), device=p.device))
        c_sum = c_v.sum(-1, keepdim=True)
        return acc, 0.5 * (q * a_v + p * (c_sum - c_v) - p).abs().sum(-1), None
    raise ValueError(f"rule: unknown rule id {int(rid)}")


def emit_token(rid, p, q, us, x, draft, px):
    """[n] the token each of n target rows sharing rule `rid` emits if its row stops there: at a
    draft row the recovered token, a draw from the rule's residual (p where it has no mass); at a
    bonus row (`draft` False; q is 0 there) a draw from p. p [n, V], q [n, V] or None (rules
    without a residual of q), us [n] the draws' uniforms (`inverse_cdf`), x [n, 1] drafted
    tokens, px = p(x) [n]."""
    if rid == Rule.GREEDY:
        return p.argmax(-1)
    if rid == Rule.TYPICAL:
        return _sample_or_target(p, p, us)
    if rid in (Rule.MATCH, Rule.SGLANG):  # p without the draft (a rejected draft is never emitted)
        w = p.scatter(1, x, torch.where(draft, 0.0, px)[:, None])
        return _sample_or_target(w, p, us)
    if rid in (Rule.REJECTION, Rule.EPS_TVD, Rule.LAMBDA):
        return _sample_or_target(torch.sub(p, q).clamp_(min=0.0), p, us)
    raise ValueError(f"rule: unknown rule id {int(rid)}")
