"""Step-cost model: interpolation, profiling, fitting from trace timings, online correction."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from adapt.cost_model import CostModel, Table
from adapt.trace_data import TraceTable
from tests.policy_fixtures import synthetic_records


def test_profile_token_grid_times_every_count_up_to_eight_then_coarser():
    from adapt.cost_model import profile_token_grid

    assert profile_token_grid(17) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16]  # one row of a 16-token block
    assert profile_token_grid(4 * 17)[-3:] == [24, 32, 64] and profile_token_grid(0) == [1, 2]


def test_table_interpolates_and_extrapolates():
    t = Table([1, 8, 64], [5.0, 6.0, 20.0])
    x = torch.tensor([1.0, 4.5, 8.0, 36.0, 64.0, 120.0])
    torch.testing.assert_close(t(x), torch.tensor([5.0, 5.5, 6.0, 13.0, 20.0, 34.0]))
    assert t(0.0).item() == pytest.approx(5.0 - 1.0 / 7.0)
    # the scalar fast path agrees with the tensor path
    for v in (0.5, 3.0, 50.0, 500.0):
        assert t.at(v) == pytest.approx(float(t(v)), rel=1e-6)
    assert t(torch.tensor([2, 9])).dtype.is_floating_point


@pytest.mark.parametrize("xs,ys,msg", [([1], [1], "two"), ([1, 1], [1, 2], "increase"),
                                       ([1, 2], [1, -1], "non-negative"), ([1, 2], [1, float("nan")], "finite")])
def test_table_validation(xs, ys, msg):
    with pytest.raises(ValueError, match=msg):
        Table(xs, ys, "cost.verify")


def test_step_ms_adds_draft_passes():
    c = CostModel(Table([1, 100], [10, 20]), Table([1, 11], [1, 2]), overhead_ms=1.0)
    assert float(c.step_ms(50.5)) == pytest.approx(1 + 15)
    # two passes: 11 rows then 1 row
    assert float(c.step_ms(50.5, torch.tensor([11, 1]))) == pytest.approx(1 + 15 + 2 + 1)
    assert c.step_ms_at(50.5, [11, 1]) == pytest.approx(19.0)
    torch.testing.assert_close(CostModel.rows_per_pass(torch.tensor([0, 1, 2, 2]), 3), torch.tensor([3, 2, 0]))
    vec = c.step_ms(torch.tensor([1.0, 100.0]))
    assert vec.shape == (2,)


def test_profile_times_the_callables():
    def verify_fn(n):  # ~0.02 ms per token
        time.sleep(2e-5 * n)

    def draft_fn(rows):
        time.sleep(1e-4 * rows)

    c = CostModel.profile(verify_fn, draft_fn, token_grid=(1, 50, 200), row_grid=(1, 20), repeats=2)
    ys = c.verify.ys.tolist()
    assert ys == sorted(ys) and ys[-1] >= 4.0  # 200 tokens sleep 4 ms
    assert c.draft_pass.at(20) >= 2.0 and c.source == "profile"


def test_profile_sweeps_the_grid_so_a_slow_spell_does_not_inflate_one_point():
    calls = []

    def verify_fn(n):  # 1 ms, except calls 12..17: a slow spell (6 ms) as long as one point's repeats
        calls.append(n)
        time.sleep(6e-3 if 12 <= len(calls) - 1 <= 17 else 1e-3)

    c = CostModel.profile(verify_fn, None, token_grid=(1, 2, 3), repeats=5)
    assert len(calls) == 3 + 3 * 5  # a warm-up each, then five sweeps
    assert all(sorted(calls[i:i + 3]) == [1, 2, 3] for i in range(3, 18, 3))  # a sweep times every point once
    assert c.verify.ys.max() < 3.5  # timed point after point, the last point's median would be ~6 ms


def test_profile_sweeps_in_a_new_order_each_time():
    calls = []
    CostModel.profile(calls.append, None, token_grid=(1, 2, 3, 4, 5, 6), repeats=6)
    sweeps = [tuple(calls[i:i + 6]) for i in range(6, len(calls), 6)]
    assert all(sorted(s) == [1, 2, 3, 4, 5, 6] for s in sweeps) and len(sweeps) == 6
    assert len(set(sweeps)) > 1  # a fixed order would put the same point after the other model's calls
    again = []
    CostModel.profile(again.append, None, token_grid=(1, 2, 3, 4, 5, 6), repeats=6)
    assert again == calls  # the order is seeded: two profiles of one engine time alike
    fixed = []
    CostModel.profile(fixed.append, None, token_grid=(1, 2, 3), repeats=2, shuffle_seed=None)
    assert fixed == [1, 2, 3] * 3


def test_fit_traces_recovers_verify_and_draft_costs():
    rng = np.random.default_rng(0)
    records = []
    for step in range(300):
        b = int(rng.integers(1, 17))
        s = int(rng.integers(1, 3))
        tokens = b * int(rng.integers(1, 10))
        verify = 4.0 + 0.05 * tokens
        draft = s * (1.0 + 0.2 * b)
        for r in range(b):
            records.append({"request_id": f"r{r}", "step": step, "steps": s, "draft_len": 0, "rule": 0,
                             "temperature": 0.0, "accepted": 0, "accept_flags": [], "batch_size": b,
                             "num_tokens": tokens, "draft_ms": draft, "verify_ms": verify,
                             "step_ms": verify + draft + 0.5})
    c = CostModel.fit_traces(TraceTable.from_records(records))
    assert c.verify.at(40) == pytest.approx(6.0, rel=0.1)
    assert c.draft_pass.at(10) == pytest.approx(3.0, rel=0.15)
    assert c.overhead_ms == pytest.approx(0.5, abs=0.2)


def test_online_correction_moves_toward_measurements():
    c = CostModel(Table([1, 64], [10.0, 10.0]), Table([1, 64], [1.0, 1.0]), rate=0.5)
    for _ in range(20):
        c.observe(32.0, [4], step_ms=31.0)  # the tables said 11 ms
    assert c.step_ms_at(32.0, [4]) == pytest.approx(31.0, rel=0.05)
    before = c.step_ms_at(32.0, [4])
    c.observe(32.0, [4], step_ms=float("nan"))
    assert c.step_ms_at(32.0, [4]) == before
    assert c.observed_steps == 20  # a step without a finite time is not counted


def test_online_correction_charges_drafting_steps_to_drafting():
    # drafting steps that take longer than predicted make drafting dearer, not every step
    c = CostModel(Table([1, 64], [10.0, 10.0]), Table([1, 64], [1.0, 1.0]), overhead_ms=0.5, rate=0.5)
    for _ in range(20):
        c.observe(17.0, [1], step_ms=15.0)  # predicted 11.5 ms
        c.observe(1.0, [], step_ms=10.5)    # predicted exactly
    assert c.step_ms_at(17.0, [1]) == pytest.approx(15.0, rel=0.05)
    assert c.step_ms_at(1.0) == pytest.approx(10.5, rel=0.02)
    assert c.overhead_ms == pytest.approx(0.5, abs=0.05)


def test_serialisation_round_trip_and_errors():
    c = CostModel.fit_traces(TraceTable.from_records(synthetic_records(num_requests=5, steps_per_request=5)))
    again = CostModel.from_dict(c.to_dict())
    assert again.step_ms_at(30, [2]) == pytest.approx(c.step_ms_at(30, [2]))
    with pytest.raises(ValueError, match="cost.verify"):
        CostModel.from_dict({"verify": {"x": [1]}, "draft_pass": {"x": [1, 2], "ms": [1, 1]}})
    with pytest.raises(ValueError, match="overhead_ms"):
        CostModel(overhead_ms=-1.0)


def test_draft_span_prices_a_short_pass_and_corrects_in_whole_block_units():
    draft = Table([1, 8], [4.0, 16.0], "cost.draft_pass")
    c = CostModel(draft_pass=draft, span_share=0.4, block=16)
    assert c.span_scale() == 1.0 and c.draft_ms_at([1]) == pytest.approx(4.0)  # no span: whole blocks
    c.span = 1
    assert c.draft_ms_at([1]) == pytest.approx(1.6)
    c.span = 16
    assert c.draft_ms_at([1]) == pytest.approx(4.0)
    c.span = 6  # 0.4 + 0.6 · 5/15 = 0.6
    assert c.draft_ms_at([8, 1]) == pytest.approx(0.6 * 20.0)
    assert float(c.draft_ms(torch.tensor([[8.0, 1.0]]))[0]) == pytest.approx(0.6 * 20.0)
    assert c.step_ms_at(1.0, [1]) == pytest.approx(c.step_ms_at(1.0) + 0.6 * 4.0)
    # a drafting step at span 6 that took 0.6 ms over its prediction: the whole-block table rises by 0.6/0.6
    c.rate = 1.0
    c.observe(2.0, [1], c.step_ms_at(2.0, [1]) + 0.6)
    assert c.draft_pass.at(1.0) == pytest.approx(4.0 + 0.6 / 0.6)
    back = CostModel.from_dict(c.to_dict())
    assert (back.span_share, back.block, back.span) == (0.4, 16, None)
    with pytest.raises(ValueError, match="span_share"):
        CostModel(span_share=0.0)


def test_profile_measures_the_span_share_from_a_short_pass():
    slept = lambda ms: (lambda n: time.sleep(ms / 1e3))  # noqa: E731
    c = CostModel.profile(lambda n: None, slept(10.0), token_grid=[1, 2], row_grid=[1, 2], repeats=1,
                          short_draft_fn=slept(4.0), block=16)
    assert 0.3 < c.span_share < 0.55 and c.block == 16
    assert CostModel.profile(lambda n: None, slept(1.0), token_grid=[1, 2], row_grid=[1, 2], repeats=1).span_share == 1.0


def test_a_stalled_step_teaches_at_most_a_bounded_residual():
    """One step that stalled (a page fault, a noisy neighbour) moves the tables by at most
    `RESIDUAL_BOUND` of its prediction times the rate, not by the whole stall; steady slowness
    still moves them, step after step."""
    from adapt.cost_model import RESIDUAL_BOUND, bounded_residual

    assert bounded_residual(600.0, 20.0) == pytest.approx(RESIDUAL_BOUND * 20.0)
    assert bounded_residual(600.0, 20.0, bound=0.5) == pytest.approx(10.0)
    assert bounded_residual(2.0, 20.0, bound=0.5) == pytest.approx(-10.0)
    assert bounded_residual(21.0, 20.0) == pytest.approx(1.0)
    assert bounded_residual(5.0, 0.0) == pytest.approx(RESIDUAL_BOUND)  # a near-zero prediction still learns
    c = CostModel()
    before = c.draft_pass.at(1.0)
    predicted = c.step_ms_at(5.0, [1])
    c.observe(5.0, [1], predicted + 600.0)  # a drafting step that stalled 600 ms
    assert c.draft_pass.at(1.0) - before <= c.rate * RESIDUAL_BOUND * predicted + 1e-9
    slow = CostModel()
    for _ in range(200):  # every step 3x the prediction: the table follows
        slow.observe(5.0, [1], 3.0 * slow.step_ms_at(5.0, [1]))
    assert slow.draft_pass.at(1.0) > 3 * before


def test_a_rise_no_step_measures_again_is_halved_after_stale_steps():
    """Drafting steps in a slow spell raised the draft table; then only plain steps come (the
    policy priced drafting out), which never visit it. After `STALE_STEPS` steps without a
    measurement its rise over the profiled value is halved, and again after as many more; the
    verify point the plain steps keep measuring is left to them."""
    from adapt.cost_model import STALE_STEPS

    c = CostModel()
    built = c.draft_pass.at(1.0)
    for _ in range(40):  # drafting steps at twice their prediction
        c.observe(5.0, [1], 2.0 * c.step_ms_at(5.0, [1]))
    risen = c.draft_pass.at(1.0) - built
    assert risen > 5.0
    for _ in range(STALE_STEPS - 20):  # plain steps that take what the model says
        c.observe(1.0, [], c.step_ms_at(1.0))
    assert c.draft_pass.at(1.0) - built == pytest.approx(risen)  # not stale yet
    for _ in range(40):
        c.observe(1.0, [], c.step_ms_at(1.0))
    assert c.draft_pass.at(1.0) - built == pytest.approx(risen / 2)
    for _ in range(4 * STALE_STEPS):
        c.observe(1.0, [], c.step_ms_at(1.0) + 2.0)  # plain steps 2 ms slower: learned, not relaxed
    speed = c.verify.at(1.0) / CostModel().verify.at(1.0)  # the plain steps' speed factor (both tables)
    assert speed > 1.05
    assert c.draft_pass.at(1.0) / speed - built < risen / 16  # the rise, in the machine's speed as built
    assert c.step_ms_at(1.0) > CostModel().step_ms_at(1.0) + 1.5
    assert all(a <= b for a, b in zip(c.draft_pass.ys.tolist(), c.draft_pass.ys.tolist()[1:]))


def test_a_uniform_slowdown_seen_on_plain_steps_keeps_the_price_of_drafting():
    """Plain steps that all run 1.5x their prediction (a busy neighbour, a lower clock) slow every
    forward alike: the model learns the plain step's time, and drafting keeps its price relative
    to it (a 5-token verify with a drafter pass against a one-token step), instead of looking
    cheaper because only the one-token point rose."""
    c = CostModel()
    ratio = c.step_ms_at(5.0, [1]) / c.step_ms_at(1.0)
    for _ in range(300):
        c.observe(1.0, [], 1.5 * CostModel().step_ms_at(1.0))
    assert c.step_ms_at(1.0) == pytest.approx(1.5 * CostModel().step_ms_at(1.0), rel=0.02)
    assert c.step_ms_at(5.0, [1]) / c.step_ms_at(1.0) == pytest.approx(ratio, rel=0.03)
    assert all(a <= b for a, b in zip(c.verify.ys.tolist(), c.verify.ys.tolist()[1:]))
