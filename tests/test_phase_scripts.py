"""scripts/phase_times.py, scripts/alone_vs_interleaved.py and scripts/draft_temperature.py on the demo
pair (eager, a few requests)."""

from __future__ import annotations

import json

import pytest

from tests.script_loader import load_script


def test_phase_times_reports_each_phase_and_the_adaptive_decision_parts(tmp_path):
    out = tmp_path / "phases.json"
    assert load_script("phase_times").main(["--pair", "demo", "--compile", "off", "--policies", "ar,adaptive",
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


def test_alone_vs_interleaved_runs_each_policy_alone_twice_and_both_interleaved(tmp_path):
    out = tmp_path / "alone.json"
    assert load_script("alone_vs_interleaved").main(["--pair", "demo", "--policies", "ar,suffix", "--load", "1",
                                                      "--requests", "3", "--max-tokens", "8",
                                                      "--out", str(out)]) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["policies"] == ["ar", "suffix"] and len(rec["alone_a"]) == len(rec["alone_b"]) == 2
    assert len(rec["interleaved"]) == 2 and rec["b_over_a_alone"] > 0 and rec["b_over_a_interleaved"] > 0


def test_draft_temperature_reports_tau_per_kind_and_scale(tmp_path):
    """scripts/draft_temperature.py: one row per (kind, scale), τ a count of tokens per target pass,
    each kind's ratios against its first scale; the engine's scale is restored afterwards."""
    out = tmp_path / "dt.json"
    assert load_script("draft_temperature").main(["--pair", "demo", "--compile", "off", "--kinds", "chat,code",
                                                   "--scales", "1,0.5", "--requests", "2", "--max-tokens", "8",
                                                   "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["kind"], r["scale"]) for r in rows] == [("chat", 1.0), ("chat", 0.5), ("code", 1.0), ("code", 0.5)]
    assert all(r["tau"] >= 1.0 and r["tokens"] == 16 for r in rows)
    assert rows[0]["tau_ratio"] == rows[2]["tau_ratio"] == 1.0
    assert rows[1]["tau_ratio"] == round(rows[1]["tau"] / rows[0]["tau"], 4)
