"""The adaptive policy's one settings model (`policies.adaptive.settings.AdaptiveSettings`) is what
its constructor, a policy file and `adapt policy set` accept, and what docs/policies.md lists."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import policies
from adapt.controller import SETTINGS, build_policy, validate_settings
from adapt.policy_file import PolicyFile, PolicyFileError, load, save
from policies.adaptive.settings import REMOVED, AdaptiveSettings, settings_table

ROOT = Path(__file__).resolve().parents[1]
TABLE = {"match": [2, 8], "accept": [0.5, 0.9]}


def _other_value(name: str, info):
    """A valid value of setting ``name`` that is not its default."""
    default = info.default
    if name == "steps_grid":
        return [1]
    if name == "suffix_accept":
        return TABLE
    if name in ("hold_joins_rows", "span_headroom"):
        return None
    if name == "sla_clock":
        return "decode"
    if name == "closed_model":
        return "weight"
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return 0.5 if default != 0.5 else 0.25
    raise AssertionError(f"no test value for {name}")


def _policy_attr(p, name):
    value = getattr(p, name)
    return list(value) if name == "steps_grid" else value


def test_the_policy_file_model_is_the_policys_own():
    assert SETTINGS["adaptive"] is AdaptiveSettings


def test_every_setting_is_settable_from_a_policy_file_and_reaches_the_policy(tmp_path):
    settings = {name: _other_value(name, info) for name, info in AdaptiveSettings.model_fields.items()}
    path = tmp_path / "policy.json"
    save(PolicyFile(policy="adaptive", settings=settings), path)
    p = build_policy(policy=load(path))
    for name, value in settings.items():
        assert _policy_attr(p, name) == value, name
    assert p.settings == AdaptiveSettings.model_validate(settings)


def test_the_constructor_takes_every_setting_and_nothing_else():
    for name, info in AdaptiveSettings.model_fields.items():
        value = _other_value(name, info)
        assert _policy_attr(policies.get("adaptive", **{name: value}), name) == value, name
    with pytest.raises(ValueError, match="colour"):
        policies.get("adaptive", colour="red")


@pytest.mark.parametrize("name,value", [("hold_max", -1), ("hold_share", 2.0), ("idle_decay", 1.5),
                                        ("steps_grid", [0]), ("steps_grid", []), ("sla_slack", 0.0),
                                        ("closed_weight", -0.1), ("span_headroom", -1), ("replan_every", 0),
                                        ("sla_clock", "cpu"), ("suffix_accept", {"match": [1]})])
def test_out_of_range_settings_are_named_everywhere(name, value):
    with pytest.raises(ValueError, match=f"^{name}"):
        policies.get("adaptive", **{name: value})
    with pytest.raises(PolicyFileError, match=rf"policy\.settings\.{name}"):
        validate_settings("adaptive", {name: value})
    p = policies.get("adaptive")
    with pytest.raises(ValueError, match=f"^{name}"):
        p.update(**{name: value})


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_a_removed_setting_in_a_file_loads_with_a_warning(tmp_path, name):
    path = tmp_path / "policy.json"
    save(PolicyFile(policy="adaptive", settings={name: True, "hold_max": 3}), path)
    with pytest.warns(UserWarning, match=rf"policy\.settings\.{name}: removed setting"):
        p = build_policy(policy=load(path))
    assert p.hold_max == 3 and not hasattr(p, name)
    with pytest.raises(ValueError):  # not a constructor argument any more
        policies.get("adaptive", **{name: True})


def test_shipped_policy_files_load_without_warnings():
    for path in sorted(ROOT.glob("models/*/policy.json")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            build_policy(policy=load(path))


def test_cli_policy_set_names_bad_and_removed_settings(tmp_path, capsys):
    from adapt.cli import main as cli_main

    path = tmp_path / "policy.json"
    save(PolicyFile(policy="adaptive", settings={"copies_save": True}), path)
    before = path.read_text()
    assert cli_main(["policy", "set", str(path), "--settings", '{"hold_share": 3.0}']) == 2
    assert "policy.settings.hold_share" in capsys.readouterr().err
    assert cli_main(["policy", "set", str(path), "--settings", '{"copies_drop": true}']) == 2
    assert "settings.copies_drop: removed setting" in capsys.readouterr().err
    assert path.read_text() == before
    with pytest.warns(UserWarning, match="copies_save"):
        assert cli_main(["policy", "set", str(path), "--settings", '{"hold_max": 2}']) == 0
    assert load(path).settings == {"hold_max": 2}  # the removed setting is dropped from the file


def test_docs_settings_table_is_the_models():
    text = (ROOT / "docs/policies.md").read_text()
    table = settings_table()
    assert table in text, "docs/policies.md's settings table differs: paste policies.adaptive.settings.settings_table()"
    for line in table.splitlines()[2:]:
        assert re.match(r"^\| `\w+` \| `.+` \| .+ \| .+ \|$", line), line
