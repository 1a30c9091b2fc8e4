"""Trace replay: logged acceptance is reproduced and truncated, limits are reported, and the
`adapt bench policies` table is written in its documented format."""

from __future__ import annotations

import json

import numpy as np
import pytest

import policies
from adapt.cli import main as cli_main
from adapt.cost_model import CostModel, Table
from adapt.replay import RecordPool, Scenario, make_mix, replay
from adapt.targets import RequestTargets
from adapt.replay import RequestSpec
from adapt.trace_data import TraceTable
from tests.policy_fixtures import synthetic_records, write_jsonl

COST = CostModel(Table([1, 8, 64, 512], [5.0, 5.5, 10.0, 60.0]), Table([1, 8, 64], [2.0, 2.5, 8.0]), overhead_ms=1.0)


@pytest.fixture(scope="module")
def table():
    return TraceTable.from_records(synthetic_records(num_requests=12, steps_per_request=20, K=8, step_grid=(1,), seed=2))


def _lossless(n, tokens=40, temperature=0.7):
    return [RequestSpec(RequestTargets(tpot_ms=1e6), temperature=temperature, max_tokens=tokens) for _ in range(n)]


def test_full_block_replay_reproduces_logged_acceptance(table):
    # twelve requests at once, each replaying its own source request's 20 records in order
    scenario = Scenario("all", 12, _lossless(12, tokens=10_000))
    m = replay(policies.get("static", steps=1, draft_len=8, rule="exact"), table, scenario, COST,
               charge_decisions=False, max_steps=20)
    assert m["unknown_share"] == 0.0
    assert m["tau"] == pytest.approx(float(np.mean(table.accepted + 1)), rel=1e-6)


def test_truncation_caps_acceptance(table):
    m = replay(policies.get("static", steps=1, draft_len=2, rule="exact"), table, Scenario("all", 12, _lossless(12, 10_000)),
               COST, charge_decisions=False, max_steps=20)
    assert m["tau"] == pytest.approx(float(np.mean(np.minimum(table.accepted, 2) + 1)), rel=1e-6)


def test_unknown_positions_are_counted_pessimistically():
    records = synthetic_records(num_requests=4, steps_per_request=10, K=8, seed=1)
    for r in records:  # logged with only 4 verified positions
        r["draft_len"] = 4
        r["accept_flags"] = r["accept_flags"][:4]
        r["accepted"] = min(r["accepted"], 4)
    t = TraceTable.from_records(records)
    m = replay(policies.get("static", steps=1, draft_len=8, rule="exact"), t, Scenario("all", 4, _lossless(4, 10_000)),
               COST, charge_decisions=False, max_steps=10)
    assert m["unknown_share"] == pytest.approx(0.5, abs=0.01)
    assert m["tau"] <= 5.0


def test_mix_metrics_and_budgets():
    # logged with lenient (ε = 0.1) steps too: replay charges the TVD a lenient step logged, so
    # without them no policy could spend any and the budget checks below would hold vacuously
    lenient_table = TraceTable.from_records(synthetic_records(num_requests=12, steps_per_request=20, K=8,
                                                              step_grid=(1,), eps_grid=(0.0, 0.1), seed=2))
    mix = make_mix(24, tight_tpot_ms=3.0, loose_tpot_ms=1e4, eps=0.1, max_tokens=24, budget_total=0.5)
    assert [s.temperature for s in mix[:4]] == [0.0, 0.8, 0.0, 0.8]
    assert str(mix[3].targets.quality) == "tvd=0.1" and mix[1].targets.lossless
    assert sum(not s.targets.quality.lossless and s.temperature > 0 for s in mix) == 6  # lenient sampled rows
    pool = RecordPool(lenient_table)
    for name in ("static", "dspark", "adaptive"):
        m = replay(policies.get(name, cost=COST), lenient_table, Scenario("mix", 4, mix), COST, pool=pool)
        assert m["requests"] == 24 and m["tokens"] == 24 * 24
        assert 0.6 <= m["sla_attainment"] <= 1.0  # the loose two thirds are always met
        assert m["decision_ms_per_step"] > 0
        if name == "dspark":  # exact rules only
            assert m["tvd_spent_per_token"] == 0.0
        else:  # the lenient rows used ε-TVD and stayed within ε per token
            assert 0.0 < m["tvd_spent_per_lenient_token"] <= 0.1 + 1e-6
            assert m["tvd_spent_per_token"] == pytest.approx(m["tvd_spent_per_lenient_token"] * 6 / 24)


def test_bench_policies_replay_only(tmp_path):
    traces = tmp_path / "t.jsonl"
    write_jsonl(synthetic_records(num_requests=30, steps_per_request=15, K=8, step_grid=(1, 2), seed=4), traces)
    out = tmp_path / "bench"
    assert cli_main(["bench", "policies", "--quick", "--no-live", "--requests", "16", "--traces", str(traces),
                    "--out", str(out)]) == 0
    rows = json.loads((out / "policies.json").read_text())
    keys = {"policy", "concurrency", "goodput_tok_s", "sla_attainment", "tau", "tvd_spent_per_token",
            "decision_ms_per_step"}
    assert rows and all(keys <= set(r) for r in rows)
    # every policy but the live-only suffix baseline (suffix drafts need the real text)
    assert {r["policy"] for r in rows} == {"ar", "static", "batch-schedule", "dspark", "adaptive"}
    assert all(r["tau"] == 1.0 for r in rows if r["policy"] == "ar")
    assert sorted({r["concurrency"] for r in rows}) == [1, 4, 16, 64]
    assert (out / "policies.png").stat().st_size > 1000 and "adaptive" in (out / "policies.md").read_text()


def test_mix_lengths_spread_evenly_around_max_tokens():
    """`length_spread` gives requests lengths spread evenly over max_tokens · (1 ± s), with mean
    near max_tokens; 0 keeps every request at max_tokens; a spread of 1 or more is an error."""
    assert {r.max_tokens for r in make_mix(12, 3.0, 12.0, max_tokens=64)} == {64}
    lengths = [r.max_tokens for r in make_mix(48, 3.0, 12.0, max_tokens=64, length_spread=0.5)]
    assert min(lengths) >= 32 and max(lengths) <= 96 and len(set(lengths)) > 30
    assert abs(sum(lengths) / len(lengths) - 64) < 2
    with pytest.raises(ValueError, match="length_spread"):
        make_mix(4, 3.0, 12.0, length_spread=1.0)
