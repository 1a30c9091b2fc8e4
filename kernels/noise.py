"""Per-request noise for `kernels.verify`, drawn outside the kernels.

Each request owns a `torch.Generator` (seeded from its sampling seed), so its coins and draws do
not depend on which other requests share the batch: a seeded request gives the same tokens alone
or batched, on either backend.

*Noise rows*: the uniforms at which emitted tokens are drawn (`sample_u`, inverse CDF:
`kernels.reference.inverse_cdf`). No rule's accept decision reads them (`kernels.rules`): a draw
makes only the token emitted where the row stops, so one noise row per request serves all its
positions, and a GREEDY row reads none (its uniform is 0). `verify`'s `noise_rows` maps each
target row to its noise row. Without rules (`rules=None`) every target row gets its own.
"""

from __future__ import annotations

import dataclasses

import torch

from kernels.layout import RaggedLayout
from kernels.rules import Rule


@dataclasses.dataclass(frozen=True)
class Noise:
    uniforms: torch.Tensor          # [N] f32 in [0, 1): one coin per draft
    sample_u: torch.Tensor          # [M] f32 in [0, 1): one uniform per noise row (the emitted token's draw)
    noise_rows: torch.Tensor | None  # [N + B] int64 noise row of each target row; None: row i reads row i (M = N + B)


def noise_counts(num_draft: list[int], rules: list[int] | None) -> list[int]:
    """Noise rows per request: 1 with `rules` (one draw where the row stops; a GREEDY row's
    uniform is 0), k_r + 1 (one per target row) when `rules` is None."""
    if rules is None:
        return [k + 1 for k in num_draft]
    return [1] * len(num_draft)


def draw_noise(
    generators: list,          # B torch.Generator (on `device`) or None (global RNG)
    num_draft: list[int],      # B draft counts k_r
    device: torch.device | str = "cpu",
    rules: list[int] | None = None,  # B rule ids (host); None: one noise row per target row
    layout: RaggedLayout | None = None,  # the batch's layout, if built already
) -> Noise:
    """Coins and draw uniforms in `verify`'s layout (see the module docstring for noise rows).

    Row r consumes, from its generator, k_r uniforms (its coins) and then one uniform per noise
    row; a GREEDY row (with `rules`) consumes nothing. One small loop over requests (not
    tokens); the draws themselves are tensor calls.
    """
    if len(generators) != len(num_draft):
        raise ValueError(f"generators: expected {len(num_draft)} (one per row), got {len(generators)}")
    if any(k < 0 for k in num_draft):
        raise ValueError("num_draft: counts must be >= 0")
    if rules is not None and len(rules) != len(num_draft):
        raise ValueError(f"rules: expected {len(num_draft)} (one per row), got {len(rules)}")
    device = torch.device(device)
    counts = noise_counts(num_draft, rules)
    greedy = [False] * len(num_draft) if rules is None else [r == Rule.GREEDY for r in rules]
    uniforms = torch.zeros(sum(num_draft), dtype=torch.float32, device=device)
    sample_u = torch.zeros(sum(counts), dtype=torch.float32, device=device)
    start = off = 0
    for gen, k, c, g in zip(generators, num_draft, counts, greedy):
        if not g:
            uniforms[start:start + k].uniform_(0.0, 1.0, generator=gen)
            sample_u[off:off + c].uniform_(0.0, 1.0, generator=gen)
        start += k
        off += c
    rows = None
    if rules is not None and sum(counts) != sum(num_draft) + len(num_draft):
        if layout is None:
            layout = RaggedLayout.from_counts(torch.tensor(num_draft, device=device), sum(num_draft))
        rows = noise_rows(layout, torch.tensor(counts, device=device))
    return Noise(uniforms, sample_u, rows)


def noise_rows(layout: RaggedLayout, counts: torch.Tensor) -> torch.Tensor:
    """[N + B] int64 noise row of each target row of `layout`, for per-request noise counts
    `counts` [B] (each k_r + 1 or 1): a request with one noise row maps all its target rows to it."""
    counts = counts.to(torch.int64)
    first = torch.cumsum(counts, 0) - counts                                # [B] first noise row
    return first[layout.row] + torch.where(counts[layout.row] > 1, layout.col, 0)
