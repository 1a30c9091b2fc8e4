"""`adapt bench policies`: the `ar` and `suffix` baselines, the best static configuration against
the adaptive policy, workloads, and a fresh suffix memory for every live run (tiny models)."""

from __future__ import annotations

import json
import math

import pytest

import policies
from adapt.bench.live import KnobsBaseline, run_live
from adapt.bench.policies import BASELINES, LIVE_ONLY, POLICIES, compare, headline, make_policy
from adapt.cli import main as cli_main
from adapt.cost_model import CostModel, Table
from adapt.replay import RequestSpec, Scenario, make_mix, replay
from adapt.targets import RequestTargets
from adapt.trace_data import TraceTable
from tests.policy_fixtures import synthetic_records
from tests.tiny_models import make_tiny_pair, single_thread

COST = CostModel(Table([1, 8, 64, 512], [5.0, 5.5, 10.0, 60.0]), Table([1, 8, 64], [2.0, 2.5, 8.0]), overhead_ms=1.0)

_single_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


def _row(policy, goodput, sla=1.0, mode="live", c=4, workload="edit"):
    return {"policy": policy, "goodput_tok_s": goodput, "sla_attainment": sla, "mode": mode, "concurrency": c,
            "workload": workload}


def test_best_static_is_the_best_non_adaptive_baseline_per_group():
    rows = [_row("ar", 100, 0.9), _row("static", 80, 1.0), _row("batch-schedule", 90), _row("dspark", 95),
            _row("suffix", 140, 0.5), _row("adaptive", 210, 0.95),
            # replay: no suffix; adaptive's own higher goodput must not count as a baseline
            _row("ar", 50, mode="replay"), _row("static", 70, 0.7, mode="replay"), _row("adaptive", 35, mode="replay"),
            # another workload at the same load is its own group
            _row("ar", 300, workload="chat"), _row("suffix", 10, workload="chat"),
            _row("adaptive", 150, workload="chat"),
            # no adaptive row: no comparison
            _row("ar", 1, c=16)]
    comp = {(c["workload"], c["mode"], c["concurrency"]): c for c in compare(rows)}
    assert set(comp) == {("edit", "live", 4), ("edit", "replay", 4), ("chat", "live", 4)}
    live = comp[("edit", "live", 4)]
    assert live["best_static"] == "suffix" and live["best_static_goodput_tok_s"] == 140
    assert live["goodput_ratio"] == pytest.approx(1.5) and live["goodput_gain"] == pytest.approx(0.5)
    assert live["adaptive_sla"] == 0.95 and live["best_static_sla"] == 0.5 and live["best_baseline_sla"] == 1.0
    assert live["beats_all_goodput"] and not live["sla_at_least"]
    rep = comp[("edit", "replay", 4)]
    assert rep["best_static"] == "static" and rep["goodput_ratio"] == pytest.approx(0.5)
    assert "suffix" not in rep["baselines"]
    assert not rep["beats_all_goodput"]
    assert comp[("chat", "live", 4)]["best_static"] == "ar"
    table = headline(list(comp.values()))
    assert "| edit | live | 4 | suffix | 140.0 | 210.0 | **1.50×** | 0.95 | 0.50 |" in table


def test_knobs_baseline_checks_its_knobs():
    with pytest.raises(ValueError, match="quality"):
        KnobsBaseline("x", quality="tvd=0.1")
    with pytest.raises(ValueError, match="draft_len"):
        KnobsBaseline("x", draft_len=-1)
    assert "ar" in BASELINES and "suffix" in BASELINES and LIVE_ONLY == ("suffix",)
    assert set(POLICIES) <= set(policies.names())  # POLICIES: registry names (gpu_check builds them)
    assert make_policy("suffix", None, width=8).knobs == {"source": "suffix", "draft_len": 8}


def test_ar_replays_one_token_per_step():
    table = TraceTable.from_records(synthetic_records(num_requests=8, steps_per_request=12, K=8, step_grid=(1,),
                                                      seed=3))
    mix = make_mix(12, tight_tpot_ms=3.0, loose_tpot_ms=1e4, max_tokens=16)
    ar = replay(make_policy("ar", None), table, Scenario("mix", 4, mix), COST, charge_decisions=False)
    static = replay(make_policy("static", None), table, Scenario("mix", 4, mix), COST, charge_decisions=False)
    assert ar["tau"] == 1.0 and ar["tokens"] == 12 * 16 and ar["steps"] == 3 * 16
    assert ar["unknown_share"] == 0.0 and ar["tvd_spent_per_token"] == 0.0
    assert static["tau"] > 1.0
    # ar steps cost the cost model's verify of one token per row: 4 rows -> step_ms(4)
    assert ar["goodput_tok_s"] == pytest.approx(1e3 * 4 / float(COST.step_ms(4.0, None)), rel=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("tiny"), block_size=8)


