"""`static`: fixed diffusion steps ``s``, draft length ``k`` and rule for every row, every step.

The baseline every engine ships: one setting for all loads. ``rule='auto'`` gives lossless rows
their exact rule and ``tvd=E`` rows the ε-TVD rule with their own ε (capped by the total budget
left); ``rule='exact'`` never uses leniency.
"""

from __future__ import annotations

import torch

from policies.base import Policy, make_verify_decision
from policies.common import step_leniency


class StaticPolicy(Policy):
    name = "static"

    def __init__(self, steps: int = 1, draft_len: int = 16, rule: str = "auto", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps: must be an integer >= 0, got {steps!r}")
        if not isinstance(draft_len, int) or draft_len < 0:
            raise ValueError(f"draft_len: must be an integer >= 0, got {draft_len!r}")
        if rule not in ("auto", "exact"):
            raise ValueError(f"rule: expected 'auto' or 'exact', got {rule!r}")
        self.steps, self.draft_len, self.rule = steps, draft_len, rule

    def _draft_len(self, rows) -> int:
        return self.draft_len

    def _steps(self, rows, ctx):
        s = self.steps if self._draft_len(rows) > 0 else 0
        return torch.full((len(rows.request_ids),), s, dtype=torch.int64)

    def _span(self, rows, steps):
        return self._draft_len(rows)

    def _verify(self, rows, draft, ctx):
        K = draft.confidence.shape[1]
        k = torch.where(draft.steps > 0, min(self._draft_len(rows), K), 0).to(torch.int64)   # [B]
        return verify_with_rules(rows, draft, ctx, k, lenient=self.rule == "auto")


def verify_with_rules(rows, draft, ctx, k: torch.Tensor, lenient: bool):
    """The decision for draft lengths ``k`` [B]: exact rules, or ε-TVD where a row allows it."""
    eps = step_leniency(ctx, k, draft, rows.temperature) if lenient else None
    rule, param = rules_from(draft, eps)
    return make_verify_decision(k, rule, param, rows)


def rules_from(draft, eps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rule, param): the lenient rule (`kernels.rules.LENIENT_RULE`, ε-TVD) with ε where ε > 0,
    else the engine's exact rule for the row (every row's, where ``eps`` is None)."""
    from kernels.rules import LENIENT_RULE

    if eps is None:
        return draft.exact_rule.to(torch.int32), torch.zeros(draft.exact_rule.shape, device=draft.exact_rule.device)
    lenient = eps > 0
    rule = torch.where(lenient, torch.full_like(draft.exact_rule, int(LENIENT_RULE)), draft.exact_rule)
    return rule.to(torch.int32), torch.where(lenient, eps, torch.zeros_like(eps)).float()
