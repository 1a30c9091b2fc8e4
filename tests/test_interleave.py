"""adapt/bench/interleave.py: a clock that runs only during its engine's turns, and runs that take
turns step by step on the demo pair."""

from __future__ import annotations

import time

import pytest

from adapt.bench.live import KnobsBaseline, run_live
from adapt.bench.interleave import StepClock, run_interleaved, scenario_instance
from adapt.replay import Scenario, make_mix
from workers.traces import ListTraceSink


def test_step_clock_stands_still_while_paused():
    clock = StepClock()
    assert clock() == 0.0
    time.sleep(0.01)
    assert clock() == 0.0  # never resumed
    clock.resume()
    time.sleep(0.02)
    clock.pause()
    ran = clock()
    assert ran >= 0.02
    time.sleep(0.02)
    assert clock() == ran  # paused: no time passes
    clock.resume()
    assert clock() >= ran
    clock.pause()


def _engine():
    from workers.engine import Engine, EngineConfig

    return Engine(EngineConfig(max_batch=4, max_len=96, compile=False))


def test_interleaved_runs_serve_every_request_on_their_own_clocks():
    """Two engines, `ar` and `suffix`, take turns: each serves the whole scenario, emits what it
    emits alone (greedy: the same tokens per request), is timed only by its own turns (together
    under the elapsed time) and gets its own clock back."""
    import random

    random.seed(0)
    prompts = [[random.randrange(3, 500) for _ in range(12)] for _ in range(4)]
    mix = make_mix(6, 50.0, 200.0, max_tokens=10)
    scenario = Scenario("mix", 2, mix)
    engines = [_engine(), _engine()]
    policies = [KnobsBaseline("ar", draft_len=0), KnobsBaseline("suffix", source="suffix", draft_len=8)]
    sinks = [ListTraceSink(), None]
    t0 = time.perf_counter()
    both = run_interleaved(engines, policies, scenario, prompts, trace_sinks=sinks)
    elapsed = time.perf_counter() - t0
    # the first run is traced: one record per row per decode step, every request's
    assert {r["request_id"].rsplit("-", 1)[1] for r in sinks[0].records} == {str(i) for i in range(len(mix))}
    assert all(e.trace_sink is None for e in engines[1:])
    assert all(e.clock is time.perf_counter for e in engines)
    alone = run_live(engines[0], KnobsBaseline("ar", draft_len=0), scenario, prompts)
    for m in both:
        assert m["requests"] == len(mix) and m["tokens"] == alone["tokens"]
        assert m["goodput_tok_s"] > 0 and 0.0 <= m["sla_attainment"] <= 1.0
        assert len(m["per_request"]) == len(mix)
    assert both[0]["wall_s"] + both[1]["wall_s"] <= elapsed
    assert both[1]["source_share"]["suffix"] >= 0.0 and both[0]["source_share"]["suffix"] == 0.0


def test_interleaving_needs_one_engine_per_policy():
    engine = _engine()
    with pytest.raises(ValueError, match="one distinct engine per policy"):
        run_interleaved([engine, engine], [KnobsBaseline("ar", draft_len=0)] * 2, Scenario("mix", 1, []), [[5, 6]])


def test_each_round_may_serve_its_own_instance_of_the_scenario():
    """Round 0 serves the prompts and seed as given; round r the prompt list rotated by r times the
    requests (the next unused prompts first, wrapping around) and seed + r; without ``vary`` every
    round serves round 0's instance."""
    prompts = [[i] for i in range(10)]
    assert scenario_instance(prompts, 0, 4, seed=7) == (prompts, 7)
    served, seed = scenario_instance(prompts, 1, 4, seed=7)
    assert [p[0] for p in served] == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3] and seed == 8
    served, seed = scenario_instance(prompts, 3, 4, seed=7)
    assert [p[0] for p in served[:4]] == [2, 3, 4, 5] and seed == 10  # 12 mod 10
    assert scenario_instance(prompts, 2, 4, seed=7, vary=False) == (prompts, 7)
    assert scenario_instance(None, 2, 4) == (None, 0)  # no tokenizer: no prompt list to rotate


def test_runs_of_engines_loaded_alike_take_each_others_engines_round_by_round():
    """`rotated_engines`: round r lends the i-th name of ``alike`` the (i + r)-th one's engine;
    a name outside ``alike`` (an engine of its own config) keeps its own."""
    from adapt.bench.interleave import rotated_engines

    engines = {"ar": "e0", "adaptive": "e1", "suffix": "e2", "variant": "own"}
    alike = ["ar", "adaptive", "suffix"]
    assert rotated_engines(engines, alike, 0) == engines
    assert rotated_engines(engines, alike, 1) == {"ar": "e1", "adaptive": "e2", "suffix": "e0", "variant": "own"}
    assert rotated_engines(engines, alike, 5) == {"ar": "e2", "adaptive": "e0", "suffix": "e1", "variant": "own"}
    assert engines == {"ar": "e0", "adaptive": "e1", "suffix": "e2", "variant": "own"}  # not changed in place
