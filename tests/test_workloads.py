"""Benchmark workloads (adapt/bench/workloads.py): sizes, labels, and edit prompts that carry the
text their answers copy. (The held-out / train file split itself is workers/training/corpus.py's.)"""

from __future__ import annotations

import pytest

from adapt.bench.workloads import WORKLOADS, make_workload


def test_the_mixed_workload_gives_count_chat_prompts_of_every_kind_in_turn():
    prompts = make_workload("mixed", 7, seed=3)
    assert len(prompts) == 7 and WORKLOADS[-1] == "mixed"
    for p in prompts:
        assert p["messages"][0]["role"] == "user" and p["messages"][0]["content"].strip()
    assert [p["workload"] for p in prompts] == ["chat", "code", "edit"] * 2 + ["chat"]


def test_edit_prompts_hold_a_whole_function_and_code_prompts_half_of_one():
    edit = make_workload("edit", 4, seed=3)[0]["messages"][0]["content"]
    assert "```python\ndef " in edit and "Reply with the complete updated function only." in edit
    code = make_workload("code", 4, seed=3)[0]["messages"][0]["content"]
    assert code.startswith("Complete this Python function")


def test_unknown_workload_is_named():
    with pytest.raises(ValueError, match="workload"):
        make_workload("poetry", 3)
