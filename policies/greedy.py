"""The batch-wide prefix scheduler (DSpark's greedy, as tensor code).

Every draft slot ``(r, j)`` has a *value*: the expected number of emitted tokens it adds if it is
verified, i.e. its survival ``a_{r,j}`` (times the row's weight for the adaptive policy). Sort
all slots by value and admit them greedily while the batch rate

    Θ(n) = (base_gain + Σ_{top n} value) / step_ms(base_tokens + n)

rises; ``base_gain`` counts the one token every row emits anyway (the bonus / recovered token) and
``base_tokens`` the one target position each row always has. Because survival never increases
along a row, the admitted slots of a row form a prefix, so ``k_r`` is the count of its admitted
slots. No host sync: the stopping point is found with tensor ops.
"""

from __future__ import annotations

from typing import Callable

import torch


def greedy_prefix(values: torch.Tensor, base_gain: torch.Tensor | float, base_tokens: int,
                  cost_fn: Callable[[torch.Tensor], torch.Tensor], stop: str = "first_drop") -> tuple[torch.Tensor, torch.Tensor]:
    """values: [B, K] ≥ 0 (0 = slot not allowed), non-increasing along K.

    Returns (k [B] int64, Θ at the chosen point, a 0-dim tensor of tokens per ms).
    ``stop='first_drop'`` stops at the first slot that lowers Θ (DSpark); ``'argmax'`` takes the best.
    """
    B, K = values.shape
    device = values.device
    v = torch.cummin(values.float().clamp_min(0.0), dim=1).values.reshape(-1)        # [B*K]
    order = torch.argsort(v, descending=True, stable=True)                         # [B*K]
    gains = torch.cat([torch.zeros(1, device=device), v[order].cumsum(0)])         # [B*K + 1]
    n = torch.arange(B * K + 1, device=device)
    cost = torch.as_tensor(cost_fn(base_tokens + n), device=device).float()        # [B*K + 1]
    theta = (torch.as_tensor(base_gain, device=device, dtype=torch.float32) + gains) / cost.clamp_min(1e-6)
    if stop == "first_drop":
        drops = torch.cat([theta[1:] < theta[:-1], torch.ones(1, dtype=torch.bool, device=device)])
        n_star = torch.argmax(drops.to(torch.int8))                                 # first True
    elif stop == "argmax":
        n_star = torch.argmax(theta)
    else:
        raise ValueError(f"stop: expected 'first_drop' or 'argmax', got {stop!r}")
    rank = torch.empty_like(order)
    rank[order] = torch.arange(B * K, device=device)
    admitted = (rank < n_star) & (v > 0)                                           # [B*K]
    k = admitted.reshape(B, K).sum(1).to(torch.int64)
    return k, theta[n_star]
