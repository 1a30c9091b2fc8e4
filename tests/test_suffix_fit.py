"""Fitting the suffix-draft acceptance table from traces (adapt/suffix_fit.py) into a policy file."""

from __future__ import annotations

import numpy as np
import pytest

from adapt.suffix_fit import EDGES, fit_suffix_accept
from adapt.trace_data import TraceTable


def suffix_records(rng, n, match, c, k=8, start=0, first=None, votes=None, scale=None, temperature=0.0):
    """n suffix-draft records of match length `match` whose first token is accepted w.p. `first`
    (default c) and each later one w.p. c; with `votes` (shares to draw each token's from) and
    `scale` (vote share -> factor), a token of share v is accepted w.p. min(1, that · scale[v])."""
    out = []
    for i in range(n):
        conf = [float(rng.choice(votes)) for _ in range(k)] if votes else [1.0] * k
        a = 0
        while a < k and rng.random() < min(1.0, (c if a or first is None else first) * (scale[conf[a]] if scale else 1.0)):
            a += 1
        out.append({"request_id": f"s{start + i}", "step": start + i, "steps": -1, "draft_len": k, "rule": 0,
                    "temperature": temperature, "accepted": a, "accept_flags": [1] * a + [0] * (k - a),
                    "source": "suffix", "suffix_match": match, "confidence": conf + [0.0] * (16 - k)})
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


def test_fit_recovers_the_scale_of_contested_tokens_and_the_policy_reads_it():
    """Tokens with a third of the votes are accepted at 0.3x a unanimous token's rate, half-share
    ones at 0.6x: the fit recovers c of the unanimous tokens and both scales (within sampling
    noise), its per-slot log-loss beats the table without them, and the policy's slot
    acceptance multiplies them in (capped at 1)."""
    import torch

    from policies.adaptive import check_suffix_accept, suffix_slot_accept

    rng = np.random.default_rng(5)
    scale = {1 / 3: 0.3, 0.5: 0.6, 1.0: 1.0}
    records = (suffix_records(rng, 1500, 2, 0.8, votes=list(scale), scale=scale)
               + suffix_records(rng, 800, 6, 0.9, start=1500, votes=list(scale), scale=scale))
    table, report = fit_suffix_accept(TraceTable.from_records(records))
    c = dict(zip(table["match"], table["accept"]))
    assert abs(c[2] - 0.8) < 0.05 and abs(c[6] - 0.9) < 0.05
    assert table["vote"] == [0.0, 0.5, 0.99]
    assert table["vote_scale"][2] == 1.0
    assert abs(table["vote_scale"][0] - 0.3) < 0.06 and abs(table["vote_scale"][1] - 0.6) < 0.08
    assert report["log_loss"] < report["log_loss_without_vote"] - 0.02
    assert [v["fitted"] for v in report["votes"]] == [True, True, True]

    checked = check_suffix_accept(table)
    vote = torch.tensor([[1.0, 1.0, 0.4], [0.4, 1.0, 0.0]])                        # [2, 3], 0 past the draft
    cond = suffix_slot_accept(checked, torch.tensor([2, 6]), vote, 3)
    c1 = dict(zip(table["match"], table["first"]))
    assert cond[0].tolist() == pytest.approx([c1[2], c[2], c[2] * table["vote_scale"][0]])
    assert cond[1, :2].tolist() == pytest.approx([c1[6] * table["vote_scale"][0], c[6]])
    assert suffix_slot_accept(checked, torch.tensor([2]), None, 2)[0].tolist() == pytest.approx([c1[2], c[2]])
    with pytest.raises(ValueError, match="come together"):
        check_suffix_accept({"match": [2], "accept": [0.5], "vote": [0.0, 0.5]})
    with pytest.raises(ValueError, match="vote"):
        check_suffix_accept({"match": [2], "accept": [0.5], "vote": [0.5, 0.0], "vote_scale": [0.2, 1.0]})


