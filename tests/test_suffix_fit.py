"""Fitting the suffix-draft acceptance table from traces (adapt/suffix_fit.py) into a policy file."""

from __future__ import annotations

import numpy as np
import pytest

from adapt.suffix_fit import EDGES, fit_suffix_accept
from adapt.trace_data import TraceTable


def suffix_records(rng, n, match, c, k=8, start=0, first=None):
    """n suffix-draft records of match length `match` whose first token is accepted w.p. `first`
    (default c) and each later one w.p. c."""
    out = []
    for i in range(n):
        a = 0
        while a < k and rng.random() < (c if a or first is None else first):
            a += 1
        out.append({"request_id": f"s{start + i}", "step": start + i, "steps": -1, "draft_len": k, "rule": 0,
                    "temperature": 0.0, "accepted": a, "accept_flags": [1] * a + [0] * (k - a),
                    "source": "suffix", "suffix_match": match, "confidence": [1.0] * 16})
    return out


def test_fit_recovers_per_token_acceptance_by_match_length():
    rng = np.random.default_rng(0)
    records = suffix_records(rng, 1500, 2, 0.3) + suffix_records(rng, 400, 9, 0.8, start=1500)
    table, report = fit_suffix_accept(TraceTable.from_records(records))
    c = dict(zip(table["match"], table["accept"]))
    assert abs(c[2] - 0.3) < 0.05 and abs(c[8] - 0.8) < 0.05
    assert all(b >= a for a, b in zip(table["accept"], table["accept"][1:]))  # non-decreasing in m
    fitted = {b["match"] for b in report["buckets"] if b["fitted"]}
    assert fitted == {2, 8} and report["records"] == 1900


def test_an_empty_bucket_does_not_lift_a_fitted_one():
    """Bucket 6 fitted at 0.5 stays 0.5 beside an empty bucket 4 (prior 4/7 = 0.57): the prior is
    clipped between its fitted neighbours instead of raising bucket 6 to it."""
    from adapt.suffix_fit import monotone

    rng = np.random.default_rng(3)
    records = suffix_records(rng, 400, 2, 0.3) + suffix_records(rng, 400, 6, 0.5, start=400)
    table, report = fit_suffix_accept(TraceTable.from_records(records))
    c = dict(zip(table["match"], table["accept"]))
    assert abs(c[6] - 0.5) < 0.05 and c[3] <= c[4] <= c[6]
    assert all(b >= a for a, b in zip(table["accept"], table["accept"][1:]))
    assert c[8] == pytest.approx(8 / 11, abs=1e-3)  # above the last fitted bucket: its own prior
    assert monotone([0.2, 0.9, 0.4, 0.3], [True, False, True, True]) == pytest.approx([0.2, 0.4, 0.4, 0.4])
    assert monotone([0.5, 0.6], [False, False]) == pytest.approx([0.5, 0.6])


def test_fit_separates_the_first_tokens_acceptance_from_the_later_ones():
    """Copies that run on (first token 0.5, later ones 0.9) fit as c₁ = 0.5, c = 0.9; a geometric
    law fits c₁ = c; the policy reads both and a draft's expected accepted tokens follow."""
    import torch

    from policies.adaptive import check_suffix_accept, suffix_accept_of

    rng = np.random.default_rng(2)
    records = suffix_records(rng, 600, 2, 0.9, first=0.5) + suffix_records(rng, 600, 3, 0.95, start=600)
    table, report = fit_suffix_accept(TraceTable.from_records(records))
    first, later = dict(zip(table["match"], table["first"])), dict(zip(table["match"], table["accept"]))
    assert abs(first[2] - 0.5) < 0.05 and abs(later[2] - 0.9) < 0.03
    assert abs(first[3] - 0.95) < 0.03 and abs(later[3] - 0.95) < 0.03
    pooled = {b["match"]: b["pooled"] for b in report["buckets"]}
    assert pooled[2] < later[2] - 0.1  # one geometric c would underrate the run-on copy
    c1, c = suffix_accept_of(check_suffix_accept(table), torch.tensor([2, 3, 40]))
    assert c1.tolist() == pytest.approx([first[2], first[3], table["first"][-1]])
    assert c.tolist() == pytest.approx([later[2], later[3], table["accept"][-1]])
    # a table without "first" is one geometric law
    old = check_suffix_accept({"match": table["match"], "accept": table["accept"]})
    c1, c = suffix_accept_of(old, torch.tensor([2]))
    assert float(c1) == float(c) == pytest.approx(later[2])
    with pytest.raises(ValueError, match="first"):
        check_suffix_accept({"match": [2, 4], "accept": [0.5, 0.6], "first": [0.5]})


def test_no_suffix_records_no_table():
    rec = [{"request_id": "a", "step": 0, "steps": 1, "draft_len": 2, "rule": 0, "temperature": 0.0,
            "accepted": 1, "accept_flags": [1, 0], "confidence": [0.9] * 16}]
    table, report = fit_suffix_accept(TraceTable.from_records(rec))
    assert table is None and report == {"records": 0}


def test_policy_fit_stores_the_table_and_the_policy_reads_it(tmp_path):
    from adapt.commands.policy import fit_policy
    from adapt.controller import build_policy
    from tests.policy_fixtures import synthetic_records

    rng = np.random.default_rng(1)
    records = synthetic_records() + suffix_records(rng, 300, 12, 0.9, start=10_000)
    pf = fit_policy(records, policy="adaptive")
    assert pf.settings["suffix_accept"]["match"] == list(EDGES)
    path = tmp_path / "p.json"
    from adapt.policy_file import save

    save(pf, path)
    policy = build_policy("adaptive", str(path))
    assert policy.suffix_accept["accept"][EDGES.index(12)] > 0.8


def test_collected_traces_through_the_engine_fit_a_table(tmp_path):
    from adapt.suffix_fit import collect_suffix_traces
    from tests.tiny_models import make_tiny_target

    target = make_tiny_target(tmp_path / "t", vocab=16, seed=4)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 1, 2, 7, 1], [9, 9, 9, 2]] * 4
    records = collect_suffix_traces(target, prompts, max_tokens=24, batch=4, dtype="float32")
    suffix = [r for r in records if r["source"] == "suffix"]
    assert suffix and all(r["steps"] == -1 and r["suffix_match"] >= 2 for r in suffix)
    table, report = fit_suffix_accept(TraceTable.from_records(records), min_records=5)
    assert table is not None and report["records"] == len(suffix)
    assert any(b["fitted"] for b in report["buckets"])
