"""A policy file's settings are checked at every edge that loads one: an unknown or ill-typed
setting is an error naming it (never silently dropped), in `build_policy`, `reload`,
`publish_policy` (the controller's push), `adapt policy push` and `adapt policy fit`."""

from __future__ import annotations

import argparse
import json

import pytest

from adapt import policy_file
from adapt.controller import SETTINGS, build_policy, reload, validate_settings
from adapt.policy_file import PolicyFile, PolicyFileError


@pytest.mark.parametrize("policy,settings,match", [
    ("adaptive", {"steps_grid": [1, 2], "colour": "red"}, r"policy\.settings\.colour: unknown setting of policy 'adaptive'"),
    ("adaptive", {"draft_len": 4}, r"policy\.settings\.draft_len: unknown setting"),  # static's, not adaptive's
    ("static", {"steps_grid": [1]}, r"policy\.settings\.steps_grid: unknown setting of policy 'static'"),
    ("adaptive", {"allow_no_draft": "yes"}, r"policy\.settings\.allow_no_draft: .*boolean"),
    ("adaptive", {"replan_every": "16"}, r"policy\.settings\.replan_every: .*integer"),
    ("adaptive", {"steps_grid": [1, "2"]}, r"policy\.settings\.steps_grid\.1: .*integer"),
    ("static", {"rule": "lenient"}, r"policy\.settings\.rule: "),
    ("batch-schedule", {"schedule": {"one": 4}}, r"policy\.settings\.schedule"),
    ("no-such-policy", {"steps": 1}, r"policy\.settings\.steps: unknown setting \(policy 'no-such-policy'"),
])
def test_bad_settings_are_named(policy, settings, match):
    with pytest.raises(PolicyFileError, match=match):
        validate_settings(policy, settings)


def test_good_settings_pass_through_unchanged():
    assert validate_settings("adaptive", {}) == {}
    assert validate_settings("adaptive", {"steps_grid": (1, 2), "sla_weight": 3}) == {"steps_grid": [1, 2],
                                                                                       "sla_weight": 3.0}
    assert validate_settings("batch-schedule", {"schedule": {"1": 8, "4": 0.5}}) == {"schedule": {1: 8.0, 4: 0.5}}
    assert validate_settings("batch-schedule", {"schedule": None}) == {"schedule": None}
    assert validate_settings("no-such-policy", {}) == {}
    assert set(SETTINGS) >= {"static", "batch-schedule", "dspark", "adaptive", "explore"}


def test_build_and_reload_reject_unknown_settings():
    with pytest.raises(PolicyFileError, match="policy.settings.colour"):
        build_policy(policy=PolicyFile(settings={"colour": "red"}))
    with pytest.raises(PolicyFileError, match="policy.settings.sla_weight"):
        build_policy("adaptive", PolicyFile(settings={"sla_weight": "high"}))
    p = build_policy(policy=PolicyFile(settings={"sla_weight": 5.0, "steps_grid": [1, 3]}))
    assert p.sla_weight == 5.0 and p.steps_grid == (1, 3)
    with pytest.raises(PolicyFileError, match="policy.settings.colour"):
        reload(p, PolicyFile(settings={"sla_weight": 1.0, "colour": "red"}))
    assert p.sla_weight == 5.0  # nothing of the rejected file was applied
    reload(p, PolicyFile(settings={"sla_weight": 1.0, "steps_grid": [2]}))
    assert p.sla_weight == 1.0 and p.steps_grid == (2,)


def test_a_file_for_another_policy_applies_the_shared_settings():
    """A benchmark runs every policy on one fitted adaptive file: the settings static does not
    take are valid for the file's own policy, so they are not applied to static, not an error."""
    pf = PolicyFile(policy="adaptive", settings={"steps_grid": [1, 2], "allow_no_draft": True})
    assert build_policy("static", pf).name == "static"
    explore = build_policy("explore", pf)
    assert explore.steps_grid == (1, 2)  # explore takes steps_grid too


