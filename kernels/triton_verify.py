"""Triton kernel for the per-position part of verification (mirror of `kernels.reference`).

One program per target row (a draft position or a bonus position); it streams its row of p
(and q) over the vocabulary in blocks of BLOCK, computing the same decisions, draws and TVD as
`positions_reference`. Elementwise arithmetic follows the reference's float32 order (IEEE
division via `div_rn`, no FMA contraction on CUDA), so accept flags agree exactly; vocabulary
sums (TV, entropy, ...) may differ in the last bits because the summation order differs, and so
may a draw's float64 cumulative sums (scanned here in blocks): tokens then differ only where
the draw's point falls within float64 rounding of a cumulative sum (see `kernels.reference`).
A draw takes two sweeps: the weights' total mass, then the scan to the first entry whose
cumulative weight exceeds u · total.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rules import Rule

# Rule ids as kernel constants, from the rule table (kernels.rules.Rule)
GREEDY = tl.constexpr(int(Rule.GREEDY))
REJECTION = tl.constexpr(int(Rule.REJECTION))
MATCH = tl.constexpr(int(Rule.MATCH))
EPS_TVD = tl.constexpr(int(Rule.EPS_TVD))

# The rules this kernel has code for (its branches below); `kernels.verify` sends a batch with
# any other rule of the table to the torch backends.
TRITON_RULES = frozenset({int(Rule.GREEDY), int(Rule.REJECTION), int(Rule.MATCH), int(Rule.EPS_TVD)})

# Draw weights (MODE: the residual forms of kernels.rules) and the auxiliary vocabulary sum (AUX)
# computed in the same pass.
W_P, W_RESIDUAL, W_P_NOT_X = 1, 2, 3
AUX_NONE, AUX_TV = 0, 1


@triton.jit
def _weights(p, q_row, offs, m, x, MODE: tl.constexpr):
    """A block of draw weights: p (MODE 1), (p - q)+ (2) or p without x (3)."""
    if MODE == 1:
        w = p
    elif MODE == 2:
        q = tl.load(q_row + offs, mask=m, other=0.0)
        w = tl.maximum(p - q, 0.0)
    else:
        w = tl.where(offs == x, 0.0, p)
    return w


@triton.jit
def _argmax(p_row, V, BLOCK: tl.constexpr):
    """The first index of the maximum of p."""
    best = tl.full((), -1.0, tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        s = tl.where(m, tl.load(p_row + offs, mask=m, other=0.0), -1.0)
        block_best = tl.max(s, 0)
        block_i = tl.argmax(s, 0, tie_break_left=True)
        better = block_best > best
        best_i = tl.where(better, start + block_i, best_i)
        best = tl.where(better, block_best, best)
    return best_i


@triton.jit
def _mass(p_row, q_row, V, x, s1, s2, MODE: tl.constexpr, AUX: tl.constexpr, BLOCK: tl.constexpr):
    """One sweep over the vocabulary: the draw weights' total (float64) and the sum AUX
    (s1, s2: rule parameters for sums that read them)."""
    total = tl.zeros((BLOCK,), tl.float64)
    aux = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        p = tl.load(p_row + offs, mask=m, other=0.0)
        total += _weights(p, q_row, offs, m, x, MODE).to(tl.float64)
        if AUX == 1:        # TV(p, q) = sum (p - q)+
            q = tl.load(q_row + offs, mask=m, other=0.0)
            aux += tl.maximum(p - q, 0.0)
    return tl.sum(total, 0), tl.sum(aux, 0)


@triton.jit
def _search(p_row, q_row, V, x, point, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """The first index whose cumulative weight (float64) exceeds `point`, among entries of
    positive weight (V - 1 if none: only where the weights have no mass)."""
    carry = tl.zeros((), tl.float64)
    found = tl.full((), V, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        p = tl.load(p_row + offs, mask=m, other=0.0)
        w = _weights(p, q_row, offs, m, x, MODE)
        w64 = w.to(tl.float64)
        c = carry + tl.cumsum(w64, 0)
        hit = m & (w > 0) & (c > point)
        found = tl.minimum(found, tl.min(tl.where(hit, offs, V), 0))
        carry += tl.sum(w64, 0)
    return tl.minimum(found, V - 1)


@triton.jit
def _draw(p_row, q_row, V, x, us, total, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Inverse-CDF draw at uniform `us` from weights MODE of total mass `total` (from `_mass`);
    a draw from p where those weights have no mass."""
    if total > 0:
        y = _search(p_row, q_row, V, x, us.to(tl.float64) * total, MODE, BLOCK)
    else:
        p_total, _a = _mass(p_row, q_row, V, x, 1.0, 1.0, 1, 0, BLOCK)
        y = _search(p_row, q_row, V, x, us.to(tl.float64) * p_total, 1, BLOCK)
    return y


