"""SLA-aware admission (workers/admission.py): which waiting requests a step prefills, and the
engine deferring a prefill while it would push a running row off its TPOT target."""

from __future__ import annotations

import pytest
import torch

from adapt.targets import RequestTargets
from tests.tiny_models import make_tiny_pair, single_thread
from workers.admission import RowClock, Waiting, admit_count, prefill_ms, stall_budget_ms
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, EngineInputError, SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def test_stall_budget_is_the_smallest_slack_of_the_protected_rows():
    rows = [RowClock(100.0, 800.0, 10, 5),    # pace 80: slack (100 − 80) · 15 = 300 ms
            RowClock(90.0, 850.0, 10, 2),     # pace 85: slack 5 · 12 = 60 ms
            RowClock(None, 100.0, 10, 1),     # no target: never protected
            RowClock(50.0, 800.0, 10, 1),     # off target already (pace 80 > 50)
            RowClock(100.0, 200.0, 2, 1),     # too few tokens to read its pace
            RowClock(100.0, 500.0, 10, 100)]  # 100 tokens at 50 ms: 5 s to go, past a 1 s wait
    assert stall_budget_ms(rows, 1000.0) == pytest.approx(60.0)
    assert stall_budget_ms(rows[2:], 1000.0) == float("inf")
    # a longer bound protects the far row too: slack (100 − 50) · 110 = 5500, not the minimum
    assert stall_budget_ms(rows, 10_000.0) == pytest.approx(60.0)
    assert stall_budget_ms(rows[5:], 10_000.0) == pytest.approx(5500.0)


def test_prefill_estimate_counts_padding_only_without_packing():
    assert prefill_ms([10, 30], 2.0, packed=True) == 80.0
    assert prefill_ms([10, 30], 2.0, packed=False) == 120.0
    assert prefill_ms([], 2.0, packed=True) == 0.0


def test_admit_count_defers_what_does_not_fit_the_slack_and_never_past_a_deadline():
    tight = [RowClock(90.0, 850.0, 10, 2)]  # pace 85: slack 5 · 12 = 60 ms
    waiting = [Waiting(20, 0.0), Waiting(20, 0.0), Waiting(20, 0.0)]
    # 1 ms per token: one prompt (20 ms) and two (40) fit within 60 ms, three (60) just do
    assert admit_count(waiting, tight, 3, mode="sla", ms_per_token=1.0) == 3
    assert admit_count(waiting, tight, 3, mode="sla", ms_per_token=1.5) == 2
    assert admit_count(waiting, tight, 3, mode="sla", ms_per_token=4.0) == 0
    assert admit_count(waiting, tight, 1, mode="sla", ms_per_token=1.0) == 1  # the free slots bound it
    # "all", or no estimate yet: every request there is a slot for
    assert admit_count(waiting, tight, 3, mode="all", ms_per_token=4.0) == 3
    assert admit_count(waiting, tight, 2, mode="sla", ms_per_token=None) == 2
    # a request whose wait is up goes, and every one before it (FIFO)
    late = [Waiting(20, 100.0), Waiting(20, 1000.0), Waiting(20, 0.0)]
    assert admit_count(late, tight, 3, mode="sla", ms_per_token=4.0, max_wait_ms=1000.0) == 2
    # a TTFT target is a deadline too: 300 ms waited + 80 ms prefill reaches a 350 ms target
    ttft = [Waiting(20, 300.0, ttft_ms=350.0)]
    assert admit_count(ttft, tight, 1, mode="sla", ms_per_token=4.0) == 1
    assert admit_count([Waiting(20, 100.0, ttft_ms=350.0)], tight, 1, mode="sla", ms_per_token=4.0) == 0
    with pytest.raises(ValueError, match="admission"):
        admit_count(waiting, tight, 3, mode="fifo")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"), vocab=64, seed=5)


def _serve(engine, first_tokens: int, second_tokens: int):
    """A row with a (loose) TPOT target decodes; once it has emitted 6 tokens a second request
    arrives. Returns the step the second request got its first token, the step the first row
    finished, and both requests' tokens."""
    engine.add_request("a", [3, 5, 7, 9], SamplingParams(max_tokens=first_tokens, ignore_eos=True),
                       DecodeKnobs(steps=0, draft_len=0), targets=RequestTargets(tpot_ms=1e6))
    step, got, finished, added = 0, None, None, False
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.request_id == "b" and got is None:
                got = step
            if out.request_id == "a" and out.finished:
                finished = step
        if not added and len(tokens["a"]) >= 6:
            engine.add_request("b", [4, 6, 8], SamplingParams(max_tokens=second_tokens, ignore_eos=True),
                               DecodeKnobs(steps=0, draft_len=0))
            added = True
    return got, finished, tokens


def test_engine_defers_a_prefill_that_would_push_a_row_off_its_target(pair):
    target, drafter = pair
    outs = {}
    for mode, wait_ms in (("all", 1e7), ("sla", 1e7), ("sla", 0.0)):
        engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", device="cpu", max_batch=4,
                                     admission=mode, admission_max_wait_ms=wait_ms))
        # a prefill estimated at 1e9 ms per token fits no row's slack
        engine.prefill_ms_per_token = 1e9
        got, finished, tokens = _serve(engine, 12, 5)
        outs[(mode, wait_ms)] = (got, finished, tokens, engine.deferred_steps)
    got, finished, tokens, deferred = outs[("all", 1e7)]
    assert got < finished and deferred == 0  # joins at once, while "a" still decodes
    got, finished, _, deferred = outs[("sla", 1e7)]
    assert got == finished and deferred > 0  # waits until "a" is done (its last step frees the slot)
    got, finished, _, deferred = outs[("sla", 0.0)]
    assert got < finished and deferred == 0  # a zero wait bound defers no one
    # admission changes when a request runs, never what it gets
    for key in outs:
        assert outs[key][2] == outs[("all", 1e7)][2]


def test_engine_checks_its_admission_options(pair):
    target, drafter = pair
    with pytest.raises(EngineInputError, match="admission must be one of"):
        Engine(EngineConfig(target=target, drafter=drafter, device="cpu", admission="fifo"))
    with pytest.raises(EngineInputError, match="admission_max_wait_ms"):
        Engine(EngineConfig(target=target, drafter=drafter, device="cpu", admission="sla",
                            admission_max_wait_ms=-1.0))


def test_sla_admission_without_an_estimate_admits_and_then_measures(pair):
    """The first prefill has no estimate to defer by; it gives the engine one."""
    target, drafter = pair
    engine = Engine(EngineConfig(target=target, drafter=drafter, device="cpu", admission="sla"))
    assert engine.prefill_ms_per_token is None
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.prefill_ms_per_token is not None and engine.prefill_ms_per_token > 0
    assert torch.isfinite(torch.tensor(engine.prefill_ms_per_token))
