"""Request targets: parsing, validation errors that name the field, server defaults, headers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from adapt.targets import QualityTarget, RequestTargets, ServerDefaults, parse_quality


def test_quality_strings_parse():
    assert parse_quality("lossless") == QualityTarget()
    assert parse_quality("tvd=0.05") == QualityTarget(mode="tvd", eps=0.05)
    assert parse_quality(" TVD:0.2 ").eps == 0.2
    assert str(parse_quality("tvd=0.05")) == "tvd=0.05" and str(parse_quality("lossless")) == "lossless"
    assert parse_quality({"mode": "tvd", "eps": 0.1}).eps == 0.1


@pytest.mark.parametrize("bad", ["tvd=0", "tvd=1.5", "tvd=abc", "tvd=nan", "fast", "", 3])
def test_bad_quality_names_the_field(bad):
    with pytest.raises(ValueError, match="quality"):
        RequestTargets(quality=bad)


def test_quality_target_consistency():
    with pytest.raises(ValueError, match="eps"):
        QualityTarget(mode="lossless", eps=0.1)
    with pytest.raises(ValueError, match="eps"):
        QualityTarget(mode="tvd", eps=0.0)


def test_request_targets_fields_and_effective_tpot():
    t = RequestTargets(tpot_ms=40, quality="tvd=0.05", tvd_budget_total=2.0, priority=3, ttft_ms=500)
    assert t.effective_tpot_ms == 40 and not t.lossless and t.quality.eps == 0.05
    assert RequestTargets(tokens_per_s=20).effective_tpot_ms == pytest.approx(50.0)
    # both given: the tighter ceiling wins
    assert RequestTargets(tpot_ms=80, tokens_per_s=20).effective_tpot_ms == pytest.approx(50.0)
    assert RequestTargets().effective_tpot_ms is None and RequestTargets().lossless


@pytest.mark.parametrize("field,value", [("tpot_ms", -1), ("tpot_ms", 0), ("tokens_per_s", float("inf")),
                                         ("ttft_ms", float("nan")), ("priority", 1000), ("priority", "high"),
                                         ("tvd_budget_total", -0.5), ("speed", 3)])
def test_invalid_values_name_the_field(field, value):
    extra = {"quality": "tvd=0.1"} if field == "tvd_budget_total" else {}
    with pytest.raises(ValidationError) as info:
        RequestTargets(**{field: value, **extra})
    assert field in str(info.value)


def test_total_budget_needs_a_lenient_quality():
    with pytest.raises(ValueError, match="tvd_budget_total"):
        RequestTargets(tvd_budget_total=1.0)


def test_frozen():
    t = RequestTargets(tpot_ms=40)
    with pytest.raises(ValidationError):
        t.tpot_ms = 10


def test_server_defaults_fill_gaps_only():
    d = ServerDefaults(tpot_ms=50, ttft_ms=800, quality="tvd=0.1", tvd_budget_total=3.0, priority=1)
    filled = RequestTargets().with_defaults(d)
    assert (filled.tpot_ms, filled.ttft_ms, filled.quality.eps, filled.tvd_budget_total, filled.priority) == (
        50, 800, 0.1, 3.0, 1)
    own = RequestTargets(tokens_per_s=10, quality="lossless", priority=0).with_defaults(d)
    assert own.tpot_ms is None and own.effective_tpot_ms == pytest.approx(100.0)
    assert own.lossless and own.tvd_budget_total is None and own.priority == 0
    with pytest.raises(ValueError, match="quality"):
        ServerDefaults(quality="tvd=7")


def test_from_headers():
    t = RequestTargets.from_headers({"X-Adapt-Tokens-Per-S": "25", "x-adapt-quality": "tvd=0.02",
                                     "x-adapt-tvd-budget-total": "1.5", "x-adapt-priority": "2", "other": "x"})
    assert t.tokens_per_s == 25 and t.quality.eps == 0.02 and t.tvd_budget_total == 1.5 and t.priority == 2
    with pytest.raises(ValidationError, match="tpot_ms"):
        RequestTargets.from_headers({"x-adapt-tpot-ms": "soon"})
