"""`adapt.bench.gpu_check` on CPU (`--quick`): every section that can run here runs for real (the
Triton kernels under the interpreter, the demo pair's engine, transformers, the policies
benchmark's traces) and writes the JSON a GPU run would write. Checks the files' keys and that the
exactness checks hold; no speed is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapt.bench import gpu_check
from adapt.cost_model import CostModel
from kernels import Rule
from workers.step_record import PHASES

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    return out


def read(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_every_section_reports_and_the_quick_run_passes(out):
    summary = read(out, "summary.json")
    assert summary["all_ok"] is True and summary["environment"]["device"] == "cpu"
    status = {name: s["status"] for name, s in summary["sections"].items()}
    assert status == {"kernels": "ok", "exactness": "ok", "cost": "ok", "syncs": "ok", "speed": "ok", "replay": "ok",
                      "compiled": "skipped"}
    assert "minutes" in summary["sections"]["compiled"]["reason"]
    # 8 files: what the device tool brings back at most
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["summary.json", "kernels.json", "exactness.json", "cost_model.json", "syncs.json", "speed.json",
         "replay.json", "compiled.json"])


def test_kernels_equal_for_every_rule_on_ragged_batches_and_a_152k_vocabulary(out):
    k = read(out, "kernels.json")
    assert k["checks"] == {"verify_equal": True, "select_commit_equal": True}
    assert "interpreter" in k["backend"]
    cases = k["verify"]
    assert all(c["tokens_equal"] and c["accepted_equal"] and c["tvd_close"] for c in cases)
    for vocab in (1000, 151_936):
        names = {c["case"] for c in cases if c["vocab"] == vocab}
        assert {f"rule {r.name}" for r in Rule} <= names
        assert "mixed rules without draft probabilities" in names
    assert any(c["mean_accepted"] > 0 for c in cases)            # acceptance paths ran
    assert any(c["mean_tvd_spent"] > 0 for c in cases)           # lenient rules spent TVD
    assert {c["k"] for c in k["select_commit"]} == {1, 5, 16}


def test_engine_greedy_output_is_the_targets_own(out):
    e = read(out, "exactness.json")
    assert e["checks"] == {"greedy_matches_transformers": True, "drafts_were_accepted": True}
    assert e["dtype"] == "float32" and all(r["match"] for r in e["rows"])
    knobs = [r["knobs"] for r in e["rows"]]
    assert {kn["draft_len"] for kn in knobs} >= {0, 1, 16} and {kn["steps"] for kn in knobs} >= {1, 2, 4}
    assert {kn["commit_order"] for kn in knobs} == {"confidence", "left-to-right"}


def test_speed_rows_batches_and_phases(out):
    s = read(out, "speed.json")
    rows = [r for r in s["results"] if "row" in r]
    assert {(r["row"], r["batch"]) for r in rows} == {(n, b) for n in ("adapt", "adapt-ar", "hf") for b in (1, 2)}
    assert all(r["tokens_per_s"] > 0 and r["tau"] >= 1.0 for r in rows)
    assert all(r["tau"] == 1.0 for r in rows if r["row"] in ("adapt-ar", "hf"))
    assert all(set(r["phases"]["phases_ms"]) == set(PHASES) for r in rows if r["row"] != "hf")
    assert {r["ratio"] for r in s["results"] if "ratio" in r} == {"adapt/adapt-ar", "adapt/hf", "adapt-ar/hf"}


def test_cost_model_file_loads_and_carries_its_profile(out):
    data = read(out, "cost_model.json")
    cost = CostModel.from_dict(data)
    assert cost.source == "profile" and cost.verify.at(1.0) > 0 and cost.draft_pass.at(1.0) > 0
    assert data["profile"]["pair"] == "demo" and data["profile"]["block"] == 16
    assert data["check"]["status"] == "ok" and all(data["check"]["checks"].values())
    assert set(data["check"]["verify_full_block_over_one_token"]) == {"1", "2", "4"}


def test_host_reads_per_step_by_call_site(out):
    s = read(out, "syncs.json")
    assert "upper bound" in s["method"]
    by = {sc["scenario"]: sc for sc in s["scenarios"]}
    assert len(by) == 6 and all(sc["device_syncs_per_step"] is None for sc in by.values())
    for name, sc in by.items():
        engine_reads = sum(v for site, v in sc["host_read_sites"].items()
                           if "workers/" in site and "workers/suffix.py" not in site)
        assert engine_reads >= 2, name
        # docs/engine.md: the decision maker's answer, the draft lengths (drafting steps only)
        # and the packed results are the step's host reads (tests/test_host_syncs.py pins them)
        assert engine_reads <= (2 if name.startswith("autoregressive") else 3), (name, sc["host_read_sites"])


def test_replay_reports_the_adaptive_policys_decisions_per_cost_model(out):
    r = read(out, "replay.json")
    assert r["device_cost_model"] is True and set(r["cost_models"]) == {"device", "policy_file"}
    adaptive = [row for row in r["rows"] if row["policy"] == "adaptive"]
    assert {(row["cost_model"], row["concurrency"]) for row in adaptive} == {
        (c, n) for c in ("device", "policy_file") for n in (1, 4)}
    for row in adaptive:
        d = row["decisions"]
        assert d["row_steps"] > 0 and 0.0 <= d["drafting_share"] <= 1.0
        assert abs(sum(d["steps_share"].values()) - 1.0) < 1e-3
        assert row["goodput_tok_s"] > 0 and row["verify_full_block_over_one_token"] > 0
        assert row["drafting_step_over_plain_step"] > 1.0  # more work: the drafter pass and a wider verify


def test_the_wrapper_runs_one_section_into_the_named_directory(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick",
                           "--sections", "cost", "--out", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "timeout 330 s" in done.stdout
    summary = read(tmp_path, "summary.json")
    assert summary["sections"] == {"cost": {"status": "ok", "seconds": summary["sections"]["cost"]["seconds"],
                                            "file": "cost_model.json",
                                            "checks": {"tables_non_decreasing": True, "finite_positive": True}}}
    assert summary["environment"]["triton_interpret"] == "1"
