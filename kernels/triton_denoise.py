"""Triton kernel for `select_commit` (mirror of `kernels.denoise.select_commit_reference`).

One program per row: the [K, K] "who beats whom" comparison of the reference, then a rank
threshold. K <= 16 in practice, so the whole row lives in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select_commit_kernel(
    conf_ptr,       # [B, K] f32
    masked_ptr,     # [B, K] int8
    num_ptr,        # [B] int32
    l2r_ptr,        # [B] int8
    out_ptr,        # [B, K] int8 out
    K,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    valid = offs < K
    conf = tl.load(conf_ptr + row * K + offs, mask=valid, other=0.0)
    masked = tl.load(masked_ptr + row * K + offs, mask=valid, other=0) != 0
    num = tl.load(num_ptr + row)
    l2r = tl.load(l2r_ptr + row) != 0
    pos = offs.to(tl.float32)
    score = tl.where(l2r, -pos, conf)                                 # [BLOCK_K]
    s_me = score[:, None]                                             # i: me
    s_other = score[None, :]                                          # j: other
    earlier = offs[None, :] < offs[:, None]
    beats = masked[None, :] & ((s_other > s_me) | ((s_other == s_me) & earlier))
    rank = tl.sum(beats.to(tl.int32), 1)                              # [BLOCK_K]
    commit = masked & (rank < num)
    tl.store(out_ptr + row * K + offs, commit.to(tl.int8), mask=valid)


def select_commit_triton(confidence, masked, num_commit, left_to_right) -> torch.Tensor:
    """Triton twin of `select_commit_reference` (same arguments, [B, K] bool out)."""
    b, k = confidence.shape
    out = torch.zeros((b, k), dtype=torch.int8, device=confidence.device)
    if b == 0 or k == 0:
        return out.bool()
    _select_commit_kernel[(b,)](
        confidence.to(torch.float32).contiguous(), masked.to(torch.int8).contiguous(),
        num_commit.to(torch.int32).contiguous(), left_to_right.to(torch.int8).contiguous(), out, k,
        BLOCK_K=max(2, triton.next_power_of_2(k)))
    return out.bool()