@pytest.fixture(scope="module")
def engine(tiny):
    from workers.engine import Engine, EngineConfig

    return Engine(EngineConfig(target=str(tiny[0]), drafter=str(tiny[1]), device="cpu", dtype="float32",
                               max_batch=4, max_len=160))


def _greedy(n, tokens=24):
    return [RequestSpec(RequestTargets(tpot_ms=1e6), temperature=0.0, max_tokens=tokens) for _ in range(n)]


def test_live_ar_and_suffix_baselines(engine):
    from workers.traces import ListTraceSink

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23] * 6]
    ar = run_live(engine, make_policy("ar", None), Scenario("ar", 2, _greedy(4)), prompts)
    assert ar["tau"] == 1.0 and ar["source_share"]["none"] == 1.0 and ar["tokens"] == 4 * 24
    sink = ListTraceSink()
    suffix = make_policy("suffix", None, width=engine.width)
    m = run_live(engine, suffix, Scenario("suffix", 2, _greedy(4)), prompts, trace_sink=sink)
    assert m["source_share"]["diffusion"] == 0.0 and m["source_share"]["suffix"] > 0.0
    sources = {r["source"] for r in sink.records}
    assert "suffix" in sources and "diffusion" not in sources
    assert all(r["steps"] == -1 and r["suffix_match"] >= 2 for r in sink.records if r["source"] == "suffix")
    assert m["decision_ms_per_step"] >= 0.0 and not math.isnan(m["decision_ms_per_step"])


