"""`adapt bench speed` end to end on a tiny pair: the JSON it writes, the plot, the skips.

Timing is the benchmark's business; nothing here asserts a speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapt.cli import main
from tests.tiny_models import make_tiny_pair
from workers.step_record import PHASES as STEP_PHASES

PHASES = set(STEP_PHASES)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speed")
    target, drafter = make_tiny_pair(tmp)
    out = tmp / "out"
    code = main(["bench", "speed", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
                 "--batch-sizes", "1,2", "--max-tokens", "8", "--prompt-len", "24", "--rounds", "1",
                 "--threads", "1", "--rows", "adapt,adapt-policy,adapt-ar,adapt-target,adapt-k2,hf,hf-lookup,vllm-ngram",
                 "--vllm-python", str(tmp / "no-such-python"), "--compile", "off", "--out", str(out)])
    assert code == 0
    return out, json.loads((out / "speed.json").read_text())


def test_every_row_and_batch_is_reported(report):
    _, rep = report
    assert rep["config"]["batch_sizes"] == [1, 2]
    assert rep["config"]["num_prompts"] == 2 and rep["config"]["prompt_tokens"] == [24, 24]
    got = {(e["row"], e["batch"]) for e in rep["results"]}
    assert got == {(r, b) for r in ("adapt", "adapt-policy", "adapt-ar", "adapt-target", "adapt-k2", "hf", "hf-lookup",
                                    "vllm-ngram")
                   for b in (1, 2)}
    for e in rep["results"]:
        if "skipped" in e:
            continue
        assert e["tokens"] == 2 * 8, e  # 2 prompts x 8 tokens, EOS ignored
        assert e["tokens_per_s"] > 0 and len(e["tokens_per_s_samples"]) == 1
        assert e["tau"] >= 1.0


def test_adapt_rows_run_eager_by_default_and_compiled_rows_report_their_warm_up(report, tmp_path):
    """`--compile` defaults to off (eager decode steps, as `adapt serve` and `adapt generate` run
    by default: compiling SmolLM2's steps takes 7-14 minutes); a compiled row (`--compile on`:
    torch.compile, workers/backends.py) reports its warm-up, an eager run none. (The compiled programs themselves are
    tested in tests/test_compiled.py.)"""
    import argparse

    from adapt.bench import speed

    parser = argparse.ArgumentParser()
    speed.add_parser(parser.add_subparsers())
    assert parser.parse_args(["speed"]).compile == "off"
    _, rep = report
    assert rep["config"]["compile"] == "off"
    assert all(w.get("steps", 0) == 0 for w in rep["config"]["warm_up"].values()), rep["config"]["warm_up"]
    target, drafter = make_tiny_pair(tmp_path)
    out = tmp_path / "out"
    assert main(["bench", "speed", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
                 "--batch-sizes", "1", "--max-tokens", "4", "--prompt-len", "12", "--rounds", "1", "--threads", "1",
                 "--rows", "adapt-ar", "--compile", "on", "--out", str(out)]) == 0
    warm = json.loads((out / "speed.json").read_text())["config"]["warm_up"]
    assert set(warm) == {"adapt-ar"} and warm["adapt-ar"]["steps"] > 0 and warm["adapt-ar"]["seconds"] > 0, warm


def test_missing_vllm_and_batched_lookup_are_skipped_with_reasons(report):
    _, rep = report
    by = {(e["row"], e["batch"]): e for e in rep["results"]}
    assert "vLLM not found" in by[("vllm-ngram", 1)]["skipped"]
    assert "batch 1 only" in by[("hf-lookup", 2)]["skipped"]
    assert "skipped" not in by[("hf-lookup", 1)]
    assert "vllm-ngram" in rep["skipped"] and "hf-lookup@2" in rep["skipped"]


def test_greedy_rows_agree_with_transformers_in_fp32(report):
    _, rep = report
    for e in rep["results"]:
        if e["row"] in ("adapt", "adapt-policy", "adapt-ar", "adapt-target", "adapt-k2", "hf-lookup") and "skipped" not in e:
            assert e["agree_with_hf"] == 1.0, e
        if e["row"] in ("adapt-ar", "adapt-target"):
            assert e["tau"] == 1.0


def test_our_step_is_profiled_by_phase(report):
    _, rep = report
    assert set(rep["phases"]) == PHASES
    for e in rep["results"]:
        if e["row"].startswith("adapt"):
            assert set(e["phases_ms"]) == PHASES
            assert e["decode_steps"] > 0 and e["step_ms"] > 0
            assert sum(e["phases_ms"].values()) == pytest.approx(e["step_ms"], rel=1e-3, abs=1e-3)
            assert all(e["phases_ms"][p] > 0 for p in ("decide", "forward", "accept", "conclude"))
            if e["row"] != "adapt-policy":  # the adaptive policy may or may not draft here
                assert (e["phases_ms"]["draft"] > 0) == (e["row"] in ("adapt", "adapt-k2"))
            # `choose` runs on the steps that draft, and only there
            assert (e["phases_ms"]["choose"] > 0) == (e["phases_ms"]["draft"] > 0)


def test_plot_and_table_are_written(report):
    out, rep = report
    png = (out / "speed.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    table = (out / "speed.md").read_text()
    assert "| row | batch | tokens/s |" in table and "transformers generate" in table and "skipped" in table
    assert set(rep["ratios"]) >= {"adapt/adapt-ar", "adapt/hf", "adapt-ar/hf"}


def test_adapt_rows_report_the_mean_request_latency(report):
    """Our engine's rows time each request to its last token; the mean lies within the row's
    time (a group's requests end at or before the group), and other rows report none."""
    out, rep = report
    for e in rep["results"]:
        if "skipped" in e:
            continue
        if e["row"].startswith("adapt"):
            groups = 2 // e["batch"]  # 2 prompts in groups of `batch`
            assert 0 < e["request_s_mean"] <= max(e["seconds"]) / groups + 2e-4, e  # both rounded to 0.1 ms
        else:
            assert "request_s_mean" not in e
    assert "mean request s" in (out / "speed.md").read_text()


VARIANT = "adapt-policy@closed_model=weight+hold_max=0"  # the adaptive policy with two of its settings changed


def test_bad_rows_are_named():
    with pytest.raises(SystemExit, match="--rows"):
        main(["bench", "speed", "--rows", "adapt,sglang"])
    for bad, named in (("adapt-policy@no_such=1", "no_such"), ("adapt-policy@closed_model=tail", "closed_model"),
                       ("adapt-policy@hold_max", "KEY=VALUE")):
        with pytest.raises(SystemExit, match=named):
            main(["bench", "speed", "--rows", f"adapt-ar,{bad}"])
    for bad in ("adapt-k0", "adapt-k2-s0", "adapt-kx"):
        with pytest.raises(SystemExit, match="--rows"):
            main(["bench", "speed", "--rows", bad])


def test_static_rows_share_the_engine_and_are_compared_with_the_policy(report):
    """`adapt-kN[-sS]` rows draft N tokens with S steps for every request; rows with the same
    drafter share one loaded engine (the warm-up names the row that loaded it); the report gives
    each static row over autoregressive and the adaptive policy over the fastest static row."""
    from adapt.bench.speed import static_row

    assert static_row("adapt-k4") == (4, 1) and static_row("adapt-k16-s2") == (16, 2) and static_row("adapt") is None
    out, rep = report
    warm = rep["config"]["warm_up"]
    assert warm["adapt-policy"] == {"engine_of": "adapt"} and warm["adapt-k2"] == {"engine_of": "adapt"}
    assert "engine_of" not in warm["adapt"] and "engine_of" not in warm["adapt-target"]
    by = {(e["row"], e["batch"]): e for e in rep["results"]}
    assert by[("adapt-k2", 1)]["label"] == "adapt, static K=2 s=1"
    assert by[("adapt-k2", 1)]["tau"] <= 3.0  # at most 2 drafts + 1 per pass
    assert set(rep["ratios"]["adapt-k2/adapt-ar"]) == {"1", "2"}
    best = rep["ratios"]["adapt-policy/best-static"]
    for b in ("1", "2"):
        name = best[b]["best_static"]
        assert name in ("adapt", "adapt-ar", "adapt-target", "adapt-k2")
        rate = {r: by[(r, int(b))]["tokens_per_s"] for r in ("adapt", "adapt-ar", "adapt-target", "adapt-k2")}
        assert rate[name] == max(rate.values())
        assert best[b]["ratio"] == pytest.approx(by[("adapt-policy", int(b))]["tokens_per_s"] / rate[name], abs=1e-3)
    assert "fastest static row" in (out / "speed.md").read_text()


def test_interleaved_refill_rows_take_turns_and_agree(tmp_path):
    """`--interleave`: our rows take turns step by step, each with its own engine and clock;
    `--refill`: requests are kept in flight per batch size instead of static groups (rows that
    cannot, transformers here, are skipped with the reason). Greedy rows still emit the same
    tokens, and the report pairs each row with autoregressive decoding round by round."""
    from adapt.bench.interleave import StepClock
    from adapt.bench.speed_runners import AdaptRunner, drive

    target, drafter = make_tiny_pair(tmp_path)
    out = tmp_path / "out"
    assert main(["bench", "speed", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
                 "--batch-sizes", "2", "--num-prompts", "5", "--max-tokens", "6", "--prompt-len", "16",
                 "--rounds", "2", "--threads", "1", "--rows", f"adapt-ar,adapt-policy,adapt-k2,hf,{VARIANT}",
                 "--interleave", "--refill", "--length-spread", "0.5", "--no-profile", "--out", str(out)]) == 0
    rep = json.loads((out / "speed.json").read_text())
    assert rep["config"]["interleave"] and rep["config"]["refill"] and rep["config"]["length_spread"] == 0.5
    assert "engine_of" not in json.dumps(rep["config"]["warm_up"])  # every row its own engine
    by = {e["row"]: e for e in rep["results"]}
    assert "--length-spread" in by["hf"]["skipped"] or "--refill" in by["hf"]["skipped"]
    from adapt.replay import spread_length

    lengths = [spread_length(6, 0.5, i) for i in range(5)]  # 3..9 tokens, mean 6
    assert len(set(lengths)) > 2 and min(lengths) >= 3 and max(lengths) <= 9
    for row in ("adapt-ar", "adapt-policy", "adapt-k2", VARIANT):
        assert by[row]["tokens"] == sum(lengths) and len(by[row]["tokens_per_s_samples"]) == 2
    assert by[VARIANT]["label"] == "adapt, adaptive policy (closed_model=weight, hold_max=0)"
    paired = rep["ratios"]["paired"]
    assert set(paired) == {"adapt-policy/adapt-ar", "adapt-k2/adapt-ar", f"{VARIANT}/adapt-ar"}
    assert len(paired["adapt-k2/adapt-ar"]["2"]["rounds"]) == 2
    assert "step by step" in (out / "speed.md").read_text()

    # refill keeps exactly `batch` requests in flight; turns split the time between the sessions
    runners = [AdaptRunner(n, n, target, drafter, "float32", 2, 64, draft_len=k) for n, k in (("a", 0), ("b", 2))]
    for r in runners:
        r.start()
    seen = []
    original = runners[0].engine.step

    def step():
        seen.append(len(runners[0].engine.running) + len(runners[0].engine.waiting))
        return original()

    runners[0].engine.step = step
    prompts = [[1 + i, 2, 3, 4] for i in range(5)]
    clocks = {r.name: StepClock() for r in runners}
    runs = drive({r.name: r.session(prompts, 2, 4, clock=clocks[r.name], refill=True) for r in runners})
    assert max(seen) == 2 and seen.count(2) >= 3
    assert runs["a"].outputs == runs["b"].outputs  # greedy: drafts never change the tokens
    for r in runners:
        assert 0 < runs[r.name].seconds <= clocks[r.name]() < runs[r.name].seconds + 1e-3
        assert r.engine.clock is not clocks[r.name]  # the engine's own clock is back


def test_policy_variant_rows_set_the_policy(tmp_path):
    from adapt.bench.speed import policy_variant
    from adapt.bench.speed_runners import AdaptRunner

    assert policy_variant(VARIANT) == {"closed_model": "weight", "hold_max": 0}
    assert policy_variant("adapt-policy") is None and policy_variant("adapt-k2") is None
    target, drafter = make_tiny_pair(tmp_path)
    runner = AdaptRunner("v", "v", target, drafter, "float32", 2, 64, policy="adaptive",
                         settings=policy_variant(VARIANT))
    runner.start()
    assert runner.decisions.closed_model == "weight" and runner.decisions.hold_max == 0
    runner.close()


def test_dtype_auto_is_the_measured_choice_and_the_report_names_the_machine(tmp_path):
    """`--dtype auto` (the default) is the dtype `adapt generate` and `adapt serve` measure fastest
    on this machine (adapt/dtype_choice.py); the report keeps the choice with its timings and the
    CPU's model, flags and effective capability."""
    from adapt.profile_cache import cpu_facts

    target, drafter = make_tiny_pair(tmp_path)
    out = tmp_path / "out"
    assert main(["bench", "speed", "--target", str(target), "--drafter", str(drafter), "--batch-sizes", "1",
                 "--num-prompts", "1", "--max-tokens", "4", "--prompt-len", "16", "--rounds", "1", "--threads", "1",
                 "--rows", "adapt-ar", "--no-profile", "--out", str(out)]) == 0
    rep = json.loads((out / "speed.json").read_text())
    choice = rep["config"]["dtype_choice"]
    assert choice["dtype"] == rep["config"]["dtype"] in ("bfloat16", "float32")
    assert choice["reason"].startswith(f"measured on this machine, {choice['dtype']} is faster")
    assert set(choice["ms"]) == {"bfloat16", "float32"} and all(m["one"] > 0 for m in choice["ms"].values())
    assert rep["machine"]["cpu"] == json.loads(json.dumps(cpu_facts()))
    assert f"dtype auto: {choice['reason']}" in (out / "speed.md").read_text()


def test_a_mixed_workload_is_reported_per_class(tmp_path):
    """`--workload` with several prompt classes (mixed: chat, code, edit; longdoc-chat): every
    row's rate and τ per class, from the groups whose prompts are all of that class, and the
    adaptive policy per class against the fastest static row and over `adapt-ar` round by round."""
    out = tmp_path / "out"
    assert main(["bench", "speed", "--pair", "demo", "--workload", "mixed", "--dtype", "float32", "--batch-sizes", "1",
                 "--num-prompts", "3", "--max-tokens", "4", "--rounds", "2", "--threads", "1",
                 "--rows", "adapt-ar,adapt-policy,adapt-k2,adapt-suffix-drafter,hf", "--interleave", "--no-profile",
                 "--out", str(out)]) == 0
    rep = json.loads((out / "speed.json").read_text())
    assert rep["config"]["prompt_classes"] == ["chat", "code", "edit"]
    assert {e["row"] for e in rep["results"]} == {"adapt-ar", "adapt-policy", "adapt-k2", "adapt-suffix-drafter", "hf"}
    for e in rep["results"]:
        assert set(e["per_class"]) == {"chat", "code", "edit"}, e["row"]
        for v in e["per_class"].values():
            assert len(v["tokens_per_s_samples"]) == 2 and v["tokens_per_s"] > 0 and v["tau"] >= 1.0
    by_class = rep["ratios"]["per_class"]
    assert set(by_class) == {"chat", "code", "edit"}
    for cls, per_batch in by_class.items():
        entry = per_batch["1"]
        assert entry["best_static"] in ("adapt-ar", "adapt-k2", "adapt-suffix-drafter") and entry["ratio"] > 0
        assert len(entry["over_ar"]["rounds"]) == 2
    assert "Per prompt class" in (out / "speed.md").read_text()


def test_per_class_counts_only_groups_of_one_class():
    """At batch 2 a group of a chat and a code prompt is no class's: only whole-class groups count,
    and τ is tokens per sequence per pass, as for the whole run."""
    from adapt.bench.speed import per_class
    from adapt.bench.speed_runners import Run

    classes = ["chat", "chat", "chat", "code", "code", "code"]
    outputs = [[1] * 4] * 6
    run = Run(24, 6.0, 9, 6, 3, outputs, group_seconds=[1.0, 2.0, 3.0], group_passes=[2, 3, 4])
    got = per_class([run], classes, 2)
    assert got["chat"] == {"tokens_per_s": 8.0, "tokens_per_s_samples": [8.0], "tau": 2.0}    # group 0: 8 tokens / 1 s
    assert got["code"] == {"tokens_per_s": round(8 / 3, 2), "tokens_per_s_samples": [round(8 / 3, 2)], "tau": 1.0}
    assert per_class([run], None, 2) is None
    assert per_class([Run(24, 6.0, 9, 6, 3, outputs)], classes, 2) is None  # no per-group times (--refill)


def test_interleaved_rows_of_one_engine_kind_decode_on_each_others_engines_round_by_round():
    """`rotate_engines`: round r gives the i-th runner of a kind the (i + r)-th one's loaded
    engine; a runner of another kind (no drafter) keeps its own."""
    from adapt.bench.speed_runners import AdaptRunner, rotate_engines

    def runner(name, drafter):
        r = AdaptRunner(name, name, Path("target"), drafter, "bfloat16", 1, 64)
        r.loaded = r.engine = object()
        return r

    a, b, c = (runner(n, Path("drafter")) for n in "abc")
    suffix = runner("suffix", None)
    rows = [a, suffix, b, c]
    own = [r.loaded for r in rows]
    rotate_engines(rows, 1)
    assert [r.engine for r in rows] == [b.loaded, suffix.loaded, c.loaded, a.loaded]
    rotate_engines(rows, 2)
    assert [r.engine for r in rows] == [c.loaded, suffix.loaded, a.loaded, b.loaded]
    rotate_engines(rows, 3)
    assert [r.engine for r in rows] == own
