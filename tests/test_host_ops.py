"""`python -m adapt.bench.instruments.host_ops`: torch operations per decode step, by phase and line, on the demo pair."""

from __future__ import annotations

import json

from adapt.bench.instruments import host_ops


def test_host_ops_counts_each_phase_of_a_step_and_repeats_exactly(tmp_path):
    """A run counts operations in the decision maker's calls, verification and drafting, names
    lines of our code, and (a clock that ticks per reading, the policy file's costs) counts the
    same again on a second run: two versions of the code can be compared step for step."""
    outs = []
    for i in range(2):
        out = tmp_path / f"ops{i}.json"
        assert host_ops.main(["--pair", "demo", "--compile", "off", "--load", "2", "--requests", "4",
                            "--lines", "10", "--out", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
    first, second = outs
    assert first["decode_steps"] > 4 and first["host_ops_per_step"] > 0
    phases = first["ops_per_step"]
    assert {"decide.before_draft", "decide.observe", "target_forward", "row_state"} <= set(phases)
    assert "prefill" not in phases and "instrument" not in phases  # left out of the per-step counts
    assert first["top_lines"] and all(" " in line for _, line in first["top_lines"])
    assert first["ops_per_step"] == second["ops_per_step"] and first["decode_steps"] == second["decode_steps"]
    # every step's decisions and results, digested: the same on both runs
    assert len(first["decisions_digest"]) == 16 and first["decisions_digest"] == second["decisions_digest"]
