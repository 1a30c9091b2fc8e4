"""`dspark`: DSpark's throughput-greedy prefix scheduler (exact rules, fixed diffusion steps).

Every row drafts with the same ``s``; after drafting, the calibrated survival of every slot is
ranked across the batch and slots are admitted while the batch rate Θ = expected tokens / step
time rises (`policies.greedy.greedy_prefix`, stopping at the first drop as DSpark does). Every
row gets its exact rule, ε requests included: this is the lossless state of the art we compare
against. With ``s = 1`` the draft features depend on no sampled token, so the batch-wide choice is
non-anticipating.
"""

from __future__ import annotations

import torch

from kernels.rules import Rule
from policies.base import Policy, make_verify_decision, rows_per_pass
from policies.greedy import greedy_prefix


class DSparkPolicy(Policy):
    name = "dspark"

    def __init__(self, steps: int = 1, stop: str = "first_drop", **kwargs):
        super().__init__(**kwargs)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps: must be an integer >= 1, got {steps!r}")
        if stop not in ("first_drop", "argmax"):
            raise ValueError(f"stop: expected 'first_drop' or 'argmax', got {stop!r}")
        self.steps, self.stop = steps, stop

    def _steps(self, rows, ctx):
        return torch.full((len(rows.request_ids),), self.steps, dtype=torch.int64)

    def _verify(self, rows, draft, ctx):
        B, K = draft.confidence.shape
        dev = draft.confidence.device
        pred = self._predictor_on(dev)
        a = pred.survival(draft.confidence, draft.entropy, draft.margin, rows.temperature.to(dev),
                          rows.recent_accept.to(dev), draft.steps, draft.exact_rule == int(Rule.MATCH))  # [B, K]
        a = a * (draft.steps > 0)[:, None]
        draft_ms = self.cost.draft_ms_at(rows_per_pass(draft.steps))
        k, _ = greedy_prefix(a, float(B), B, lambda tokens: self.cost.step_ms(tokens.cpu()).to(dev) + draft_ms, self.stop)
        return make_verify_decision(k, draft.exact_rule, torch.zeros(B, device=dev), rows)
