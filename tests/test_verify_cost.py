"""`python -m adapt.bench.instruments.verify_cost`: target forwards of T new tokens timed per start position."""

import json

import pytest

from adapt.bench.instruments import verify_cost


def test_verify_cost_times_every_width_at_every_start_on_the_demo_pair(tmp_path):
    out = tmp_path / "vc.json"
    assert verify_cost.main(["--pair", "demo", "--compile", "off", "--max-len", "64", "--starts", "4,40",
                             "--widths", "1,3", "--repeats", "2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["backend"] == "eager" and got["machine"]["threads"] == 2
    assert [(p["start"], p["tokens"]) for p in got["points"]] == [(4, 1), (4, 3), (40, 1), (40, 3)]
    assert all(p["ms"] > 0 for p in got["points"])
    assert [p["over_one"] for p in got["points"] if p["tokens"] == 1] == [1.0, 1.0]


def test_a_start_past_the_cache_is_a_usage_error_that_names_the_options(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        verify_cost.main(["--pair", "demo", "--compile", "off", "--max-len", "64", "--starts", "200",
                          "--widths", "9", "--out", str(tmp_path / "vc.json")])
    assert exc.value.code == 2 and "--starts/--widths" in capsys.readouterr().err
    assert not (tmp_path / "vc.json").exists()


def test_verify_cost_times_several_rows_at_once_with_batch(tmp_path):
    out = tmp_path / "vc.json"
    assert verify_cost.main(["--pair", "demo", "--compile", "off", "--max-len", "64", "--starts", "8",
                             "--widths", "1,2", "--repeats", "2", "--batch", "3", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["batch"] == 3 and [(p["start"], p["tokens"]) for p in got["points"]] == [(8, 1), (8, 2)]
    assert all(p["ms"] > 0 for p in got["points"])
