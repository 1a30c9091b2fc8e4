"""`python -m adapt.bench.instruments.step_log`'s summary: tokens per ms of plain and drafting steps by batch size."""

from __future__ import annotations

from adapt.bench.instruments import step_log


def test_summary_splits_plain_and_drafting_steps_by_batch_size():
    steps = [{"B": 32, "ms": 90.0, "positions": 32, "accepted": 0, "verified": 0},
             {"B": 32, "ms": 90.0, "positions": 32, "accepted": 0, "verified": 0},
             {"B": 32, "ms": 218.0, "positions": 121, "accepted": 13, "verified": 89},
             {"B": 2, "ms": 20.0, "positions": 6, "accepted": 2, "verified": 4},
             {"B": 2}]  # a decision whose outcome was not seen (the run ended)
    lines = step_log.summary(steps)
    assert len(lines) == 3
    assert lines[0].startswith("rows 1-7 drafting:") and "0.200 tokens/ms" in lines[0]
    assert lines[1].startswith("rows 28-999 plain") and "2 steps" in lines[1] and "0.356 tokens/ms" in lines[1]
    assert lines[2].startswith("rows 28-999 drafting") and "0.206 tokens/ms" in lines[2]


def test_diffusion_calibration_compares_what_the_plan_expected_with_what_drafts_won():
    steps = [{"context": 200, "diffusion_rows": 2, "diffusion_predicted": 3.0, "diffusion_won": 2},
             {"context": 1800, "diffusion_rows": 1, "diffusion_predicted": 0.7, "diffusion_won": 0},
             {"context": 1900, "diffusion_rows": 1, "diffusion_predicted": 0.7, "diffusion_won": 1},
             {"context": 1900, "diffusion_rows": 0, "diffusion_predicted": None}]
    assert step_log.diffusion_calibration(steps) == [
        "short contexts: 2 diffusion drafts, expected 1.50 extra tokens each, won 1.00",
        "long contexts: 2 diffusion drafts, expected 0.70 extra tokens each, won 0.50"]


def test_a_round_on_the_demo_pair_logs_the_adaptive_and_the_baseline_steps(tmp_path):
    """The adaptive policy's decided steps (through a delegating wrapper) and the baseline's steps
    (an engine observer) are logged, each with its outcome; a step the policy decided without
    drafting rows verified no drafts."""
    import json

    out = tmp_path / "steps.json"
    assert step_log.main(["--pair", "demo", "--compile", "off", "--load", "2", "--rounds", "1", "--requests", "4",
                          "--baseline", "suffix", "--out", str(out)]) == 0
    (rnd,) = json.loads(out.read_text())["rounds"]
    steps, base = rnd["steps"], rnd["baseline_steps"]
    assert steps and base
    seen = [s for s in steps if "ms" in s]
    assert len(seen) >= len(steps) - 1  # every decided step's outcome, but perhaps the run's last
    for s in seen:
        assert 1 <= s["B"] <= 2 and s["diffusion_rows"] + s["suffix_rows"] <= s["B"]
        assert s["ms"] > 0 and s["positions"] >= s["B"] and s["predicted_ms"] > 0
        assert s["verified"] >= s["accepted"] >= 0
        if s["diffusion_rows"] + s["suffix_rows"] == 0:
            assert s["verified"] == 0
        assert s["context"] > 0 and len(s["diffusing"]) == s["B"]
        if s["diffusion_rows"] and s["diffusion_predicted"] is not None:
            assert s["diffusion_predicted"] >= 0 and 0 <= s["diffusion_won"] <= s["accepted"]
    for b in base:
        assert 1 <= b["B"] <= 2 and b["ms"] > 0 and b["drafting_rows"] <= b["B"]
    assert sum(b["drafting_rows"] for b in base) > 0  # static suffix drafting copied somewhere
    assert rnd["adaptive"]["goodput_tok_s"] > 0 and rnd["suffix"]["goodput_tok_s"] > 0
    # the demo pair's policy drafts by copies here: its diffusion calibration has nothing to report
    assert rnd["diffusion_calibration"] == step_log.diffusion_calibration(seen)


def test_the_plans_expected_diffusion_tokens_are_logged_with_what_the_drafts_won(tmp_path):
    """Without copies and without plain steps the demo pair's policy drafts by diffusion on every
    step: each such step logs what its plan expected of the diffusion rows and what they won."""
    import json

    out = tmp_path / "steps.json"
    assert step_log.main(["--pair", "demo", "--compile", "off", "--load", "2", "--rounds", "1", "--requests", "4",
                          "--set", "use_suffix=false", "--set", "allow_no_draft=false", "--out", str(out)]) == 0
    (rnd,) = json.loads(out.read_text())["rounds"]
    drafted = [s for s in rnd["steps"] if "ms" in s and s["diffusion_rows"]]
    assert drafted and all(s["diffusion_predicted"] > 0 and 0 <= s["diffusion_won"] <= s["accepted"] for s in drafted)
    (line,) = rnd["diffusion_calibration"]
    assert line.startswith("short contexts: ") and "expected" in line and "won" in line
