"""Closed batches: the engine tells its decision maker when no request waits and none will join
(`Engine.closed`, `RowState.closed`), and the adaptive policy then values tokens by the step time
they save (`closed_model = "time"`, `AdaptivePolicy._closed_time`), or the tokens of rows ahead
of the batch's tail at `closed_weight` (`"weight"`, `AdaptivePolicy._tail`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policies.adaptive import AdaptivePolicy
from policies.defaults import LinearCost
from tests.tiny_models import make_tiny_target, single_thread
from workers.decisions import RowState
from workers.draft_sources import NONE_CODE, SUFFIX_CODE
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def copy_rows(remaining: list[int], closed: bool) -> RowState:
    """Two rows with the same long confident copy (match 32, 8 tokens), packed verification."""
    B = len(remaining)
    return RowState(request_ids=[f"r{i}" for i in range(B)], knobs=[DecodeKnobs()] * B, targets=[None] * B,
                    position=torch.full((B,), 100), generated=torch.full((B,), 10), temperature=torch.zeros(B),
                    recent_accept=torch.full((B,), -1.0), tvd_spent=torch.zeros(B),
                    remaining=torch.tensor(remaining), batch_size=B, block_size=16, has_drafter=False,
                    suffix_len=torch.full((B,), 8), suffix_score=torch.full((B,), 7.0),
                    suffix_match=torch.full((B,), 32), packed_verify=True, closed=closed)


def policy(**settings) -> AdaptivePolicy:
    # every verified position costs 4 ms on top of a 10 ms step: a copy pays only at full worth
    return AdaptivePolicy(cost=LinearCost(overhead_ms=10.0, per_token_ms=4.0), online_cost=False, hold_max=0,
                          suffix_recalibrate=False, **settings)


def test_a_closed_batch_drafts_for_its_tail_and_not_for_rows_ahead():
    """``closed_model = "weight"``. Row 0 has 50 tokens left, row 1 is 20 ahead. Open (a freed slot would be taken), both
    copy; closed, the row ahead does not (its copy would only bring its exit forward) and the
    tail row still does; with ``closed_weight`` 1 a closed batch is decided as an open one."""
    open_steps = policy(closed_model="weight").before_draft(copy_rows([50, 30], closed=False))
    assert open_steps.source.tolist() == [SUFFIX_CODE, SUFFIX_CODE]
    p = policy(closed_model="weight")
    assert p.before_draft(copy_rows([50, 30], closed=True)).source.tolist() == [SUFFIX_CODE, NONE_CODE]
    assert p.weights(p._ctx(copy_rows([50, 30], closed=True), torch.device("cpu"))).tolist() == pytest.approx([1.0, 0.3])
    off = policy(closed_model="weight", closed_weight=1.0)
    assert off.before_draft(copy_rows([50, 30], closed=True)).source.tolist() == [SUFFIX_CODE, SUFFIX_CODE]
    # rows level with each other are all the tail: decided as in an open batch
    assert policy(closed_model="weight").before_draft(copy_rows([40, 40], closed=True)).source.tolist() == [SUFFIX_CODE, SUFFIX_CODE]


def test_tail_weights_and_setting_checks():
    p = policy(closed_model="weight", closed_weight=0.5)
    rows = copy_rows([7, 9, 9, 3], closed=True)
    from policies.adaptive.objective import tail

    assert tail(rows, p.closed_weight).tolist() == [0.5, 1.0, 1.0, 0.5]
    assert tail(copy_rows([4], closed=True), p.closed_weight).tolist() == [1.0]  # one row is always the tail
    assert "tail" not in p._ctx(dataclasses.replace(rows, closed=False), torch.device("cpu"))
    with pytest.raises(ValueError, match="closed_weight"):
        AdaptivePolicy(closed_weight=1.5)
    with pytest.raises(ValueError, match="closed_weight"):
        AdaptivePolicy(closed_weight=-0.1)


def test_the_engine_reports_a_closed_batch_only_when_nothing_waits(tmp_path):
    target = make_tiny_target(tmp_path / "t", vocab=16, seed=4)
    engine = Engine(EngineConfig(target=str(target), drafter=None, dtype="float32", max_batch=1, max_len=64))
    engine.add_request("a", [3, 4, 5, 3], SamplingParams(max_tokens=6))
    engine.add_request("b", [9, 9, 2, 7], SamplingParams(max_tokens=6))
    engine.step()
    assert not engine._row_state().closed  # by default a batch is open
    engine.closed = True
    assert engine.waiting and not engine._row_state().closed  # "b" waits for a slot: still open
    while engine.waiting:
        engine.step()
    assert engine._row_state().closed  # nothing waits and the caller promised nothing joins


def test_the_time_model_values_tokens_by_the_step_time_they_save():
    """``closed_model = "time"``: with the test cost (a plain step of B rows 10 + 4·B ms: δ = 4 ms
    per row, T0 = 10 ms), a row's extra token saves δ, the unique last row's also saves T0.
    Two rows level at the end (neither alone shortens the batch) do not copy, where the weight
    model copies for both; the unique last row copies and the row ahead does not; an open batch
    is decided as before."""
    p = policy(closed_model="time")
    extra, base = p.closed_time(copy_rows([50, 30], closed=True))
    T_B = 18.0
    assert extra.tolist() == pytest.approx([2 * (4 + 10) / T_B, 2 * 4 / T_B]) and base.tolist() == [1.0, 1.0]
    extra, _ = p.closed_time(copy_rows([31, 30], closed=True))  # ahead by one token: half the step's share
    assert extra.tolist() == pytest.approx([2 * (4 + 5) / T_B, 2 * 4 / T_B])
    assert p.closed_time(copy_rows([40, 40], closed=True))[0].tolist() == pytest.approx([8 / T_B, 8 / T_B])
    assert policy(closed_model="weight").before_draft(copy_rows([40, 40], closed=True)).source.tolist() == [SUFFIX_CODE, SUFFIX_CODE]
    assert policy(closed_model="time").before_draft(copy_rows([40, 40], closed=True)).source.tolist() == [NONE_CODE, NONE_CODE]
    assert policy(closed_model="time").before_draft(copy_rows([50, 30], closed=True)).source.tolist() == [SUFFIX_CODE, NONE_CODE]
    assert policy(closed_model="time").before_draft(copy_rows([40, 40], closed=False)).source.tolist() == [SUFFIX_CODE, SUFFIX_CODE]
    ctx = p._ctx(copy_rows([50, 30], closed=True), torch.device("cpu"))
    assert p.base_weights(ctx).tolist() == [1.0, 1.0] and p.weights(ctx).tolist() == pytest.approx(extra_of([50, 30]))
    with pytest.raises(ValueError, match="closed_model"):
        AdaptivePolicy(closed_model="tail")


def test_the_time_model_reads_the_measured_plain_step():
    """The cost tables are indexed by positions and miss what grows with rows (attention over
    each row's context): ``T_B`` is the measured plain step of the latest B-row steps
    (`plain_ms`), ``T_1`` the table's one-row step plus its measured residual."""
    p = policy(closed_model="time")
    p.costs.plain_ms, p.costs.batch = 30.0, 2
    p.costs.step_residual[("plain", 1)] = 2.0  # T_1 = 14 + 2 ms: δ = 30 − 16 = 14 ms, T0 = 30 − 2·14 = 2 ms
    extra, base = p.closed_time(copy_rows([50, 30], closed=True))
    assert extra.tolist() == pytest.approx([2 * (14 + 2) / 30, 2 * 14 / 30]) and base.tolist() == [1.0, 1.0]
    p.costs.batch = 3  # the latest step had another batch size: back to the tables (T_2 = 18 ms)
    assert p.closed_time(copy_rows([50, 30], closed=True))[0].tolist() == pytest.approx([2 * (2 + 14) / 18, 2 * 2 / 18])


def extra_of(remaining: list[int]) -> list[float]:
    return policy(closed_model="time").closed_time(copy_rows(remaining, closed=True))[0].tolist()
