"""`adapt generate`: JSON output, autoregressive mode, equality of the two, clear errors."""

from __future__ import annotations

import json

import pytest

from adapt.cli import main
from workers import huge_pages
from tests.tiny_models import make_tiny_pair, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("cli"), vocab=512, seed=6)


def generate(capsys, pair, *flags):
    target, drafter = pair
    rc = main(["generate", "def add(a, b):", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
               "--max-tokens", "20", "--ignore-eos", "--json", *flags])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_and_autoregressive_equality(capsys, pair):
    spec = generate(capsys, pair, "--steps", "2", "--draft-len", "8")
    assert set(spec) == {"text", "token_ids", "stats"}
    st = spec["stats"]
    for key in ("tau", "target_passes", "tokens", "tokens_per_s", "accept_per_position", "tvd_spent"):
        assert key in st
    assert st["tokens"] == len(spec["token_ids"]) == 20 and st["tokens_per_s"] > 0
    assert st["tau"] == pytest.approx(20 / st["target_passes"])
    assert st["huge_pages"] is None  # off unless asked (workers/huge_pages.py)
    ar = generate(capsys, pair, "--draft-len", "0", "--huge-pages")
    assert ar["stats"]["tau"] == 1.0 and ar["stats"]["target_passes"] == 20
    assert ar["token_ids"] == spec["token_ids"] and ar["text"] == spec["text"]  # greedy: same tokens
    assert ar["stats"]["huge_pages"]["thp"] == huge_pages.thp_mode()  # moved where the kernel allows


def test_sampled_run_is_reproducible_and_lenient_reports_tvd(capsys, pair):
    a = generate(capsys, pair, "--temperature", "1.0", "--seed", "3", "--quality", "tvd=0.2", "--draft-len", "4")
    b = generate(capsys, pair, "--temperature", "1.0", "--seed", "3", "--quality", "tvd=0.2", "--draft-len", "4")
    assert a["token_ids"] == b["token_ids"]
    assert a["stats"]["tvd_spent"] >= 0.0 and a["stats"]["rules_used"] == "EPS_TVD"


def test_clear_errors(capsys, pair, tmp_path):
    target, drafter = pair
    rc = main(["generate", "x", "--target", str(tmp_path / "missing"), "--drafter", str(drafter)])
    assert rc == 2 and "--target" in capsys.readouterr().err
    rc = main(["generate", "x", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
               "--quality", "tvd=7"])
    assert rc == 2 and "quality" in capsys.readouterr().err
    rc = main(["generate", "", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32"])
    assert rc == 2 and "prompt must not be empty" in capsys.readouterr().err
