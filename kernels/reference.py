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

from kernels.rules import (RESIDUAL_ARGMAX, RESIDUAL_P, RESIDUAL_P_MINUS_Q, RESIDUAL_P_WITHOUT_X, RULES,
                           spec_of)


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

    for rid in sorted(RULES):
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
        spec = RULES[rid]
        if spec.residual == RESIDUAL_ARGMAX:
            us = None
        elif noise_rows is None:
            us = take(sample_u)                                          # [n]
        else:
            us = sample_u.index_select(0, take(noise_rows))              # [n]
        q = None
        if spec.needs_q:
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


def decide_accept(rid, p, q, x, px, qx, u, prm, prm2):
    """(accept [n] bool, tvd [n] or None, token [n] or None) of n target rows sharing rule `rid`:
    the rule's own formula (`kernels.rules.RuleSpec.accept`), given p [n, V], q [n, V] (None
    where the rule does not read q over the vocabulary), the drafted tokens x [n, 1], px = p(x)
    and qx = q(x) [n] (None where the rule reads no q) and the coins u [n]. No rule's accept reads
    the draw's uniform."""
    spec = spec_of(rid)
    return spec.accept(p, q if spec.reads_q_rows else None, x, px, qx if spec.needs_q else None, u, prm, prm2)


def emit_token(rid, p, q, us, x, draft, px):
    """[n] the token each of n target rows sharing rule `rid` emits if its row stops there: at a
    draft row the recovered token, a draw from the rule's residual (`RuleSpec.residual`; p where
    it has no mass); at a bonus row (`draft` False; q is 0 there) a draw from p. p [n, V], q
    [n, V] or None (residuals without q), us [n] the draws' uniforms (`inverse_cdf`), x [n, 1]
    drafted tokens, px = p(x) [n]."""
    residual = spec_of(rid).residual
    if residual == RESIDUAL_ARGMAX:
        return p.argmax(-1)
    if residual == RESIDUAL_P:
        return _sample_or_target(p, p, us)
    if residual == RESIDUAL_P_WITHOUT_X:  # a rejected draft is never emitted
        w = p.scatter(1, x, torch.where(draft, 0.0, px)[:, None])
        return _sample_or_target(w, p, us)
    if residual == RESIDUAL_P_MINUS_Q:
        return _sample_or_target(torch.sub(p, q).clamp_(min=0.0), p, us)
    raise ValueError(f"rule: unknown residual {residual!r}")
