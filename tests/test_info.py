"""`adapt info`: machine capability, the dtype chosen for the models and why, what is cached."""

from __future__ import annotations

import json

import pytest

from adapt.cli import main
from tests.tiny_models import make_tiny_pair, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("info"), vocab=512, seed=4)


def _info(capsys, pair, cache, *flags):
    rc = main(["info", "--target", str(pair[0]), "--drafter", str(pair[1]), "--cache-dir", str(cache), *flags])
    assert rc == 0
    return capsys.readouterr().out


def test_info_reports_the_machine_and_what_a_generate_run_chose_and_kept(capsys, pair, tmp_path):
    import torch

    before = json.loads(_info(capsys, pair, tmp_path, "--json"))
    m = before["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["torch"] == torch.__version__ and m["torch_threads"] >= 1
    assert isinstance(m["flags"], list) and isinstance(m["native_bf16_matmul"], bool)
    assert before["chosen"]["dtype"]["dtype"] is None and "not measured yet" in before["chosen"]["dtype"]["why"]
    assert before["cache"]["cache_dir"] == str(tmp_path) and before["cache"]["profiles"] == []

    rc = main(["generate", "x = 1", "--target", str(pair[0]), "--drafter", str(pair[1]), "--policy", "adaptive",
               "--max-tokens", "4", "--json", "--cache-dir", str(tmp_path)])
    assert rc == 0
    stats = json.loads(capsys.readouterr().out)["stats"]

    after = json.loads(_info(capsys, pair, tmp_path, "--json"))
    assert after["chosen"]["dtype"]["dtype"] == stats["dtype"]
    assert after["chosen"]["dtype"]["why"] == stats["dtype_choice"]["reason"]
    kinds = sorted(p["kind"] for p in after["cache"]["profiles"])
    assert kinds == ["cost", "dtype"] and all(p["kb"] > 0 for p in after["cache"]["profiles"])
    text = _info(capsys, pair, tmp_path)
    assert "machine:" in text and f"dtype: {stats['dtype']}" in text and "cost profile" in text


def test_a_one_row_programs_verdict_reads_as_what_runs_where():
    """`adapt info` states a one-row program's measured verdict (workers/aot.py `aot_one_row`):
    its time over the decode package's per token count, and the counts it runs."""
    from adapt.commands.info import _verdict

    text = _verdict({"ms": {"1": [30.0, 20.1], "5": [29.5, 39.6]}, "tokens": [1], "starts": [64, 295]})
    assert "1 token(s) 0.67x" in text and "5 token(s) 1.34x" in text and text.endswith("runs one-row calls of 1 token(s)")
    assert _verdict(None) == "" and "calls of none" in _verdict({"ms": {"1": [10.0, 12.0]}, "tokens": []})