def test_publish_policy_rejects_and_keeps_the_running_version():
    from adapt.serving.controller_actor import publish_policy
    from adapt.serving.store import open_store

    store = open_store(None)
    good = publish_policy(store, PolicyFile(settings={"steps_grid": [1, 2]}).to_dict())
    with pytest.raises(PolicyFileError, match="policy.settings.steps_gird: unknown setting"):
        publish_policy(store, PolicyFile(settings={"steps_gird": [1, 2]}).to_dict())
    assert store.policy_version() == good["store_version"]


def test_cli_push_and_fit_name_the_setting(tmp_path, capsys, redis_server):
    from adapt.cli import main as cli_main
    from adapt.serving.policy_commands import run_push
    from adapt.serving.redis_store import RedisStore
    from tests.policy_fixtures import synthetic_records, write_jsonl

    redis_server.flush()
    bad = tmp_path / "bad.json"
    policy_file.save(PolicyFile(settings={"steps_grid": [1], "flat_shares": 0.2}), bad)
    assert run_push(argparse.Namespace(policy=str(bad), redis_url=redis_server.url, ray_address=None)) == 2
    assert "policy.settings.flat_shares: unknown setting" in capsys.readouterr().err
    assert RedisStore(redis_server.url).policy_version() == 0  # nothing published

    traces = tmp_path / "traces.jsonl"
    write_jsonl(synthetic_records(num_requests=20, steps_per_request=10, step_grid=(1, 2), seed=1), traces)
    out = tmp_path / "p.json"
    assert cli_main(["policy", "fit", "--traces", str(traces), "--out", str(out),
                     "--settings", json.dumps({"sla_wieght": 2})]) == 2
    assert "policy.settings.sla_wieght: unknown setting" in capsys.readouterr().err and not out.exists()
    # a policy without steps_grid no longer gets one it would not take
    assert cli_main(["policy", "fit", "--traces", str(traces), "--out", str(out), "--policy", "static",
                     "--settings", json.dumps({"draft_len": 4})]) == 0
    pf = policy_file.load(out)
    assert pf.settings == {"draft_len": 4} and build_policy(policy=pf).draft_len == 4


def test_cli_policy_set_changes_settings_as_a_new_version(tmp_path, capsys):
    """`adapt policy set` merges validated settings into a policy file and writes a new version;
    a bad setting is named and the file is left as it was."""
    from adapt.cli import main as cli_main

    path = tmp_path / "p.json"
    first = policy_file.save(PolicyFile(settings={"steps_grid": [1, 2], "sla_weight": 3.0}), path)
    before = path.read_bytes()
    assert cli_main(["policy", "set", str(path), "--settings", json.dumps({"steps_grid": "one"})]) == 2
    assert "policy.settings.steps_grid" in capsys.readouterr().err and path.read_bytes() == before
    assert cli_main(["policy", "set", str(path), "--settings", "[1]"]) == 2
    assert "settings: must be a non-empty JSON object" in capsys.readouterr().err and path.read_bytes() == before
    # the late rows' veto from a batch size: at least one row
    assert cli_main(["policy", "set", str(path), "--settings", json.dumps({"sla_guard_behind_rows": 0})]) == 2
    assert "policy.settings.sla_guard_behind_rows" in capsys.readouterr().err and path.read_bytes() == before
    assert cli_main(["policy", "set", str(path), "--settings", json.dumps({"steps_grid": [1]})]) == 0
    pf = policy_file.load(path)
    assert pf.settings == {"steps_grid": [1], "sla_weight": 3.0} and pf.version != first
    assert build_policy(policy=pf).steps_grid == (1,)
    assert cli_main(["policy", "set", str(path), "--settings", json.dumps({"sla_guard_behind_rows": 1})]) == 0
    assert build_policy(policy=policy_file.load(path)).sla_guard_behind_rows == 1
