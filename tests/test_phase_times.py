"""`python -m adapt.bench.instruments.phase_times` on the demo pair (eager, a few requests)."""

from __future__ import annotations

import json

import pytest

from adapt.bench.instruments import phase_times


def test_phase_times_reports_each_phase_and_the_adaptive_decision_parts(tmp_path):
    out = tmp_path / "phases.json"
    assert phase_times.main(["--pair", "demo", "--compile", "off", "--policies", "ar,adaptive",
                                             "--requests", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"ar-0", "adaptive-0"}
    for r in result.values():
        assert r["decode_steps"] > 0 and r["step_ms"] > 0
        assert {"verify_forward", "decisions", "bookkeeping"} <= set(r["phases_ms"])
        assert set(r["per_call_ms"]) == set(r["calls_per_step"]) and r["per_call_ms"]["verify_forward"] > 0
        # per call x calls per step = the phase's share of a step
        for phase in set(r["per_call_ms"]) & set(r["phases_ms"]):
            assert r["per_call_ms"][phase] * r["calls_per_step"][phase] == pytest.approx(r["phases_ms"][phase], rel=0.01, abs=1e-3)
        steps = sum(s["steps"] for s in r["by_source"].values())
        assert steps >= r["decode_steps"] > 0  # one trace record per row and step
        assert all(s["tokens_per_step"] >= 1 and s["step_ms"] > 0 for s in r["by_source"].values())
    assert set(result["ar-0"]["by_source"]) == {"none"} and "draft" not in result["ar-0"]["per_call_ms"]
    assert result["ar-0"]["decision_parts_ms"] == {}  # a baseline runs none of the adaptive policy's parts
    assert "_plan_steps" in result["adaptive-0"]["decision_parts_ms"]
