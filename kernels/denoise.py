"""`select_commit`: which still-masked block positions one denoising step of the drafter commits.

A block-diffusion drafter starts from a block of MASK tokens and, at each denoising step,
*commits* (fixes) some masked positions to the tokens it predicted there. Per row:
- confidence order (`left_to_right = False`): the `num_commit` masked positions with the
  highest confidence (ties: lower position first);
- left-to-right order (`left_to_right = True`): the `num_commit` leftmost masked positions.
If a row has fewer masked positions than `num_commit`, all of them are committed; committed
positions are never re-committed (the output is a subset of `masked`).

The rank of a masked position is the number of masked positions that beat it, from a [K, K]
comparison per row (K <= 16): no sort, and the Triton kernel computes the same comparisons.
"""

from __future__ import annotations

import torch

from kernels.verify import use_triton


def select_commit(
    confidence: torch.Tensor,     # [B, K] f32, drafter confidence per position (e.g. max prob)
    masked: torch.Tensor,         # [B, K] bool, still masked
    num_commit: torch.Tensor,     # [B] int32, positions to commit this step
    left_to_right: torch.Tensor,  # [B] bool
    *,
    backend: str = "auto",
) -> torch.Tensor:               # [B, K] bool, positions committed by this step
    """Choose the positions a denoising step commits; see the module docstring."""
    _check(confidence, masked, num_commit, left_to_right)
    if backend == "auto":
        backend = "triton" if use_triton(confidence.device) else "torch"
    if backend == "triton":
        from kernels.triton_denoise import select_commit_triton
        return select_commit_triton(confidence, masked, num_commit, left_to_right)
    if backend == "torch":
        return select_commit_reference(confidence, masked, num_commit, left_to_right)
    raise ValueError(f"backend: expected 'auto', 'triton' or 'torch', got {backend!r}")


def select_commit_reference(confidence, masked, num_commit, left_to_right) -> torch.Tensor:
    """Torch reference of `select_commit` (vectorised; [B, K, K] comparisons)."""
    k = confidence.shape[1]
    pos = torch.arange(k, device=confidence.device, dtype=torch.float32)
    score = torch.where(left_to_right[:, None], -pos[None, :], confidence.to(torch.float32))  # [B, K]
    si, sj = score[:, :, None], score[:, None, :]                                            # i: me, j: other
    earlier = pos[None, None, :] < pos[None, :, None]                                         # j < i
    beats = masked[:, None, :] & ((sj > si) | ((sj == si) & earlier))                        # [B, K, K]
    rank = beats.to(torch.int32).sum(dim=2)                                                   # [B, K]
    return masked & (rank < num_commit.to(torch.int32)[:, None])


def _check(confidence, masked, num_commit, left_to_right):
    if confidence.dim() != 2 or not confidence.dtype.is_floating_point:
        raise ValueError(f"confidence: expected a float tensor [B, K], got {tuple(confidence.shape)} {confidence.dtype}")
    b, k = confidence.shape
    if tuple(masked.shape) != (b, k) or masked.dtype != torch.bool:
        raise ValueError(f"masked: expected bool [{b}, {k}], got {tuple(masked.shape)} {masked.dtype}")
    if tuple(num_commit.shape) != (b,) or num_commit.dtype.is_floating_point:
        raise ValueError(f"num_commit: expected an integer tensor [{b}], got {tuple(num_commit.shape)} {num_commit.dtype}")
    if tuple(left_to_right.shape) != (b,) or left_to_right.dtype != torch.bool:
        raise ValueError(f"left_to_right: expected bool [{b}], got {tuple(left_to_right.shape)} {left_to_right.dtype}")
    for name, t in (("masked", masked), ("num_commit", num_commit), ("left_to_right", left_to_right)):
        if t.device != confidence.device:
            raise ValueError(f"{name}: on {t.device}, expected {confidence.device} (confidence's device)")
