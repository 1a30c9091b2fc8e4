"""Interleaved runs: several live runs (`adapt.bench.live.LiveRun`) taking turns step by step on one
machine, each timed by its own clock.

Why: this machine's speed drifts. The same matmul work, timed once a second, took 180–329 ms,
and one policy's two runs at the same load, minutes apart, differed by up to 20 %.
Runs made one after another compare a policy with the machine's mood; a 3 % tuning change cannot
be seen. Here every policy gets its own engine (same pair, same config, own model copy and
caches) and the runs advance in turns: one engine step of the first run, one of the second, …,
round after round, so that all of them meet the same drift within a fraction of a second.

Each engine reads time from a `StepClock` that runs only while that engine's own run ticks (its
admissions, prefills, decisions, drafts and verifications): a run's goodput, TPOT, TTFT and the
policy's lateness are what they would have been had it run alone on a machine at that moment's
speed. What the turns cannot share is each step's own noise (p10–p90 ±20 % step to step here);
it averages out over the hundreds of steps of a run.

Costs: one model copy per run in memory, and the engines' steps evict each other's data from
the CPU's caches (the weights are streamed from memory every step anyway; a KV cache of a few MB
may be cold where it would have been warm).
"""

from __future__ import annotations

import dataclasses
import time

from adapt.replay import Scenario


class StepClock:
    """A monotonic clock (seconds) that advances only between `resume()` and `pause()`."""

    def __init__(self):
        self.banked = 0.0       # seconds run before the current turn
        self.since = None       # perf_counter at the current turn's start (None: paused)

    def __call__(self) -> float:
        return self.banked + (time.perf_counter() - self.since if self.since is not None else 0.0)

    def resume(self) -> None:
        if self.since is None:
            self.since = time.perf_counter()

    def pause(self) -> None:
        if self.since is not None:
            self.banked += time.perf_counter() - self.since
            self.since = None


def engine_copies(engine, count: int) -> list:
    """``engine`` and ``count − 1`` new engines of its config (each loads its own model copy)."""
    from workers.engine import Engine

    return [engine] + [Engine(dataclasses.replace(engine.config)) for _ in range(count - 1)]


def rotated_engines(engines: dict, alike: list, turn: int) -> dict:
    """``engines`` ({name: engine}) with the names in ``alike`` (whose engines are loaded alike,
    e.g. by `engine_copies`) on each other's engines, shifted by ``turn``: in round r of an
    interleaved run the i-th of them decodes on the (i + r)-th one's engine. Two engines loaded
    alike in one process decode a few per cent apart for the whole run (results/ab/smollm2/engine-offset/:
    one of three identical rows at 0.960–0.972x the others in every round); over rounds that rotate
    the engines that offset falls on every run alike instead of on one."""
    out = dict(engines)
    for i, name in enumerate(alike):
        out[name] = engines[alike[(i + turn) % len(alike)]]
    return out


def scenario_instance(prompts: list | None, round_index: int, requests: int, seed: int = 0,
                      vary: bool = True) -> tuple[list | None, int]:
    """(prompts, seed) that round ``round_index`` of a benchmark serves.

    A scenario's requests take prompt ``i mod len(prompts)`` and seed their sampled rows'
    generators from ``seed``; a round that serves the same prompts and seed as the others repeats
    one **instance** of the scenario: its rounds replicate the machine's noise, not the scenario's
    (which requests overlap, what each copies, what sampled rows draw). With ``vary`` round ``r``
    serves its own instance: the prompt list rotated by ``r · requests`` (the next unused prompts
    first) and seed ``seed + r``; round 0 is the fixed instance. Measured (SmolLM2, mixed, two
    requests): the adaptive policy against static suffix drafting was 0.957× on round 0's
    instance and 1.035–1.053× on three others."""
    if not vary or not prompts:
        return prompts, seed
    shift = (round_index * requests) % len(prompts)
    return prompts[shift:] + prompts[:shift], seed + round_index


def run_round(engines: list, policies: list, warm: Scenario, scenario: Scenario, prompts: list[list[int]], *,
              interleave: bool, seed: int = 0) -> list[dict]:
    """One round of a benchmark: each policy warms up on its engine (``warm``, not recorded), then
    serves ``scenario``: one policy after another (``engines`` may then repeat one engine), or
    with ``interleave`` all side by side (`run_interleaved`). Returns each run's metrics, in order."""
    from adapt.bench.live import run_live

    measured = []
    for engine, policy in zip(engines, policies):
        run_live(engine, policy, warm, prompts, seed=seed)
        if not interleave:
            measured.append(run_live(engine, policy, scenario, prompts, seed=seed))
    return run_interleaved(engines, policies, scenario, prompts, seed=seed) if interleave else measured


def run_interleaved(engines: list, policies: list, scenario: Scenario, prompts: list[list[int]], *,
                    seed: int = 0, trace_sinks: list | None = None) -> list[dict]:
    """Serve ``scenario`` through ``engines[i]`` with ``policies[i]`` deciding, all runs taking
    turns one engine step at a time; returns each run's `LiveRun.metrics()`, in order.

    Every engine must be a distinct `Engine` (each run holds its engine's requests and clock);
    each gets a fresh `StepClock` for the run and its own clock back afterwards. A run that
    finishes early stops taking turns; the others go on. ``trace_sinks``: one trace sink (or None)
    per run (workers/traces.py)."""
    from adapt.bench.live import LiveRun

    if len({id(e) for e in engines}) != len(engines) or len(engines) != len(policies):
        raise ValueError("run_interleaved: one distinct engine per policy")
    clocks = [StepClock() for _ in engines]
    saved = [e.clock for e in engines]
    try:
        runs = []
        for engine, policy, clock, sink in zip(engines, policies, clocks, trace_sinks or [None] * len(engines)):
            engine.clock = clock
            clock.resume()
            runs.append(LiveRun(engine, policy, scenario, prompts, seed=seed, trace_sink=sink))
            clock.pause()
        while not all(r.done for r in runs):
            for run, clock in zip(runs, clocks):
                if run.done:
                    continue
                clock.resume()
                run.tick()
                clock.pause()
        return [r.metrics() for r in runs]
    finally:
        for engine, clock in zip(engines, saved):
            engine.clock = clock
