"""Per-request noise for `kernels.verify`, drawn outside the kernels.

Each request owns a `torch.Generator` (seeded from its sampling seed), so its coins and race
noise do not depend on which other requests share the batch: a seeded request gives the same
tokens alone or batched, on either backend.
"""

from __future__ import annotations

import torch


def draw_noise(
    generators: list,          # B torch.Generator (on `device`) or None (global RNG)
    num_draft: list[int],      # B draft counts k_r
    vocab: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [N] f32 in [0, 1), exp_noise [N + B, V] f32 Exp(1)) in `verify`'s layout.

    Row r consumes, from its generator, k_r uniforms and then (k_r + 1) x V exponentials.
    One small loop over requests (not tokens); the draws themselves are tensor calls.
    """
    if len(generators) != len(num_draft):
        raise ValueError(f"generators: expected {len(num_draft)} (one per row), got {len(generators)}")
    if any(k < 0 for k in num_draft):
        raise ValueError("num_draft: counts must be >= 0")
    device = torch.device(device)
    total = sum(num_draft)
    uniforms = torch.empty(total, dtype=torch.float32, device=device)
    exp_noise = torch.empty(total + len(num_draft), vocab, dtype=torch.float32, device=device)
    start = 0
    for r, (gen, k) in enumerate(zip(generators, num_draft)):
        uniforms[start:start + k].uniform_(0.0, 1.0, generator=gen)
        exp_noise[start + r:start + r + k + 1].exponential_(1.0, generator=gen)
        start += k
    return uniforms, exp_noise