def test_greedy_and_sampled_rows_get_their_own_tables_and_the_policy_reads_each_rows():
    """Copies accepted at 0.9 per token on greedy rows and 0.6 on sampled ones (a sampled row
    accepts a copied token with the target's probability of it, not whenever it is the argmax):
    the fit gives the greedy table 0.9 and a ``"sampled"`` table 0.6; a bucket the sampled
    records do not reach takes the greedy table's value; the policy's slot acceptance reads each
    row's class; traces of one class fit one table as before."""
    import torch

    from adapt.controller import validate_settings
    from policies.adaptive import check_suffix_accept, suffix_slot_accept

    rng = np.random.default_rng(8)
    greedy = suffix_records(rng, 600, 4, 0.9) + suffix_records(rng, 300, 12, 0.95, start=600)
    sampled = suffix_records(rng, 600, 4, 0.6, start=900, temperature=0.8)
    table, report = fit_suffix_accept(TraceTable.from_records(greedy + sampled))
    g, s = dict(zip(table["match"], table["accept"])), dict(zip(table["match"], table["sampled"]["accept"]))
    assert abs(g[4] - 0.9) < 0.03 and abs(s[4] - 0.6) < 0.04
    assert s[12] == pytest.approx(g[12])  # no sampled records at match 12: the greedy value
    assert report["records"] == 900 and report["sampled"]["records"] == 600
    assert not any(b["fitted"] for b in report["sampled"]["buckets"] if b["match"] == 12)

    checked = check_suffix_accept(table)
    assert validate_settings("adaptive", {"suffix_accept": table})["suffix_accept"]["sampled"]["accept"] == table["sampled"]["accept"]
    cond = suffix_slot_accept(checked, torch.tensor([4, 4]), None, 2, torch.tensor([False, True]))
    assert cond[0, 1] == pytest.approx(g[4]) and cond[1, 1] == pytest.approx(s[4])
    assert torch.equal(suffix_slot_accept(checked, torch.tensor([4, 4]), None, 2), cond[[0, 0]])  # no classes: greedy
    with pytest.raises(ValueError, match="suffix_accept.sampled"):
        check_suffix_accept(dict(table, sampled=dict(table["sampled"], accept=[2.0] * len(EDGES))))
    with pytest.raises(ValueError, match="no 'sampled' table of its own"):
        check_suffix_accept(dict(table, sampled=dict(table["sampled"], sampled=table["sampled"])))
    only_sampled, _ = fit_suffix_accept(TraceTable.from_records(sampled))
    assert "sampled" not in only_sampled and abs(dict(zip(EDGES, only_sampled["accept"]))[4] - 0.6) < 0.04


def test_one_vote_bucket_fits_as_before():
    """Unanimous drafts only: the vote scale is all ones and c is the plain estimate."""
    rng = np.random.default_rng(6)
    table, report = fit_suffix_accept(TraceTable.from_records(suffix_records(rng, 800, 3, 0.7)))
    assert table["vote_scale"] == [1.0, 1.0, 1.0]
    assert abs(dict(zip(table["match"], table["accept"]))[3] - 0.7) < 0.05
    assert report["log_loss"] == report["log_loss_without_vote"]


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


def test_refit_from_saved_traces_writes_the_vote_scale_into_the_policy_file(tmp_path):
    """`python -m adapt.suffix_fit --from-traces FILE` refits a policy file's table from saved
    traces, vote scale and fit report included, without collecting new ones."""
    import json

    from adapt.commands.policy import fit_policy
    from adapt.controller import build_policy
    from adapt.policy_file import load, save
    from adapt.suffix_fit import main
    from tests.policy_fixtures import synthetic_records

    rng = np.random.default_rng(7)
    scale = {0.25: 0.2, 1.0: 1.0}
    traces = tmp_path / "traces.jsonl"
    traces.write_text("".join(json.dumps(r) + "\n" for r in suffix_records(rng, 600, 4, 0.8, votes=list(scale), scale=scale)))
    path = tmp_path / "p.json"
    save(fit_policy(synthetic_records(), policy="adaptive"), path)
    before = load(path).version
    assert main(["--policy-file", str(path), "--from-traces", str(traces)]) == 0
    pf = load(path)
    assert pf.version != before and pf.report["suffix"]["traces"] == str(traces)
    table = pf.settings["suffix_accept"]
    assert table["vote_scale"][0] < 0.4 and table["vote_scale"][-1] == 1.0
    assert build_policy("adaptive", str(path)).suffix_accept["vote_scale"] == table["vote_scale"]
    with pytest.raises(SystemExit, match="no suffix drafts"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text(json.dumps({"request_id": "a", "step": 0, "steps": 1, "draft_len": 2, "rule": 0,
                                     "temperature": 0.0, "accepted": 1, "accept_flags": [1, 0]}) + "\n")
        main(["--policy-file", str(path), "--from-traces", str(empty)])
