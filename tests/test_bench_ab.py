"""`adapt bench ab` (adapt/bench/ab.py): the paired ratio, and a live A/B run on the demo pair."""

from __future__ import annotations

import json

import pytest

from adapt.bench import ab


def _script():
    return ab


def test_paired_ratio_compares_within_a_round():
    """Round 1 is slow for everyone, round 2 fast: the adaptive row wins both rounds by 5 %
    against the best static row of its own round, though its slow round is below the static
    rows' fast one."""
    ab = _script()
    g = lambda *xs: [{"goodput_tok_s": x} for x in xs]  # noqa: E731
    runs = {"ar": g(30.0, 40.0), "suffix": g(32.0, 38.0), "adaptive": g(33.6, 42.0),
            "ar+sla": g(10.0, 10.0), "suffix+sla": g(10.0, 10.0), "adaptive+sla": g(9.0, 12.0)}
    assert ab.paired_ratios(runs, "adaptive") == pytest.approx([1.05, 1.05])
    assert ab.paired_ratios(runs, "adaptive+sla") == pytest.approx([0.9, 1.2])  # against its own mode


def test_a_variant_reads_json_values_and_tables_from_files(tmp_path):
    """``NAME:key=value,...`` with JSON values; ``key=@PATH`` reads the value from a JSON file
    (an earlier suffix acceptance table, whose commas the option cannot carry)."""
    ab = _script()
    table = {"match": [2, 4], "accept": [0.5, 0.7]}
    (tmp_path / "t.json").write_text(json.dumps(table))
    name, settings = ab.parse_variant(f"old:hold_max=0,suffix_vote=false,suffix_accept=@{tmp_path / 't.json'}")
    assert name == "old" and settings == {"hold_max": 0, "suffix_vote": False, "suffix_accept": table}


@pytest.mark.parametrize("static", ["ar,bogus", "static-0", ""])
def test_unknown_static_configurations_are_refused_by_name(tmp_path, static, capsys):
    with pytest.raises(SystemExit) as exc:
        _script().main(["--policy-file", str(tmp_path / "p.json"), "--static", static, "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "--static" in capsys.readouterr().err


def test_ab_run_on_the_demo_pair_writes_rows_with_paired_ratios(tmp_path):
    from adapt.commands.policy import fit_policy
    from adapt.policy_file import save
    from tests.policy_fixtures import synthetic_records

    policy = tmp_path / "policy.json"
    save(fit_policy(synthetic_records(), policy="adaptive"), policy)
    out = tmp_path / "ab.json"
    assert _script().main(["--pair", "demo", "--workload", "mixed", "--policy-file", str(policy), "--loads", "2",
                           "--rounds", "2", "--max-tokens", "8", "--variant", "novote:suffix_vote=false",
                           "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["ar", "suffix", "adaptive", "novote"]
    assert all(r["instances"] is True for r in rows)  # each round its own instance, by default
    for r in rows:
        assert len(r["goodput_rounds"]) == 2 and r["goodput_tok_s"] > 0
        assert [x["goodput_tok_s"] for x in r["rounds"]] == pytest.approx(r["goodput_rounds"], abs=0.051)
    for r in rows[2:]:
        assert len(r["paired_ratio_rounds"]) == 2 and r["paired_ratio"] > 0
        assert all(set(x["suffix_accept"]) == {"drafts", "ratio"} for x in r["rounds"])
    assert rows[3]["settings"] == {"suffix_vote": False}
    assert out.with_suffix(".png").stat().st_size > 0  # the plot beside the rows
    assert rows[0]["suffix_accept"] is None and set(rows[2]["suffix_accept"]) == {"drafts", "ratio"}


def test_interleaved_ab_run_gives_each_policy_its_own_engine(tmp_path):
    """``--interleave``: the rows of a round run side by side (adapt/bench/interleave.py), each on its
    own engine, and carry the same fields as runs made one after another; a static variant runs its
    base on an engine of its own config and counts among the static configurations."""
    from adapt.commands.policy import fit_policy
    from adapt.policy_file import save
    from tests.policy_fixtures import synthetic_records

    policy = tmp_path / "policy.json"
    save(fit_policy(synthetic_records(), policy="adaptive"), policy)
    out = tmp_path / "ab.json"
    assert _script().main(["--pair", "demo", "--workload", "mixed", "--policy-file", str(policy), "--loads", "2",
                           "--rounds", "2", "--max-tokens", "8", "--threads", "1", "--interleave",
                           "--sla-ms", "40", "--static", "ar,suffix,static-4", "--out", str(out),
                           "--static-variant", "suffix-nopack:base=suffix,engine.pack=false",
                           "--variant", "nopack:engine.pack=false,hold_max=0", "--no-instances"]) == 0
    rows = json.loads(out.read_text())
    assert all(r["instances"] is False for r in rows)  # every round the same instance
    assert [r["policy"] for r in rows] == ["ar", "suffix", "static-4", "suffix-nopack", "adaptive", "nopack"]
    # a variant's engine.FIELD keys configure its own engine; the rest are the policy's settings
    assert rows[5]["engine"] == {"pack": False} and rows[5]["settings"] == {"hold_max": 0}
    assert rows[3]["engine"] == {"pack": False} and rows[3]["source_share"].get("diffusion", 0) == 0
    assert rows[4]["engine"] == {} and len(rows[5]["paired_ratio_rounds"]) == 2
    assert rows[2]["source_share"].get("diffusion", 0) > 0  # static-4 drafts with the diffusion drafter
    best = [max(r["goodput_rounds"][i] for r in rows[:4]) for i in range(2)]
    assert rows[4]["paired_ratio_rounds"] == pytest.approx([rows[4]["rounds"][i]["goodput_tok_s"] / best[i]
                                                            for i in range(2)], rel=0.01)
    assert all(r["sla_ms"] == [40.0, 160.0] for r in rows)  # fixed targets, not this run's profile
    for r in rows:
        assert len(r["goodput_rounds"]) == 2 and r["goodput_tok_s"] > 0 and 0.0 <= r["sla_attainment"] <= 1.0
    assert len(rows[4]["paired_ratio_rounds"]) == 2 and rows[4]["paired_ratio"] > 0
    assert "paired_ratio" not in rows[2] and "paired_ratio" not in rows[3]  # static rows are references
    assert set(rows[4]["suffix_accept"]) == {"drafts", "ratio"}


def test_engine_settings_of_a_variant_need_interleaved_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _script().main(["--policy-file", str(tmp_path / "p.json"), "--variant", "pad:engine.aot_pad=true",
                        "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "--interleave" in capsys.readouterr().err


def test_a_static_variant_names_its_base_and_engine_fields_only(tmp_path, capsys):
    for bad in ("x:engine.pack=false", "x:base=nonsense", "x:base=suffix,hold_max=0"):
        with pytest.raises(SystemExit) as exc:
            _script().main(["--policy-file", str(tmp_path / "p.json"), "--interleave", "--static-variant", bad,
                            "--out", str(tmp_path / "o")])
        assert exc.value.code == 2 and "--static-variant x" in capsys.readouterr().err


def test_a_variant_with_a_value_that_is_not_json_is_refused_by_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        _script().main(["--policy-file", str(tmp_path / "p.json"), "--variant", "x:span_headroom=two",
                        "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "span_headroom" in capsys.readouterr().err
