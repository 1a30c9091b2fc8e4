"""`explore`: a data-collection policy for traces that the replay evaluator can truncate.

Every row drafts the whole block (``k = K``) so that acceptance is logged for every position,
and the diffusion steps are drawn at random from ``steps_grid`` per row and step, so that the
traces cover every ``s`` a policy may choose. Rules: lossless rows get their exact rule; ε rows
get the ε-TVD rule with their ε (budget permitting) with probability ``lenient_share``, their
exact rule otherwise, so the traces cover both outcomes. Seeded: same seed, same choices.
"""

from __future__ import annotations

import torch

from policies.base import Policy
from policies.common import lenient_eps
from policies.static import rules_from
from policies.base import make_verify_decision


class ExplorePolicy(Policy):
    name = "explore"

    def __init__(self, steps_grid=(1, 2), lenient_share: float = 0.5, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.steps_grid = tuple(int(s) for s in steps_grid)
        if not self.steps_grid or min(self.steps_grid) < 1:
            raise ValueError(f"steps_grid: expected step counts >= 1, got {steps_grid!r}")
        if not 0.0 <= lenient_share <= 1.0:
            raise ValueError(f"lenient_share: must be in [0, 1], got {lenient_share!r}")
        self.lenient_share = float(lenient_share)
        self.gen = torch.Generator().manual_seed(int(seed))

    def _steps(self, rows, ctx):
        B = len(rows.request_ids)
        grid = torch.tensor(self.steps_grid)
        return grid[torch.randint(0, len(grid), (B,), generator=self.gen)]

    def _verify(self, rows, draft, ctx):
        B, K = draft.confidence.shape
        dev = draft.confidence.device
        k = torch.where(draft.steps > 0, K, 0).to(torch.int64)
        eps = lenient_eps(ctx["eps"], ctx["budget_left"], k, draft.steps, draft.conditional)
        coin = (torch.rand(B, generator=self.gen) < self.lenient_share).to(dev)
        eps = torch.where(coin & (rows.temperature.to(dev) > 0), eps, torch.zeros_like(eps))
        rule, param = rules_from(draft, eps)
        return make_verify_decision(k, rule, param, rows)
