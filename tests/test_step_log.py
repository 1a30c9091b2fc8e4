"""`python -m adapt.bench.instruments.step_log`'s summary: tokens per ms of plain and drafting steps by batch size."""

from __future__ import annotations

from adapt.bench.instruments import step_log


def test_summary_splits_plain_and_drafting_steps_by_batch_size():
    steps = [{"B": 32, "ms": 90.0, "positions": 32, "accepted": 0, "verified": 0},
             {"B": 32, "ms": 90.0, "positions": 32, "accepted": 0, "verified": 0},
             {"B": 32, "ms": 218.0, "positions": 121, "accepted": 13, "verified": 89},
             {"B": 2, "ms": 20.0, "positions": 6, "accepted": 2, "verified": 4},
             {"B": 2}]  # a decision whose outcome was not seen (the run ended)
    lines = step_log.summary(steps)
    assert len(lines) == 3
    assert lines[0].startswith("rows 1-7 drafting:") and "0.200 tokens/ms" in lines[0]
    assert lines[1].startswith("rows 28-999 plain") and "2 steps" in lines[1] and "0.356 tokens/ms" in lines[1]
    assert lines[2].startswith("rows 28-999 drafting") and "0.206 tokens/ms" in lines[2]
