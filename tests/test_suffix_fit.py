"""Fitting the suffix-draft acceptance table from traces (adapt/suffix_fit.py) into a policy file."""

from __future__ import annotations

import numpy as np

from adapt.suffix_fit import EDGES, fit_suffix_accept
from adapt.trace_data import TraceTable


def suffix_records(rng, n, match, c, k=8, start=0):
    """n suffix-draft records of match length `match` whose tokens are accepted w.p. c each."""
    out = []
    for i in range(n):
        a = 0
        while a < k and rng.random() < c:
            a += 1
        out.append({"request_id": f"s{start + i}", "step": start + i, "steps": -1, "draft_len": k, "rule": 0,
                    "temperature": 0.0, "accepted": a, "accept_flags": [1] * a + [0] * (k - a),
                    "source": "suffix", "suffix_match": match, "confidence": [1.0] * 16})
    return out


def test_fit_recovers_per_token_acceptance_by_match_length():
    rng = np.random.default_rng(0)
    records = suffix_records(rng, 400, 2, 0.3) + suffix_records(rng, 400, 9, 0.8, start=400)
    table, report = fit_suffix_accept(TraceTable.from_records(records))
    c = dict(zip(table["match"], table["accept"]))
    assert abs(c[2] - 0.3) < 0.05 and abs(c[8] - 0.8) < 0.05
    assert all(b >= a for a, b in zip(table["accept"], table["accept"][1:]))  # non-decreasing in m
    fitted = {b["match"] for b in report["buckets"] if b["fitted"]}
    assert fitted == {2, 8} and report["records"] == 800


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
