"""Command-line settings of the measurement scripts (adapt/bench/settings_text.py)."""

import json

import pytest

from adapt.bench.settings_text import parse_settings, parse_variant


def test_settings_read_json_values_files_and_plain_text_keys(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"match": [2, 4]}))
    got = parse_settings(["hold_max=0", " flag = true ", f"table=@{tmp_path / 't.json'}", "base=suffix",
                          "grid=[1,2]"], text_keys=("base",))
    assert got == {"hold_max": 0, "flag": True, "table": {"match": [2, 4]}, "base": "suffix", "grid": [1, 2]}


@pytest.mark.parametrize("item, named", [("span=abc", "span"), ("t=@/no/such/file.json", "t"), ("novalue", "novalue"),
                                         ("=3", "'=3'")])
def test_a_bad_setting_names_its_key(item, named):
    with pytest.raises(ValueError, match=named):
        parse_settings([item])


def test_a_variant_is_a_name_and_its_settings():
    assert parse_variant("fixed:profile.shuffle=false,engine.aot_pad=true") == (
        "fixed", {"profile.shuffle": False, "engine.aot_pad": True})
    assert parse_variant("plain") == ("plain", {})
