"""Stand-ins used when a policy is built without a fitted predictor or a profiled cost model.

`ConfidenceSurvival` treats the draft's own top-1 probability as the conditional acceptance of a
position (what HF's `assistant_confidence_threshold` and EAGLE-2 assume) and, before drafting,
the row's recent acceptance. `LinearCost` prices a step linearly in tokens and drafter rows.
Both have the methods of `adapt.predictor.AcceptancePredictor` and `adapt.cost_model.CostModel`
that policies call, so a fitted policy file (`adapt policy fit`) replaces them one for one.
"""

from __future__ import annotations

import torch


class ConfidenceSurvival:
    """Survival ``a_j = Π_{i≤j} c_i`` with ``c = confidence`` (raised by ε under the ε-TVD rule)."""

    fitted = False

    @staticmethod
    def _lenient(c: torch.Tensor, eps: torch.Tensor | None) -> torch.Tensor:
        if eps is None:
            return c
        e = eps.float()
        while e.dim() < c.dim():
            e = e.unsqueeze(-1)
        return c + e * (1 - c)

    def survival(self, confidence, entropy, margin, temperature, recent_accept, steps, match, eps=None):
        c = confidence.float().clamp(0.0, 1.0)                                  # [B, K]
        return torch.cumprod(self._lenient(c, eps), dim=1)

    def prior_survival(self, steps, K, temperature, recent_accept, match, eps=None):
        B, S = recent_accept.shape[0], steps.shape[0]
        r = recent_accept.float()
        r = torch.where(r >= 0, r, torch.full_like(r, 0.5)).clamp(0.05, 0.95)  # < 0: nothing verified yet
        c = r[:, None, None].expand(B, S, K)                                    # [B, S, K]
        if eps is not None and eps.dim() == 1:
            eps = eps[:, None]
        return torch.cumprod(self._lenient(c, eps), dim=-1)


class LinearCost:
    """``step_ms = overhead + per_token · tokens + Σ_passes (per_pass + per_row · rows)``."""

    def __init__(self, overhead_ms: float = 4.0, per_token_ms: float = 0.05, per_pass_ms: float = 2.0,
                 per_row_ms: float = 0.1):
        self.overhead_ms, self.per_token_ms = overhead_ms, per_token_ms
        self.per_pass_ms, self.per_row_ms = per_pass_ms, per_row_ms

    def verify_ms(self, num_tokens):
        return self.overhead_ms + self.per_token_ms * torch.as_tensor(num_tokens, dtype=torch.float64)

    def draft_ms(self, rows_per_pass):
        r = torch.as_tensor(rows_per_pass, dtype=torch.float64)
        return torch.where(r > 0, self.per_pass_ms + self.per_row_ms * r, torch.zeros_like(r)).sum(-1)

    def step_ms(self, num_tokens, rows_per_pass=None):
        t = self.verify_ms(num_tokens)
        return t if rows_per_pass is None else t + self.draft_ms(rows_per_pass)

    def step_ms_at(self, num_tokens: float, rows_per_pass=None) -> float:
        return float(self.step_ms(float(num_tokens), None if rows_per_pass is None else torch.tensor(list(rows_per_pass))))

    def draft_ms_at(self, rows_per_pass) -> float:
        return float(self.draft_ms(torch.tensor(list(rows_per_pass), dtype=torch.float64)))

    def observe(self, num_tokens: float, rows_per_pass, step_ms: float) -> None:
        """A fixed price list: measured steps change nothing (`adapt.cost_model.CostModel` learns)."""
