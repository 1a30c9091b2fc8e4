"""`batch-schedule`: the draft length is looked up from the batch size (vLLM's
``num_speculative_tokens_per_batch_size``, TRT-LLM's ``draft_len_schedule``).

``schedule`` maps a batch size to ``k``; the entry with the largest key ≤ the batch size
applies. Values may be fractions of the drafter's block size (``0.5`` = K/2) or integers.
Steps and rules as in `static`.
"""

from __future__ import annotations

from policies.static import StaticPolicy

DEFAULT_SCHEDULE = {1: 1.0, 4: 0.75, 8: 0.5, 16: 0.375, 32: 0.25, 64: 0.125}


class BatchSchedulePolicy(StaticPolicy):
    name = "batch-schedule"

    def __init__(self, schedule: dict | None = None, steps: int = 1, rule: str = "auto", **kwargs):
        super().__init__(steps=steps, draft_len=16, rule=rule, **kwargs)
        raw = DEFAULT_SCHEDULE if schedule is None else schedule
        try:
            items = sorted((int(b), float(k)) for b, k in dict(raw).items())
        except (TypeError, ValueError):
            raise ValueError(f"schedule: expected a mapping batch_size -> draft_len, got {raw!r}") from None
        if not items or items[0][0] > 1 or any(k < 0 for _, k in items):
            raise ValueError("schedule: needs an entry for batch size 1 and non-negative draft lengths")
        self.schedule = items

    def _draft_len(self, rows) -> int:
        b = len(rows.request_ids)
        k = [k for size, k in self.schedule if size <= b][-1]
        if all(v <= 1.0 for _, v in self.schedule):  # fractions of the block size
            K = int(getattr(rows, "block_size", 0) or self.block_size)
            return 0 if k == 0 else max(1, round(k * K))
        return int(k)