def test_live_runs_report_the_waits_for_other_requests_prefills(engine):
    """Requests of equal lengths decoded autoregressively run in lockstep cohorts: none waits for
    another's prefill while it decodes. With unequal lengths a short request's successor is
    prefilled while the long one decodes, and the long one's wait is reported."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23] * 6]
    lockstep = run_live(engine, make_policy("ar", None), Scenario("ar", 2, _greedy(4)), prompts)
    assert lockstep["prefill_stall_share"] == 0.0 and lockstep["sla_attainment_without_stalls"] == 1.0
    apart = [RequestSpec(RequestTargets(tpot_ms=1e6), temperature=0.0, max_tokens=n) for n in (6, 30, 6, 30)]
    m = run_live(engine, make_policy("ar", None), Scenario("ar", 2, apart), prompts)
    assert 0.0 < m["prefill_stall_share"] < 1.0
    assert m["sla_attainment_without_stalls"] >= m["sla_attainment"]


def test_every_live_run_starts_with_an_empty_suffix_memory(engine):
    # a random prompt (no repeats of its own): a suffix draft there can only copy a remembered output
    import torch

    prompts = [torch.randint(2, engine.vocab, (40,), generator=torch.Generator().manual_seed(7)).tolist()]
    spec = Scenario("one", 1, _greedy(1, tokens=32))
    first = run_live(engine, make_policy("suffix", None, width=engine.width), spec, prompts)
    again = run_live(engine, make_policy("suffix", None, width=engine.width), spec, prompts)
    assert again["tau"] == first["tau"] and again["source_share"] == first["source_share"]
    # without the reset the same greedy request copies its own earlier output
    copied = run_live(engine, make_policy("suffix", None, width=engine.width), spec, prompts, fresh_suffix=False)
    assert copied["tau"] > first["tau"] + 1.0


def test_bench_policies_live_with_ar_suffix_and_best_static(tiny, tmp_path):
    out = tmp_path / "bench"
    assert cli_main(["bench", "policies", "--target", str(tiny[0]), "--drafter", str(tiny[1]), "--quick",
                     "--workload", "edit", "--live-loads", "2", "--replay-loads", "1,4", "--rounds", "1",
                     "--trace-requests", "4", "--requests", "8", "--max-tokens", "8", "--cost", "traces",
                     "--threads", "1", "--admission", "sla", "--out", str(out)]) == 0
    rows = json.loads((out / "policies.json").read_text())
    assert {r["workload"] for r in rows} == {"edit"}
    # live rows report the prefill waits, TTFT and each request (lengths spread over 8 · (1 ± 0.5))
    for r in rows:
        if r["mode"] == "live":
            assert 0.0 <= r["prefill_stall_share"] < 1.0 and r["ttft_ms_mean"] > 0 and r["deferred_steps"] >= 0
            assert {q["tokens"] for q in r["per_request"]} <= set(range(4, 13))
    live = {r["policy"]: r for r in rows if r["mode"] == "live"}
    assert set(live) == set(BASELINES) | {"adaptive"}
    assert {r["policy"] for r in rows if r["mode"] == "replay"} == set(BASELINES) - {"suffix"} | {"adaptive"}
    for r in rows:
        if r["policy"] == "ar":
            assert r["tau"] == 1.0 and r["tvd_spent_per_token"] == 0.0
    assert live["ar"]["source_share"]["none"] == 1.0
    assert live["suffix"]["source_share"]["diffusion"] == 0.0 and live["suffix"]["tvd_spent_per_token"] == 0.0
    assert live["static"]["source_share"]["diffusion"] > 0.0
    # the suffix baseline's trace records (the suffix acceptance fit reads them): never diffusion
    suffix_records = [json.loads(line) for line in (out / "traces" / "suffix-edit.jsonl").read_text().splitlines()]
    assert suffix_records and {r["source"] for r in suffix_records} <= {"none", "suffix"}
    # best static = the max over the baselines in each (mode, load), and the adaptive rows carry it
    comp = json.loads((out / "best_static.json").read_text())
    assert {(c["mode"], c["concurrency"]) for c in comp} == {("live", 2), ("replay", 1), ("replay", 4)}
    for c in comp:
        group = [r for r in rows if r["mode"] == c["mode"] and r["concurrency"] == c["concurrency"]]
        base = [r for r in group if r["policy"] in BASELINES]
        best = max(base, key=lambda r: r["goodput_tok_s"])
        ad = next(r for r in group if r["policy"] == "adaptive")
        assert c["best_static"] == best["policy"] and c["best_static_sla"] == best["sla_attainment"]
        assert c["goodput_ratio"] == pytest.approx(ad["goodput_tok_s"] / best["goodput_tok_s"])
        assert ad["best_static"] == best["policy"] and ad["gain_vs_best_static"] == pytest.approx(c["goodput_ratio"])
    md = (out / "policies.md").read_text()
    assert md.index("best static configuration") < md.index("## Every row")
    assert "8 · (1 ± 0.5); admission sla" in md and "| prefill stall share | TTFT ms |" in md
    assert (out / "policies.png").stat().st_size > 1000


def test_bench_policies_interleaved_live_rows(tiny, tmp_path):
    """``--interleave``: each policy's live rows run on an engine of its own, side by side with the
    others, and come out as the rows of a run made one policy after another do (here with
    ``--instances``: each round serves its own instance of the scenario)."""
    out = tmp_path / "bench"
    assert cli_main(["bench", "policies", "--target", str(tiny[0]), "--drafter", str(tiny[1]), "--quick",
                     "--workload", "edit", "--live-loads", "2", "--replay-loads", "1", "--rounds", "2",
                     "--trace-requests", "4", "--requests", "8", "--max-tokens", "8", "--cost", "traces",
                     "--threads", "1", "--interleave", "--instances", "--out", str(out)]) == 0
    rows = json.loads((out / "policies.json").read_text())
    live = {r["policy"]: r for r in rows if r["mode"] == "live"}
    assert set(live) == set(BASELINES) | {"adaptive"}
    assert all(r["instances"] is True for r in live.values())  # each round its own scenario instance
    for r in live.values():
        assert len(r["goodput_rounds"]) == 2 and r["goodput_tok_s"] > 0 and r["requests"] == len(r["per_request"])
    assert live["ar"]["tau"] == 1.0 and live["ar"]["source_share"]["none"] == 1.0
    assert live["suffix"]["source_share"]["diffusion"] == 0.0
    assert "gain_vs_best_static" in live["adaptive"]


def test_evaluation_mix_prices_its_targets_on_the_cost_model():
    """The scripts' shared mix: the tight target is the cost model's whole-block step at one row,
    the loose one four times it; an explicit tight target replaces it; the rest is `make_mix`'s."""
    import torch

    from adapt.bench.evaluation import evaluation_mix, tight_tpot_ms

    t1 = tight_tpot_ms(COST, 16)
    assert t1 == pytest.approx(float(COST.step_ms(17.0, torch.tensor([1]))))
    mix = evaluation_mix(COST, 16, 6, max_tokens=32)
    assert mix == make_mix(6, t1, 4 * t1, max_tokens=32, length_spread=0.5)
    assert sorted({r.targets.tpot_ms for r in mix}) == pytest.approx([t1, 4 * t1])
    fixed = evaluation_mix(COST, 16, 3, tight_ms=30.0, length_spread=0.0)
    assert [r.targets.tpot_ms for r in fixed] == [30.0, 120.0, 120.0]
    assert all(r.max_tokens == 64 for r in fixed)
