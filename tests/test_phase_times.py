"""`python -m adapt.bench.instruments.phase_times` on the demo pair (eager, a few requests)."""

from __future__ import annotations

import json

import pytest

from adapt.bench.instruments import phase_times
from workers.step_record import PHASES


def test_phase_times_reports_each_phase_and_the_decision_makers_calls(tmp_path):
    out = tmp_path / "phases.json"
    assert phase_times.main(["--pair", "demo", "--compile", "off", "--policies", "ar,adaptive",
                                             "--requests", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"ar-0", "adaptive-0"}
    for r in result.values():
        assert r["decode_steps"] > 0 and r["step_ms"] > 0
        assert set(r["phases_ms"]) == set(PHASES)
        assert sum(r["phases_ms"].values()) == pytest.approx(r["step_ms"], rel=1e-3, abs=1e-3)
        assert set(r["per_call_ms"]) == set(r["calls_per_step"]) and r["per_call_ms"]["forward"] > 0
        # per call x calls per step = the phase's share of a step
        for phase in set(r["per_call_ms"]) & set(r["phases_ms"]):
            assert r["per_call_ms"][phase] * r["calls_per_step"][phase] == pytest.approx(r["phases_ms"][phase], rel=0.01, abs=1e-3)
        steps = sum(s["steps"] for s in r["by_source"].values())
        assert steps >= r["decode_steps"] > 0  # one trace record per row and step
        assert all(s["tokens_per_step"] >= 1 and s["step_ms"] > 0 for s in r["by_source"].values())
        # the decision maker's calls, timed from outside, lie inside the engine's phases that run them
        parts, phases = r["decision_parts_ms"], r["phases_ms"]
        for call, phase in (("before_draft", "decide"), ("after_draft", "choose"), ("observe", "conclude")):
            if call in parts:
                assert 0 <= parts[call] <= phases[phase] + 1e-3, (call, parts, phases)
        assert {"before_draft", "observe"} <= set(parts)
    # `ar` never drafts: no draft or choose phase ran, and its `after_draft` was never asked
    ar = result["ar-0"]
    assert set(ar["by_source"]) == {"none"} and "draft" not in ar["per_call_ms"]
    assert "after_draft" not in ar["decision_parts_ms"]
    assert set(result["adaptive-0"]["decision_parts_ms"]) == {"before_draft", "after_draft", "observe"}