@triton.jit
def _verify_positions_kernel(
    tok_ptr,        # [R] int64, drafted token (-1 at bonus rows)
    draft_idx_ptr,  # [R] int64, draft position (-1 at bonus rows)
    rule_ptr,       # [R] int32
    param_ptr,      # [R] f32
    param2_ptr,     # [R] f32
    u_ptr,          # [N] f32
    p_ptr,          # [R, V] f32
    q_ptr,          # [N, V] f32 (p_ptr when HAS_Q is False; never read then)
    s_ptr,          # [M] f32 draw uniforms (noise rows)
    noise_row_ptr,  # [R] int64 noise row of each target row
    accept_ptr,     # [R] int8 out
    token_ptr,      # [R] int64 out
    tvd_ptr,        # [R] f32 out
    V,
    HAS_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    t = tl.load(draft_idx_ptr + i)
    rule = tl.load(rule_ptr + i)
    p_row = p_ptr + i * V
    us = tl.load(s_ptr + tl.load(noise_row_ptr + i))
    q_row = q_ptr + tl.maximum(t, 0) * V
    x = tl.load(tok_ptr + i)
    prm = tl.load(param_ptr + i)
    prm2 = tl.load(param2_ptr + i)
    if t < 0:                                   # bonus position
        if rule == GREEDY:
            y = _argmax(p_row, V, BLOCK)
        else:
            total, _a = _mass(p_row, q_row, V, x, 1.0, 1.0, 1, 0, BLOCK)
            y = _draw(p_row, q_row, V, x, us, total, 1, BLOCK)
        tl.store(token_ptr + i, y.to(tl.int64))
        tl.store(accept_ptr + i, tl.zeros((), tl.int8))
        tl.store(tvd_ptr + i, 0.0)
    else:
        px = tl.load(p_row + x)
        u = tl.load(u_ptr + t)
        y = tl.zeros((), tl.int32)
        acc = px != px
        d = tl.zeros((), tl.float32)
        if rule == GREEDY:
            y = _argmax(p_row, V, BLOCK)
            acc = y.to(tl.int64) == x
        elif rule == MATCH:                     # a sample of p is x with probability p(x): a coin
            acc = u < px
            total, _a = _mass(p_row, q_row, V, x, 1.0, 1.0, 3, 0, BLOCK)
            y = _draw(p_row, q_row, V, x, us, total, 3, BLOCK)
        else:                                   # rules reading q(x)
            qx = tl.load(q_row + x)
            if rule == REJECTION:
                acc = u * qx < px
                total, _a = _mass(p_row, q_row, V, x, 1.0, 1.0, 2, 0, BLOCK)
                y = _draw(p_row, q_row, V, x, us, total, 2, BLOCK)
            else:                               # EPS_TVD
                total, tv = _mass(p_row, q_row, V, x, 1.0, 1.0, 2, 1, BLOCK)
                y = _draw(p_row, q_row, V, x, us, total, 2, BLOCK)
                ratio = tl.where(tv > prm, tl.math.div_rn(prm, tl.where(tv > prm, tv, 1.0)), 1.0)
                acc = ((px >= qx) & (px > 0)) | (tv <= prm) | (u * qx < px + ratio * (qx - px))
                d = tl.minimum(prm, tv)
        tl.store(token_ptr + i, y.to(tl.int64))
        tl.store(accept_ptr + i, acc.to(tl.int8))
        tl.store(tvd_ptr + i, d)


def _block_size(vocab: int, device: torch.device) -> int:
    if device.type == "cuda":
        return min(2048, triton.next_power_of_2(vocab))
    return min(16384, triton.next_power_of_2(vocab))    # interpreter: fewer, larger blocks


def positions_triton(tok, draft_idx, rule, param, param2, uniforms, target_probs, draft_probs,
                     sample_u, noise_rows=None, *, block: int | None = None):
    """Triton twin of `kernels.reference.positions_reference` (same arguments and outputs).

    `block` overrides the vocabulary block size (a power of two; tests use small blocks to
    exercise the multi-block path in the interpreter).
    """
    num_rows, vocab = target_probs.shape
    device = target_probs.device
    accept = torch.empty(num_rows, dtype=torch.int8, device=device)
    token = torch.empty(num_rows, dtype=torch.int64, device=device)
    tvd = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return accept.bool(), token, tvd
    has_q = draft_probs is not None
    if noise_rows is None:  # target row i reads noise row i
        noise_rows = torch.arange(num_rows, device=device)
    extra = {"num_warps": 8, "enable_fp_fusion": False} if device.type == "cuda" else {}
    _verify_positions_kernel[(num_rows,)](
        tok.contiguous(), draft_idx.contiguous(), rule.contiguous(), param.contiguous(),
        param2.contiguous(), uniforms.contiguous(), target_probs,
        draft_probs if has_q else target_probs, sample_u, noise_rows.contiguous(), accept, token, tvd, vocab,
        HAS_Q=has_q, BLOCK=block or _block_size(vocab, device), **extra)
    return accept.bool(), token, tvd
