"""The ragged layout built from host counts (numpy, one tensor) against the tensor-built one."""

from __future__ import annotations

import random

import torch

from kernels.layout import RaggedLayout

FIELDS = ("cu", "row", "col", "draft_idx", "draft_row", "draft_col")


def test_layout_from_host_counts_equals_the_tensor_built_layout():
    """Every field equal in values and dtype, on edge counts (no drafts, one row, zeros between)
    and 200 random batches."""
    rng = random.Random(0)
    cases = [[0], [3], [0, 0, 0], [16], [0, 5, 0, 2], [1] * 9]
    cases += [[rng.choice([0, 0, 1, 2, 3, 8, 16]) for _ in range(rng.randint(1, 12))] for _ in range(200)]
    for counts in cases:
        ref = RaggedLayout.from_counts(torch.tensor(counts), sum(counts))
        host = RaggedLayout.from_host_counts(counts, torch.device("cpu"))
        assert host.num_drafts == ref.num_drafts == sum(counts)
        for name in FIELDS:
            a, b = getattr(ref, name), getattr(host, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (counts, name)
