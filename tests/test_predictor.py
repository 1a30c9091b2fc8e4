"""Acceptance predictor: fitting, calibration, tensor evaluation; the policy file; `adapt policy fit`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adapt.cli import main as cli_main
from adapt.policy_file import PolicyFile, PolicyFileError, dumps, load, loads, save
from adapt.predictor import (AcceptancePredictor, expected_calibration_error, fit_predictor, prior_features,
                             sequential_temperatures)
from adapt.trace_data import TraceError, TraceTable
from tests.policy_fixtures import synthetic_records, write_jsonl


@pytest.fixture(scope="module")
def table():
    return TraceTable.from_records(synthetic_records(num_requests=100, step_grid=(1, 2, 3), eps_grid=(0.0, 0.1), seed=3))


@pytest.fixture(scope="module")
def fitted(table):
    return fit_predictor(table, seed=0)


def test_ece_and_reliability_on_known_values():
    pred = np.array([0.1, 0.1, 0.9, 0.9])
    label = np.array([0, 0, 1, 1])
    ece, table = expected_calibration_error(pred, label, bins=10)
    assert ece == pytest.approx(0.1)
    assert [row["count"] for row in table] == [2, 2]
    ece_bad, _ = expected_calibration_error(np.array([0.9, 0.9]), np.array([0, 0]))
    assert ece_bad == pytest.approx(0.9)


def test_fit_is_calibrated_on_held_out_requests(fitted):
    _, report = fitted
    for head in ("draft", "prior"):
        assert report[head]["test_points"] > 500
        assert report[head]["ece"] < 0.05, report[head]
        rel = report[head]["reliability"]
        assert sum(r["count"] for r in rel) == report[head]["test_points"]
    # the analytic leniency model is checked on the ε-TVD rows of the traces
    assert report["lenient"]["records"] > 100 and report["lenient"]["ece"] < 0.08


def test_draft_head_ranks_positions_like_the_truth(fitted, table):
    predictor, _ = fitted
    t = table.select(table.rule != 3)
    with torch.no_grad():
        surv = predictor.survival(torch.from_numpy(t.confidence[:, :8]), torch.from_numpy(t.entropy[:, :8]),
                                  torch.from_numpy(t.margin[:, :8]), torch.from_numpy(t.temperature),
                                  torch.from_numpy(t.recent_accept), torch.from_numpy(t.steps),
                                  torch.zeros(len(t), dtype=torch.bool)).numpy()
    assert (np.diff(surv, axis=1) <= 1e-6).all()  # survival never rises along the block
    # expected accepted drafts track the observed ones
    expected, observed = surv.sum(1), t.accepted
    assert np.corrcoef(expected, observed)[0, 1] > 0.5
    assert abs(expected.mean() - observed.mean()) < 0.25 * observed.mean() + 0.1


def test_leniency_raises_survival_and_prior_orders_steps(fitted):
    predictor, _ = fitted
    B, K = 4, 8
    args = (torch.full((B, K), 0.6), torch.full((B, K), 1.0), torch.full((B, K), 0.3), torch.full((B,), 0.7),
            torch.full((B,), 0.5), torch.ones(B, dtype=torch.long), torch.zeros(B, dtype=torch.bool))
    exact = predictor.survival(*args)
    lenient = predictor.survival(*args, eps=torch.full((B,), 0.1))
    assert (lenient >= exact).all() and (lenient > exact).any()
    prior = predictor.prior_survival(torch.tensor([1, 2, 3]), K, torch.full((B,), 0.7), torch.full((B,), 0.5),
                                     torch.zeros(B, dtype=torch.bool))
    assert prior.shape == (B, 3, K)
    # in the synthetic process more diffusion steps give more confident, better drafts
    assert (prior[:, 2].sum(-1) > prior[:, 0].sum(-1)).all()


def test_fast_prior_path_equals_feature_path(fitted):
    predictor, _ = fitted
    g = torch.Generator().manual_seed(0)
    B, K = 5, 12
    steps = torch.tensor([1, 2, 4])
    temp = torch.tensor([0.0, 0.7, 1.0, 0.0, 0.3])
    recent = torch.rand(B, generator=g)
    recent[0] = -1.0  # nothing verified yet: reads as the class's typical recent acceptance
    match = torch.rand(B, 3, generator=g) > 0.5
    x = prior_features(steps, K, temp, predictor.known_recent(recent, temp), match)
    ref = torch.cumprod(predictor.prior.conditional(x, temp > 0), -1)
    torch.testing.assert_close(predictor.prior_survival(steps, K, temp, recent, match), ref, rtol=1e-5, atol=1e-6)


def test_sequential_temperatures_fix_an_overconfident_model():
    rng = np.random.default_rng(0)
    true_logit = rng.normal(0, 1.5, size=(4000, 1))
    survived = (rng.random((4000, 1)) < 1 / (1 + np.exp(-true_logit))).astype(np.int64)
    temps = sequential_temperatures(3.0 * true_logit, survived)  # 3x overconfident
    assert temps[0] == pytest.approx(3.0, rel=0.15)


def test_unfitted_predictor_is_usable_and_serialisable():
    p = AcceptancePredictor()
    s = p.survival(torch.rand(3, 4), torch.rand(3, 4), torch.rand(3, 4), torch.zeros(3), torch.zeros(3),
                   torch.ones(3, dtype=torch.long), torch.zeros(3, dtype=torch.bool))
    assert s.shape == (3, 4) and ((s >= 0) & (s <= 1)).all()
    again = AcceptancePredictor.from_dict(json.loads(json.dumps(p.to_dict())))
    assert not again.fitted


def test_policy_file_round_trip_and_corruption(tmp_path, fitted):
    predictor, report = fitted
    pf = PolicyFile(predictor=predictor, policy="adaptive", settings={"steps_grid": [1, 2]}, report=report)
    path = tmp_path / "policy.json"
    version = save(pf, path)
    loaded = load(path)
    assert loaded.version == version and loaded.settings == {"steps_grid": [1, 2]}
    x = [torch.rand(2, 6) for _ in range(3)] + [torch.tensor([0.0, 0.8]), torch.rand(2), torch.ones(2, dtype=torch.long),
                                                 torch.zeros(2, dtype=torch.bool)]
    torch.testing.assert_close(loaded.predictor.survival(*x), predictor.survival(*x))
    assert not open(path, "rb").read().startswith(b"\x80")  # JSON, not pickle

    data = json.loads(path.read_text())
    data["predictor"]["draft"]["sampled"]["weight"][0] += 1.0  # edited without a new checksum
    with pytest.raises(PolicyFileError, match="checksum"):
        loads(json.dumps(data))
    with pytest.raises(PolicyFileError, match="schema"):
        loads(json.dumps({**data, "schema": "other"}))
    with pytest.raises(PolicyFileError, match="not valid JSON"):
        loads(path.read_text()[:-20])
    broken = json.loads(dumps(PolicyFile()))
    broken["predictor"]["draft"]["greedy"]["weight"] = [1.0, 2.0]
    from adapt.policy_file import _checksum

    broken["checksum"] = _checksum(broken)
    with pytest.raises(PolicyFileError, match="predictor"):
        loads(json.dumps(broken))
    with pytest.raises(PolicyFileError, match="cannot read"):
        load(tmp_path / "missing.json")


def test_cli_policy_fit(tmp_path, capsys):
    traces = tmp_path / "traces.jsonl"
    write_jsonl(synthetic_records(num_requests=60, step_grid=(1, 2), seed=5), traces)
    out, report = tmp_path / "p.json", tmp_path / "r.json"
    assert cli_main(["policy", "fit", "--traces", str(traces), "--out", str(out), "--report", str(report)]) == 0
    text = capsys.readouterr().out
    assert "ECE" in text and "reliability" in text
    assert "sampled rows: ECE" in text and "typical recent acceptance" in text  # per class (synthetic: T = 0.7)
    pf = load(out)
    assert pf.policy == "adaptive" and pf.settings["steps_grid"] == [1, 2] and pf.predictor.fitted
    assert json.loads(report.read_text())["draft"]["ece"] == pf.report["draft"]["ece"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "a"}\n')
    assert cli_main(["policy", "fit", "--traces", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    assert "missing field" in capsys.readouterr().err


def test_trace_reader_errors(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        TraceTable.read(tmp_path / "none.jsonl")
    p = tmp_path / "t.jsonl"
    p.write_text("{not json}\n")
    with pytest.raises(TraceError, match="t.jsonl:1"):
        TraceTable.read(p)


def test_each_temperature_class_gets_its_own_calibrated_head():
    # greedy requests here accept far more than sampled ones at the same draft confidence: one
    # pooled model would under-predict one class and over-predict the other
    greedy = synthetic_records(num_requests=80, step_grid=(1,), temperature=0.0, seed=5)
    sampled = synthetic_records(num_requests=80, step_grid=(1,), temperature=0.8, seed=6)
    for rec in greedy:
        rec["request_id"] = "g" + rec["request_id"]
        n = len(rec["accept_flags"])
        rec["accepted"] = min(n, 2 * rec["accepted"] + 1)
        rec["accept_flags"] = [1] * rec["accepted"] + [0] * (n - rec["accepted"])
    predictor, report = fit_predictor(TraceTable.from_records(greedy + sampled), seed=0)
    for head in ("draft", "prior"):
        for cls in ("greedy", "sampled"):
            row = report[head]["by_class"][cls]
            assert row["ece"] < 0.05, (head, cls, row)
            assert abs(row["predicted"] - row["observed"]) < 0.15 * row["observed"], (head, cls, row)
    # and the prior tells the classes apart for a row with the same history
    prior = predictor.prior_survival(torch.tensor([1]), 8, torch.tensor([0.0, 0.8]), torch.tensor([-1.0, -1.0]),
                                     torch.zeros(2, dtype=torch.bool))
    assert prior[0].sum() > 1.5 * prior[1].sum()
