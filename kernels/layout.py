"""The ragged layout of a verification batch, built once per step and shared by the engine
(gathering target logits and drafts) and `kernels.verify` (per-target-row rules and drafts).

Words (docs/contracts.md §2): request r owns k_r *draft tokens*, flat at `cu[r] .. cu[r + 1]`,
and k_r + 1 *target rows*, flat at `cu[r] + r .. cu[r + 1] + r`: one per draft position and the
last one the *bonus* position. R = N + B target rows for N drafts and B requests.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class RaggedLayout:
    cu: torch.Tensor         # [B + 1] int32 cumulative draft counts, cu[0] = 0
    row: torch.Tensor        # [R] int64 request of each target row
    col: torch.Tensor        # [R] int64 position of each target row in its request (k_r = bonus)
    draft_idx: torch.Tensor  # [R] int64 flat draft index of each target row, -1 at bonus rows
    draft_row: torch.Tensor  # [N] int64 request of each draft
    draft_col: torch.Tensor  # [N] int64 position of each draft in its request
    num_drafts: int          # N (host)

    @classmethod
    def from_counts(cls, num_draft: torch.Tensor, num_drafts: int) -> "RaggedLayout":
        """The layout of draft counts `num_draft` [B] (any integer dtype, on the batch's device);
        `num_drafts` = their sum, known on the host (no host sync)."""
        dev = num_draft.device
        k = num_draft.to(torch.int64)
        B = k.shape[0]
        cu = torch.zeros(B + 1, dtype=torch.int64, device=dev)
        cu[1:] = k.cumsum(0)
        ar = torch.arange(B, device=dev)
        row = torch.repeat_interleave(ar, k + 1, output_size=num_drafts + B)   # [R]
        col = torch.arange(num_drafts + B, device=dev) - (cu[:-1] + ar)[row]   # [R]
        draft_idx = torch.where(col < k[row], cu[:-1][row] + col, -1)          # [R]
        draft_row = torch.repeat_interleave(ar, k, output_size=num_drafts)     # [N]
        draft_col = torch.arange(num_drafts, device=dev) - cu[:-1][draft_row]  # [N]
        return cls(cu.to(torch.int32), row, col, draft_idx, draft_row, draft_col, num_drafts)

    @classmethod
    def from_host_counts(cls, counts: list[int], device) -> "RaggedLayout":
        """`from_counts` of draft counts the host knows (``counts``: B ints): the index arithmetic
        in numpy on the host, and one tensor moved to ``device`` whose rows are the layout's
        fields (views). The engine knows its draft lengths on the host after the plan's read: this
        costs one small copy where `from_counts` runs a dozen tensor operations (on a GPU, a dozen
        kernel launches)."""
        k = np.asarray(counts, dtype=np.int64)                                        # [B]
        B, N = k.shape[0], int(k.sum())
        starts = np.zeros(B + 1, dtype=np.int64)                                      # [B + 1] cu
        np.cumsum(k, out=starts[1:])
        ar = np.arange(B)
        row = np.repeat(ar, k + 1)                                                    # [R]
        col = np.arange(N + B) - (starts[:-1] + ar)[row]                              # [R]
        draft_idx = np.where(col < k[row], starts[:-1][row] + col, -1)                # [R]
        draft_row = np.repeat(ar, k)                                                  # [N]
        draft_col = np.arange(N) - starts[:-1][draft_row]                             # [N]
        flat = np.concatenate([starts, row, col, draft_idx, draft_row, draft_col])
        fields = torch.from_numpy(flat).to(device)
        R = N + B
        cu, row_t, col_t, idx_t, drow_t, dcol_t = fields.split([B + 1, R, R, R, N, N])
        return cls(cu.to(torch.int32), row_t, col_t, idx_t, drow_t, dcol_t, N)

    @classmethod
    def from_cu(cls, cu: torch.Tensor, num_drafts: int) -> "RaggedLayout":
        """The layout of cumulative draft counts `cu` [B + 1]."""
        cu = cu.to(torch.int64)
        return cls.from_counts(cu[1:] - cu[:-1], num_drafts)
