"""The suffix drafter (workers/suffix.py) and suffix drafts in the engine without a drafter."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from policies.adaptive.guards import reachable
from tests.tiny_models import make_tiny_target, run_to_completion, single_thread
from workers.decisions import DraftIntent
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE, SUFFIX_CODE
from workers.engine import Engine, EngineConfig
from workers.step_record import StepRecord
from workers.request import DecodeKnobs, EngineInputError, SamplingParams
from workers.suffix import SEPARATOR, RecentOutputs, SuffixConfig, SuffixDrafter, TokenIndex, vote

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

COPY = -1  # a row that takes its suffix draft, in the per-row steps these tests compare (`decide`)
_intents: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # each policy's latest intent


def decide(policy, rows) -> torch.Tensor:
    """``policy.before_draft(rows)`` as per-row steps [B]: diffusion passes, 0 no draft, `COPY`
    for a suffix copy; the intent is kept for `observe`."""
    intent = _intents[policy] = policy.before_draft(rows)
    return torch.where(intent.source == SUFFIX_CODE, COPY, intent.steps)


def observe(policy, rows, outcome, steps: torch.Tensor | None = None) -> None:
    """``policy.observe`` of a step that drafted with ``steps`` (as `decide` gives them), or with
    the policy's latest intent (none yet: no row drafted)."""
    if steps is not None:
        source = torch.where(steps > 0, DIFFUSION_CODE, torch.where(steps == COPY, SUFFIX_CODE, NONE_CODE))
        intent = DraftIntent(source, steps.clamp(min=0))
    else:
        intent = _intents.get(policy) or DraftIntent.none(rows.batch_size)
    policy.observe(StepRecord.of(rows, intent, outcome))


def test_longest_match_proposes_what_followed_it():
    d = SuffixDrafter()
    # "1 2 3" occurs at the start; the sequence ends in "1 2 3": match 3, draft "4 5 6" capped at 3 tokens
    draft = d.propose(d.new_index([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]))
    assert draft.tokens.tolist() == [4, 5, 6] and draft.match_len == 3 and draft.origin == "request"
    assert draft.probs.tolist() == [1.0, 1.0, 1.0] and draft.score == 3.0


def test_the_longer_of_two_matches_wins():
    d = SuffixDrafter()
    # "6 7" is followed by 9 once, "5 6 7" by 8: the longer match decides
    draft = d.propose(d.new_index([5, 6, 7, 8, 0, 6, 7, 9, 0, 5, 6, 7]))
    assert draft.match_len == 3 and draft.tokens[0] == 8


def test_votes_give_conditional_probabilities():
    # three candidates: continuations 4 4 5 -> 4 with 2/3; then the two left agree on 6, 7
    conts = np.array([[4, 6, 7], [5, 0, 0], [4, 6, 7]])
    tokens, probs = vote(conts, 3, min_prob=0.1)
    assert tokens.tolist() == [4, 6, 7]
    assert np.allclose(probs, [2 / 3, 1.0, 1.0])
    # the running probability stops the draft
    tokens, _ = vote(conts, 3, min_prob=0.9)
    assert len(tokens) == 0


def test_continuations_stop_at_the_end_of_an_output():
    d = SuffixDrafter(SuffixConfig(max_factor=8.0))
    d.finish([10, 11, 12])  # stored with a separator after it
    draft = d.propose(d.new_index([3, 10, 11]))
    assert draft.origin == "global" and draft.tokens.tolist() == [12]


def test_no_match_no_draft():
    d = SuffixDrafter()
    assert len(d.propose(d.new_index([1, 2, 3, 4])).tokens) == 0
    assert len(d.propose(d.new_index([7])).tokens) == 0


def test_index_grows_and_keeps_the_newest_candidates():
    ix = TokenIndex(max_candidates=2, capacity=4)
    ix.extend([1, 2, 3, 1, 2, 4, 1, 2, 5])
    assert ix.size == 9 and len(ix.buf) >= 9
    cand, m = ix.candidates(np.array([1, 2]))
    assert m == 2 and sorted(ix.buf[cand].tolist()) == [4, 5]  # the two newest of 3, 4, 5


def test_recent_outputs_forget_the_oldest_first():
    recent = RecentOutputs(capacity=40)
    for i in range(10):
        recent.add([100 + i, 200 + i, 300 + i, 400 + i, 500 + i])
    assert recent.held <= 40
    assert recent.index.size == recent.held
    kept = set(recent.index.buf[: recent.index.size].tolist()) - {SEPARATOR}
    assert 109 in kept and 100 not in kept  # newest kept, oldest dropped


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("suffix") / "t", vocab=16, seed=4)


def greedy_of(target, prompts, n, knobs, suffix=True):
    engine = Engine(EngineConfig(target=target, drafter=None, dtype="float32", max_batch=8, max_len=96,
                                 suffix=suffix))
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    adds = [(f"r{i}", p, params, knobs) for i, p in enumerate(prompts)]
    return run_to_completion(engine, adds)


def test_suffix_drafts_without_a_drafter_keep_greedy_output(target):
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 1], [9, 9, 9, 2]]
    plain = greedy_of(target, prompts, 40, DecodeKnobs(draft_len=0))
    fast = greedy_of(target, prompts, 40, DecodeKnobs(draft_len=8, source="suffix"))
    for i in range(len(prompts)):
        assert fast[f"r{i}"] == plain[f"r{i}"]
    stats = [fast[f"r{i}:stats"] for i in range(len(prompts))]
    assert sum(s["accepted"] for s in stats) >= 10  # a tiny greedy model loops: its repeats get accepted
    assert sum(s["target_passes"] for s in stats) < sum(plain[f"r{i}:stats"]["target_passes"] for i in range(3))
    assert {s["source_used"] for s in stats} <= {"suffix", "none"}


def test_suffix_drafts_leave_the_rows_recent_acceptance_alone(target):
    """`recent_accept` is the acceptance of a row's diffusion drafts (the prior's main feature): a
    row that verifies suffix drafts, accepted or not, keeps RECENT_NONE; and a policy's book
    counts a step whose row verified a suffix draft as idle (no diffusion draft verified)."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from tests.test_policies import make_rows
    from workers.decisions import RECENT_NONE, StepOutcome

    engine = Engine(EngineConfig(target=str(target), drafter=None, dtype="float32", max_batch=2, max_len=64))
    engine.add_request("a", [3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_tokens=30, ignore_eos=True),
                       DecodeKnobs(draft_len=8, source="suffix"))
    engine.step()  # the prefill
    req = engine.running[0]
    while engine.has_unfinished() and req.verified == 0:
        engine.step()
    assert req.verified > 0 and req.last_knobs[0] == SUFFIX_CODE
    assert req.recent_accept == RECENT_NONE

    policy, rows = AdaptivePolicy(), make_rows(2, 8)
    decide(policy, rows)
    observe(policy, rows, StepOutcome(torch.tensor([2, 1]), torch.tensor([3, 3]), torch.zeros(2), 0.01, 8),
            steps=torch.tensor([COPY, 1]))  # row 0 copied, row 1 drafted by diffusion
    assert policy.book.idle.tolist() == [1.0, 0.0]


def test_suffix_source_needs_the_suffix_drafter(target):
    engine = Engine(EngineConfig(target=target, drafter=None, dtype="float32", max_batch=2, max_len=32, suffix=False))
    with pytest.raises(EngineInputError, match="suffix"):
        engine.add_request("a", [1, 2], SamplingParams(max_tokens=4), DecodeKnobs(draft_len=4, source="suffix"))
    assert not engine.has_unfinished()


def test_bad_source_names_the_field():
    with pytest.raises(ValueError, match="source"):
        DecodeKnobs(source="ngram")


def run_adaptive(target, drafter, prompts, n, cost, **settings):
    from policies.adaptive import AdaptivePolicy

    from workers.traces import ListTraceSink

    policy = AdaptivePolicy(cost=cost, online_cost=False, **settings)
    sink = ListTraceSink()
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=128),
                    decisions=policy, trace_sink=sink)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    outs = run_to_completion(engine, [(f"r{i}", p, params, DecodeKnobs()) for i, p in enumerate(prompts)])
    outs["sources"] = [r["source"] for r in sink.records]
    outs["suffix_accepted"] = sum(r["accepted"] for r in sink.records if r["source"] == "suffix")
    outs["policy"] = policy.stats()
    return outs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("suffix-pair"), vocab=16, seed=4)


def test_adaptive_policy_takes_suffix_drafts_where_slots_are_cheap_and_stays_exact(pair):
    from policies.defaults import LinearCost

    target, drafter = pair
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 1, 2], [9, 9, 9, 2]]
    plain = greedy_of(target, prompts, 48, DecodeKnobs(draft_len=0))
    cheap = run_adaptive(target, drafter, prompts, 48, LinearCost(overhead_ms=8.0, per_token_ms=0.01))
    for i in range(len(prompts)):
        assert cheap[f"r{i}"] == plain[f"r{i}"]
    # a looping tiny model: long matches, nearly free slots -> suffix drafts taken and accepted
    assert cheap["suffix_accepted"] >= 10
    assert sum(cheap[f"r{i}:stats"]["target_passes"] for i in range(3)) < 3 * 48


def test_adaptive_policy_declines_suffix_drafts_when_every_slot_costs_a_step(pair):
    from policies.defaults import LinearCost

    target, drafter = pair
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 1, 2]]
    plain = greedy_of(target, prompts, 32, DecodeKnobs(draft_len=0))
    # hold_share 0: hold every plain decision (by default only where deciding costs 5 % of a row's
    # share of a measured step, which on a loaded machine a tiny model's steps may not reach)
    dear = run_adaptive(target, drafter, prompts, 32, LinearCost(overhead_ms=1.0, per_token_ms=50.0, per_pass_ms=50.0),
                        hold_share=0.0)
    for i in range(len(prompts)):
        assert dear[f"r{i}"] == plain[f"r{i}"]
        assert dear[f"r{i}:stats"]["verified"] == 0  # a slot costs as much as a step: nothing pays
    assert set(dear["sources"]) == {"none"}
    # nothing pays: the policy holds its plain decision for most steps (engine-side: no suffix proposals)
    assert dear["policy"]["held_share"] > 0.5


def test_without_global_memory_a_request_copies_only_its_own_text(target):
    engine = Engine(EngineConfig(target=target, drafter=None, dtype="float32", max_batch=2, max_len=64,
                                 suffix_global_tokens=0))
    engine.suffix.finish([1, 2, 3, 4, 5, 6, 7, 8])
    assert engine.suffix.recent.index.size == 0
    index = engine.suffix.new_index([9, 1, 2])
    assert len(engine.suffix.propose(index).tokens) == 0


def _rows(ids, **fields):
    """A `RowState` of greedy rows named ``ids`` (an int: that many, "r0", "r1" ...), each 100
    tokens in, 10 generated and 50 to go, blocks of 16, with ``fields`` added or overriding those."""
    import torch

    from workers.decisions import RowState

    ids = [f"r{i}" for i in range(ids)] if isinstance(ids, int) else list(ids)
    B = len(ids)
    base = dict(request_ids=ids, knobs=[DecodeKnobs()] * B, targets=[None] * B, position=torch.full((B,), 100),
                generated=torch.full((B,), 10), temperature=torch.zeros(B), recent_accept=torch.full((B,), -1.0),
                tvd_spent=torch.zeros(B), remaining=torch.full((B,), 50), batch_size=B, block_size=16)
    return RowState(**{**base, **fields})


def _confident_suffix_rows(B: int):
    """B greedy rows without a drafter, each offered an 8-token suffix draft of a 12-token match."""
    import torch

    return _rows(B, has_drafter=False, suffix_len=torch.full((B,), 8), suffix_score=torch.full((B,), 6.0),
                 suffix_match=torch.full((B,), 12))


def test_adaptive_policy_learns_that_wide_steps_cost_more_than_its_table_says():
    """The suffix choice's cost is corrected online by measured / predicted step times: when
    widened steps keep taking 4x their prediction, the policy stops widening."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    from workers.decisions import StepOutcome

    policy = AdaptivePolicy(cost=LinearCost(overhead_ms=10.0, per_token_ms=1.0), online_cost=True,
                            suffix_recalibrate=False)  # its steps accept nothing; this test is about cost
    B = 4
    rows = _confident_suffix_rows(B)
    assert (decide(policy, rows) == COPY).all()  # long confident matches, cheap slots: widen
    for _ in range(30):
        decide(policy, rows)
        k = int(policy.step.suffix_k.max())
        predicted = policy.cost.step_ms_at(float(B * (k + 1)))
        slow = 4.0 if k > 0 else 1.0  # widened steps take 4x their prediction, plain ones as predicted
        observe(policy, rows, StepOutcome(torch.zeros(B, dtype=torch.int64), policy.step.suffix_k.clone(), torch.zeros(B),
                                         slow * predicted / 1e3, B * (k + 1)))
    assert (decide(policy, rows) == 0).all() and policy.costs.suffix_cost_ratio["wide"] > 1.3
    # its calibration report: widened steps took far more than first predicted, plain ones as predicted
    cal = policy.stats()["suffix_calibration"]
    assert cal["wide@4"]["steps"] >= 1 and cal["wide@4"]["measured_ms"] > 1.3 * cal["wide@4"]["predicted_ms"]
    if "plan@4" in cal:
        assert cal["plan@4"]["measured_ms"] == pytest.approx(cal["plan@4"]["predicted_ms"], rel=0.3)


def test_adaptive_policy_prices_one_rows_suffix_draft_by_its_own_positions_when_packed():
    """At 8 rows with one long confident suffix draft and a per-position cost: padded to the
    longest row the draft would cost 8 rows' worth of slots and is declined; with packed
    verification (`RowState.packed_verify`) it costs its own slots and is taken."""
    import dataclasses

    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost

    B = 8
    rows = _rows(B, has_drafter=False, suffix_len=torch.tensor([8] + [0] * (B - 1)),
                 suffix_score=torch.tensor([7.0] + [0.0] * (B - 1)), suffix_match=torch.tensor([32] + [0] * (B - 1)))
    cost = LinearCost(overhead_ms=10.0, per_token_ms=1.0)
    padded = decide(AdaptivePolicy(cost=cost, online_cost=False, hold_max=0), rows)
    assert (padded == 0).all()
    packed = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0)
    steps = decide(packed, dataclasses.replace(rows, packed_verify=True))
    assert steps[0] == COPY and (steps[1:] == 0).all() and int(packed.step.suffix_k[0]) >= 4


def test_packed_adaptive_policy_gives_each_row_its_own_suffix_draft_length():
    """Packed, two rows in one step: a long confident copy (match 32) takes most of its slots
    while a weak match (match 2, c = 0.4) takes none, where every verified position costs 2 ms.
    Padded to the longest row, the same step gives both rows one cap."""
    import dataclasses

    import torch

    from policies.adaptive import AdaptivePolicy, suffix_candidates
    from policies.defaults import LinearCost

    rows = _rows(["strong", "weak"], has_drafter=False, suffix_len=torch.tensor([8, 2]),
                 suffix_score=torch.tensor([7.0, 0.6]), suffix_match=torch.tensor([32, 2]))
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.0)
    packed = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_margin=0.0)
    steps = decide(packed, dataclasses.replace(rows, packed_verify=True))
    assert steps.tolist() == [COPY, 0]
    assert int(packed.step.suffix_k[0]) >= 5 and int(packed.step.suffix_k[1]) == 0
    padded = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_margin=0.0)
    decide(padded, rows)
    k = padded.step.suffix_k.tolist()
    assert k[1] == min(2, k[0])  # one cap for both rows

    # the packed candidates: column m takes the m most valuable slots, a prefix of every row
    marginal = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.85, 0.5, 0.0, 0.0]])
    cand = suffix_candidates(torch.tensor([3, 2]), marginal, packed=True)
    assert cand.tolist() == [[0, 1, 1, 2, 2, 3], [0, 0, 1, 1, 2, 2]]
    assert suffix_candidates(torch.tensor([3, 2]), marginal, packed=False).tolist() == [[0, 1, 2, 3, 3],
                                                                                         [0, 1, 2, 2, 2]]


def test_suffix_first_takes_every_suffix_draft_whole():
    """With ``suffix_first`` the rows of the step above that have a suffix draft take all of it,
    the weak match too (the choice declines it), and the learned acceptance hears what the table
    predicted of each; rows without one keep their plan."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost

    rows = _rows(["strong", "weak", "none"], has_drafter=False, suffix_len=torch.tensor([8, 2, 0]),
                 suffix_score=torch.tensor([7.0, 0.6, 0.0]), suffix_match=torch.tensor([32, 2, 0]),
                 packed_verify=True)
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.0)
    chosen = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0)
    assert decide(chosen, rows).tolist() == [COPY, 0, 0]
    first = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_first=True)
    assert decide(first, rows).tolist() == [COPY, COPY, 0]
    assert first.step.suffix_k.tolist() == [8, 2, 0]
    expect = first.step.suffix_expect.tolist()
    assert expect[0] > expect[1] > 0 and expect[2] == 0
    with pytest.raises(ValueError, match="suffix_first"):
        AdaptivePolicy(suffix_first="yes")


def test_packed_adaptive_policy_drafts_a_unanimous_copy_and_not_a_contested_one():
    """Two rows with the same match length (4) and draft length (4): one draft's tokens are
    unanimous, the other's first token had a third of the votes. With the fitted table's vote
    scale the policy takes the first and declines the second, where every position costs 2 ms;
    without vote shares both look alike and get the same length."""
    import dataclasses

    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost

    table = {"match": [2, 4], "first": [0.5, 0.8], "accept": [0.6, 0.85], "vote": [0.0, 0.5, 0.99],
             "vote_scale": [0.15, 0.45, 1.0]}
    rows = _rows(["unanimous", "contested"], has_drafter=False, suffix_len=torch.tensor([4, 4]),
                 suffix_score=torch.tensor([2.5, 0.6]), suffix_match=torch.tensor([4, 4]),
                 suffix_vote=torch.tensor([[1.0, 1.0, 1.0, 1.0], [1 / 3, 1.0, 1.0, 1.0]]), packed_verify=True)
    cost = LinearCost(overhead_ms=10.0, per_token_ms=4.0)
    policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_accept=table)
    assert decide(policy, rows).tolist() == [COPY, 0]
    assert int(policy.step.suffix_k[0]) >= 2 and int(policy.step.suffix_k[1]) == 0
    blind = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_accept=table)
    decide(blind, dataclasses.replace(rows, suffix_vote=None))
    assert blind.step.suffix_k[0] == blind.step.suffix_k[1] > 0
    off = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_accept=table, suffix_vote=False)
    decide(off, rows)  # the setting that ignores vote shares
    assert off.step.suffix_k.tolist() == blind.step.suffix_k.tolist()


def test_the_engine_hands_the_policy_each_suffix_drafts_vote_shares(target):
    """RowState.suffix_vote holds each row's suffix draft's vote shares, 0 past its draft, padded
    to the engine's width (`workers.drafting.suffix.drafts`)."""
    engine = Engine(EngineConfig(target=str(target), drafter=None, dtype="float32", max_batch=2, max_len=64))
    engine.add_request("a", [3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_tokens=8), DecodeKnobs(source="suffix"))
    engine.add_request("b", [9, 9, 2, 7], SamplingParams(max_tokens=8), DecodeKnobs(source="suffix"))
    engine.step()
    rows = engine._row_state()
    assert rows.suffix_vote is not None and rows.suffix_vote.shape == (2, engine.width)
    for i, req in enumerate(engine.running):
        n = len(req.suffix_draft.tokens)
        assert rows.suffix_vote[i, :n].tolist() == pytest.approx(req.suffix_draft.probs.tolist())
        assert (rows.suffix_vote[i, n:] == 0).all()


def _tight_and_copy_rows(tpot_ms: float, generated: int, **extra):
    """Two rows 100 tokens in, 50 to go: "tight" (TPOT target ``tpot_ms``, no suffix draft) and
    "copy" (no target, a confident 8-token suffix draft over a 32-token match)."""
    import torch

    from adapt.targets import RequestTargets

    B = 2
    return _rows(["tight", "copy"], targets=[RequestTargets(tpot_ms=tpot_ms), None],
                 generated=torch.full((B,), generated), has_drafter=False, packed_verify=True,
                 suffix_len=torch.tensor([0, 8]), suffix_score=torch.tensor([0.0, 7.5]),
                 suffix_match=torch.tensor([0, 32]), **extra)


def _observe_plain(policy, rows, n: int, seconds: float) -> None:
    """Show ``policy`` ``n`` plain steps (no draft, one token per row) of ``seconds`` each."""
    import torch

    from workers.decisions import StepOutcome

    B = rows.batch_size
    for _ in range(n):
        observe(policy, rows, StepOutcome(torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                                         torch.zeros(B), seconds, B))


def test_sla_guard_keeps_a_row_on_its_tpot_target_while_another_copies():
    """A row meeting a 14.5 ms/token target and a row with a long confident copy, 2 ms per
    verified position: without the guard the copy takes its whole draft (a 30 ms step would put
    the first row over its target); with `sla_guard` it takes only what keeps that row within."""
    import dataclasses

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    

    rows = _tight_and_copy_rows(14.5, generated=10)
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.0)
    chosen = {}
    for guard in (False, True):
        policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=guard, sla_slack=1.0)
        _observe_plain(policy, rows, 10, 0.014)  # 140 ms for 10 tokens, within 14.5 ms/token
        steps = decide(policy, rows)
        assert steps.tolist() == [0, COPY]
        chosen[guard] = int(policy.step.suffix_k[1])
    assert chosen[False] >= 6
    # with the guard: 140 + 10 + 2·(2 + k) <= 14.5·11 = 159.5, so k <= 2
    assert 1 <= chosen[True] <= 2
    # a row without a target never constrains
    free = dataclasses.replace(rows, targets=[None, None])
    policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=True, sla_slack=1.0)
    decide(policy, free)
    assert int(policy.step.suffix_k[1]) == chosen[False]


def test_sla_guard_behind_keeps_others_copies_from_slowing_a_late_row():
    """The tight row is already behind its 12 ms/token target (140 ms for 10 tokens): without
    `sla_guard_behind` (or in a batch of fewer than `sla_guard_behind_rows` rows, 3 by default)
    it does not constrain, and the other row copies its whole confident draft; with
    `sla_guard_behind` a late row vetoes every candidate that lowers its own expected tokens per
    ms, so the other row's copy (a wider step, nothing for the late row) is declined. A late
    row's own confident copy raises its rate and stays allowed."""
    import dataclasses

    from adapt.targets import RequestTargets
    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    

    rows = _tight_and_copy_rows(12.0, generated=10)
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.0)
    chosen = {}
    for behind in (False, True):
        policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=True, sla_slack=1.0,
                                sla_guard_behind=behind, sla_guard_behind_rows=1)
        _observe_plain(policy, rows, 10, 0.014)  # 14 ms per token, past the 12 ms target
        steps = decide(policy, rows)
        chosen[behind] = (steps.tolist(), int(policy.step.suffix_k[1]))
    assert chosen[False][0] == [0, COPY] and chosen[False][1] >= 6
    assert chosen[True] == ([0, 0], 0)
    # `sla_guard_behind_rows`: the veto only in batches of at least that many rows (this one has 2;
    # the default, 3: on by default from three rows)
    default = AdaptivePolicy()
    assert default.sla_guard_behind and default.sla_guard_behind_rows == 3
    for min_rows, want in ((2, chosen[True]), (3, chosen[False])):
        policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=True, sla_slack=1.0,
                                sla_guard_behind=True, sla_guard_behind_rows=min_rows)
        _observe_plain(policy, rows, 10, 0.014)
        steps = decide(policy, rows)
        assert (steps.tolist(), int(policy.step.suffix_k[1])) == want
    with pytest.raises(ValueError, match="sla_guard_behind_rows"):
        AdaptivePolicy(sla_guard_behind=True, sla_guard_behind_rows=0)
    # the late row's own copy: its expected tokens pay for the wider step, so it takes it
    own = dataclasses.replace(rows, targets=[None, RequestTargets(tpot_ms=12.0)])
    policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=True, sla_slack=1.0,
                            sla_guard_behind=True, sla_guard_behind_rows=1)
    _observe_plain(policy, own, 10, 0.014)
    assert decide(policy, own).tolist() == [0, COPY]
    assert int(policy.step.suffix_k[1]) >= 6


def test_sla_guard_looks_ahead_with_the_batchs_stalls():
    """Under the wall clock the batch's stalls (time outside decode steps: other requests'
    prefills) count in a row's pace to the end: 10 plain 10 ms steps took 140 ms of wall time for
    both rows (4 ms of stall per token), so the tight row
    (17.4 ms/token, 50 tokens left) finishes on target at the plan's 14 ms + 4 ms stall per token
    with 8 ms to spare, and the copy takes at most 4 drafts (2 ms each). Under the decode clock
    it sees no stalls and the copy takes what it takes unguarded."""
    import dataclasses

    import torch

    from adapt.targets import RequestTargets
    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    

    rows = _tight_and_copy_rows(17.4, generated=11, decode_ms=torch.tensor([140.0, 140.0]))
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.0)
    chosen = {}
    for clock in ("wall", "decode", "unguarded"):
        policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=clock != "unguarded",
                                sla_clock="decode" if clock == "decode" else "wall", sla_slack=1.0)
        _observe_plain(policy, rows, 10, 0.010)  # ten 10 ms decode steps of one token each
        assert decide(policy, rows).tolist() == [0, COPY]
        chosen[clock] = int(policy.step.suffix_k[1])
    # wall: 140 + 14 + 2k + 49 · (14 + 4) <= 17.4 · 60, so k <= 4 (now: 154 + 2k <= 191.4 allows 18)
    assert 1 <= chosen["wall"] <= 4
    assert chosen["decode"] == chosen["unguarded"] >= 6
    # a row that cannot finish on target at the plan's pace does not constrain
    late = dataclasses.replace(rows, targets=[RequestTargets(tpot_ms=17.0), None])
    policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=True, sla_slack=1.0)
    _observe_plain(policy, late, 10, 0.010)
    decide(policy, late)
    assert int(policy.step.suffix_k[1]) == chosen["unguarded"]


def test_sla_guard_keeps_a_headroom_of_sla_slack():
    """The guard keeps protected rows within ``sla_slack`` (0.9) times their target: a row that
    finishes at the plan's 14 ms per token against a 14.5 ms target is on it, but without the 10 %
    headroom (13.05 ms), so no copy may widen its steps; with ``sla_slack=1`` the copy takes its whole
    draft, or nearly (100 + 14 + 2·8 ≤ 14.5 · 11 now, 800 + 2·8 ≤ 14.5 · 60 at the end)."""
    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    

    rows = _tight_and_copy_rows(14.5, generated=10)
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.0)
    taken = {}
    for slack in (1.0, 0.9):
        policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_guard=True, sla_slack=slack)
        _observe_plain(policy, rows, 10, 0.010)
        steps = decide(policy, rows)
        taken[slack] = int(policy.step.suffix_k[1])
        assert steps.tolist() == ([0, COPY] if taken[slack] else [0, 0])
    assert taken[1.0] >= 6 and taken[0.9] == 0


def test_adaptive_policy_does_not_count_the_drafting_paths_fixed_cost_twice():
    """A widened step that took exactly what the policy charged (its table's time plus the
    learned fixed cost of the drafting path) leaves the suffix cost ratio at 1: the ratio
    corrects only what the fixed cost does not explain."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    from workers.decisions import StepOutcome

    # (the steps below accept nothing: acceptance recalibration off, this test is about cost)
    policy = AdaptivePolicy(cost=LinearCost(overhead_ms=10.0, per_token_ms=1.0), online_cost=True,
                            suffix_recalibrate=False)
    policy.costs.step_residual = {("draft", 4): 5.0, ("plain", 4): 0.0}  # drafting steps: 5 ms beyond the table
    B = 4
    rows = _confident_suffix_rows(B)
    for _ in range(10):
        assert (decide(policy, rows) == COPY).all()
        k = int(policy.step.suffix_k.max())
        took = policy.cost.step_ms_at(float(B * (k + 1))) + policy.draft_overhead_at(B, "suffix")
        observe(policy, rows, StepOutcome(torch.zeros(B, dtype=torch.int64), policy.step.suffix_k.clone(), torch.zeros(B),
                                         took / 1e3, B * (k + 1)))
    assert abs(policy.costs.suffix_cost_ratio["wide"] - 1.0) < 0.02


def test_adaptive_policy_recalibrates_suffix_acceptance_online():
    """Copies that win a third of what the table predicts pull `suffix_accept_ratio` towards
    1/3, and the policy then prices the same draft at about a third of its table value and
    declines it where it no longer pays; with `suffix_recalibrate=False` the ratio stays 1."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    from workers.decisions import StepOutcome

    B = 4
    rows = _confident_suffix_rows(B)
    table = {"match": [2, 12], "first": [0.5, 0.9], "accept": [0.6, 0.9]}
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.5)
    for recalibrate in (True, False):
        policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_accept=table,
                                suffix_recalibrate=recalibrate)
        assert (decide(policy, rows) == COPY).all()
        for _ in range(40):
            decide(policy, rows)
            expect = policy.step.suffix_expect.clone() if policy.step.suffix_expect is not None else torch.zeros(B)
            won = (expect / 3).floor().long()  # a third of the table's prediction
            observe(policy, rows, StepOutcome(won, policy.step.suffix_k.clone() if policy.step.suffix_k is not None
                                             else torch.zeros(B, dtype=torch.int64), torch.zeros(B), 0.05, B))
        ratio = policy.stats()["suffix_accept"]["ratio"]
        if recalibrate:
            assert 0.2 < ratio < 0.5 and policy.suffix.drafts > 0
            assert (decide(policy, rows) == 0).all()  # at a third of the value the copies no longer pay
            for _ in range(600):  # plain steps: the evidence fades and the copies are retried
                observe(policy, rows, StepOutcome(torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                                                 torch.zeros(B), 0.02, B))
            assert policy.suffix_accept_ratio > 0.9
            assert (decide(policy, rows) == COPY).all()
        else:
            assert ratio == 1.0 and (decide(policy, rows) == COPY).all()


def test_adaptive_policy_prices_sampled_rows_copies_by_the_sampled_table():
    """A table whose sampled class accepts copies far less than its greedy class: in one packed
    batch the greedy rows take their suffix drafts and the sampled rows (T = 0.8) do not; the
    same table without its sampled class prices both alike."""
    import dataclasses

    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    

    B = 4
    rows = dataclasses.replace(_confident_suffix_rows(B), packed_verify=True,
                               temperature=torch.tensor([0.0, 0.0, 0.8, 0.8]))
    greedy = {"match": [2, 12], "first": [0.5, 0.9], "accept": [0.6, 0.9]}
    table = dict(greedy, sampled={"match": [2, 12], "first": [0.1, 0.1], "accept": [0.2, 0.2]})
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.5)
    by_class = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_accept=table)
    assert decide(by_class, rows).tolist() == [COPY, COPY, 0, 0]
    pooled = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, suffix_accept=greedy)
    assert decide(pooled, rows).tolist() == [COPY] * B


def test_adaptive_policy_recalibrates_suffix_acceptance_with_one_ratio_for_every_request():
    """Two requests whose copies win every drafted token and two whose copies win nothing, in one
    packed batch: every row shares the global ratio (`suffix_accept_ratio`; a ratio per request
    measured no gain, docs/benchmarks.md) and gets the same decision."""
    import dataclasses

    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost
    from workers.decisions import StepOutcome

    B = 4
    rows = dataclasses.replace(_confident_suffix_rows(B), packed_verify=True)
    table = {"match": [2, 12], "first": [0.5, 0.9], "accept": [0.6, 0.9]}
    runs_on = torch.tensor([True, True, False, False])
    policy = AdaptivePolicy(cost=LinearCost(overhead_ms=10.0, per_token_ms=2.5), online_cost=False, hold_max=0,
                            suffix_accept=table)
    for _ in range(12):
        decide(policy, rows)
        k = policy.step.suffix_k.clone() if policy.step.suffix_k is not None else torch.zeros(B, dtype=torch.int64)
        won = torch.where(runs_on, k, 0)
        observe(policy, rows, StepOutcome(won, k, torch.zeros(B), 0.05, int(B + k.sum())))
    steps = decide(policy, rows)
    assert len(set(steps.tolist())) == 1


def test_sla_reach_weighs_lateness_only_where_the_target_is_within_reach():
    """Two rows 10 tokens in at 14 ms a token (plain steps), 50 to go: one behind a 12 ms target
    can still meet it (it needs 11.6 ms a token: a 14 ms step bringing it 1.5 tokens), one
    behind a 4 ms target cannot (2 ms a token). With `sla_reach` (default) the second row's
    lateness no longer raises its weight (1, against 5 without); the first row's weight is the
    same either way. A row without a target is within reach."""
    import dataclasses

    import torch

    from adapt.targets import RequestTargets
    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost

    rows = dataclasses.replace(_tight_and_copy_rows(12.0, generated=10), has_drafter=True,
                               targets=[RequestTargets(tpot_ms=12.0), RequestTargets(tpot_ms=4.0)])
    cost = LinearCost(overhead_ms=10.0, per_token_ms=2.0)
    assert AdaptivePolicy().sla_reach
    weights = {}
    for reach in (False, True):
        policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_clock="decode", sla_reach=reach)
        _observe_plain(policy, rows, 10, 0.014)
        ctx = policy._ctx(rows, torch.device("cpu"))
        torch.testing.assert_close(ctx["lateness"], torch.tensor([14 / 12, 14 / 4]))
        assert reachable(rows, ctx, torch.tensor([0.5, 0.5]), policy.costs.plain_step_ms(2, policy.cost)).tolist() == [True, False]
        assert reachable(rows, ctx, torch.tensor([0.1, 6.0]), policy.costs.plain_step_ms(2, policy.cost)).tolist() == [False, True]
        decide(policy, rows)  # the plan sets the rows' reach (with `sla_reach`) and weights
        weights[reach] = policy.weights(policy._ctx(rows, torch.device("cpu")))
    torch.testing.assert_close(weights[False], torch.tensor([1 + 2 * (14 / 12 - 0.9), 5.0]))
    torch.testing.assert_close(weights[True][0], weights[False][0])
    assert float(weights[True][1]) == 1.0
    free = dataclasses.replace(rows, targets=[None, RequestTargets(tpot_ms=4.0)])
    policy = AdaptivePolicy(cost=cost, online_cost=False, hold_max=0, sla_clock="decode")
    _observe_plain(policy, free, 10, 0.014)
    ctx = policy._ctx(free, torch.device("cpu"))
    assert reachable(free, ctx, torch.tensor([0.0, 0.0]), policy.costs.plain_step_ms(2, policy.cost)).tolist() == [True, False]


def _take_suffix_with(rows, steps, extra, toks, per_pass_ms: float, **settings):
    """The adaptive policy's suffix choice over the plan (steps, extra tokens, verified positions
    per row) on a linear cost model (10 ms a step, 0.5 ms a position, ``per_pass_ms`` a drafter
    pass), without online learning: (steps chosen, suffix draft lengths)."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.adaptive.source import take_suffix
    from policies.defaults import LinearCost

    policy = AdaptivePolicy(cost=LinearCost(overhead_ms=10.0, per_token_ms=0.5, per_pass_ms=per_pass_ms, per_row_ms=0.0),
                            online_cost=False, hold_max=0, suffix_recalibrate=False, **settings)
    ctx = policy._ctx(rows, torch.device("cpu"))
    copy, choice = take_suffix(policy, rows, ctx, steps.clone(), extra.clone(), toks.clone())
    out = torch.where(copy, COPY, steps)
    return out.tolist(), choice.suffix_k.tolist()


def test_a_copy_that_wins_fewer_tokens_than_the_plan_is_not_taken():
    """One greedy row planned to draft by diffusion (1.5 extra tokens expected, 3 positions, a
    6 ms drafter pass) is offered a 2-token copy expected to win 1.1 tokens: fewer, though the
    step would cost 11.5 ms instead of 17.5. The choice only considers copies that win more than
    the plan and keeps the diffusion draft (offering the others measured more copies and no more
    goodput, docs/benchmarks.md)."""
    import torch

    rows = _rows(1, suffix_len=torch.tensor([2]), suffix_score=torch.tensor([1.0]), suffix_match=torch.tensor([6]),
                 packed_verify=True)
    steps, extra, toks = torch.tensor([1]), torch.tensor([1.5]), torch.tensor([3.0])  # the plan: one diffusion pass

    def choose(per_pass_ms: float, **settings):
        return _take_suffix_with(rows, steps, extra, toks, per_pass_ms, **settings)

    win = float(torch.cumprod(torch.full((2,), 6 / 9), 0).sum())  # the built-in m / (m + 3) law at match 6
    assert 1.0 < win < 1.5  # fewer than the plan's 1.5
    assert choose(6.0) == ([1], [0])
    assert choose(0.1) == ([1], [0])


def test_a_step_that_copies_keeps_the_other_rows_diffusion_drafts():
    """Two greedy rows both planned to draft by diffusion (0.8 extra tokens each expected, 2
    positions each); row 0 is offered a confident 6-token copy, row 1 nothing. Row 0 switches to
    its copy; row 1 keeps its diffusion draft whatever a drafter pass costs (dropping it to save
    the pass measured no more goodput, docs/benchmarks.md)."""
    import torch

    rows = _rows(2, suffix_len=torch.tensor([6, 0]), suffix_score=torch.tensor([5.0, 0.0]),
                 suffix_match=torch.tensor([30, 0]), packed_verify=True)
    steps, extra, toks = torch.tensor([1, 1]), torch.tensor([0.8, 0.8]), torch.tensor([2.0, 2.0])  # the plan

    def choose(per_pass_ms: float, **settings):
        return _take_suffix_with(rows, steps, extra, toks, per_pass_ms, **settings)

    assert choose(6.0) == ([COPY, 1], [6, 0])
    assert choose(0.1) == ([COPY, 1], [6, 0])


def test_the_suffix_choice_skips_its_candidates_only_where_it_would_keep_the_plan(monkeypatch):
    """Where no row's whole copy is expected to win more than its plan (`copy_may_win` false),
    `take_suffix` answers from the plan alone (`keep_plan`, a few operations instead of the
    candidates' ~80): the same steps, no suffix drafts and the same predicted step (for the cost
    correction) as the full choice gives, over random batches, padded and packed."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.defaults import LinearCost

    import policies.adaptive.source as source
    from policies.adaptive.source import take_suffix

    kept = []
    plan_only = source.keep_plan

    def counted(*args):  # counts the answers taken from the plan alone
        kept.append(1)
        return plan_only(*args)

    monkeypatch.setattr(source, "keep_plan", counted)

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        B = int(torch.randint(1, 5, (1,), generator=gen))
        n = torch.randint(0, 5, (B,), generator=gen)
        n[0] = max(int(n[0]), 1)
        rows = _rows(B, temperature=(torch.rand(B, generator=gen) > 0.5).float(), suffix_len=n,
                     suffix_score=torch.ones(B), suffix_match=torch.randint(1, 12, (B,), generator=gen),
                     packed_verify=bool(trial % 2))
        steps = torch.randint(0, 3, (B,), generator=gen)
        extra = torch.where(steps > 0, 4.0 * torch.rand(B, generator=gen), torch.zeros(B))
        toks = torch.where(steps > 0, torch.randint(2, 8, (B,), generator=gen).float(), torch.ones(B))
        answers = []
        for shortcut in (True, False):
            policy = AdaptivePolicy(cost=LinearCost(overhead_ms=10.0, per_token_ms=0.5, per_pass_ms=3.0, per_row_ms=0.2),
                                    online_cost=False, hold_max=0, suffix_recalibrate=False)
            ctx = policy._ctx(rows, torch.device("cpu"))
            copy, choice = take_suffix(policy, rows, ctx, steps.clone(), extra.clone(), toks.clone(), shortcut)
            out = torch.where(copy, COPY, steps)
            answers.append((out.tolist(), choice.suffix_k.tolist(), choice.suffix_pred))
        quick, full = answers
        assert quick[:2] == full[:2]
        assert quick[2][:3] == full[2][:3] and abs(quick[2][3] - full[2][3]) < 1e-9, (quick, full)
    assert len(kept) > 50  # the quick path ran on many of them


def test_a_copy_that_would_end_a_hold_is_priced_against_the_held_plain_step():
    """One row planned plain (10.5 ms on a linear cost: 10 ms a step, 0.5 ms a position) is offered
    a one-token copy (11 ms). Deciding costs ``s`` ms of host time a step, which holding the plain
    decision saves (the cadence holds where deciding is dear; `hold_share` 0: always); a copy ends
    the hold. With `hold_price` (the default) the copy is compared with a plain step of
    10.5 - ``s`` ms (every recent step held) and declined where it wins too little to pay for
    that; without it, taken. The saving scales with the share of recent steps held."""
    import torch

    from policies.adaptive import AdaptivePolicy
    from policies.adaptive.source import take_suffix
    from policies.defaults import LinearCost

    rows = _rows(1, suffix_len=torch.tensor([1]), suffix_score=torch.tensor([1.0]), suffix_match=torch.tensor([6]),
                 packed_verify=True)
    plan = torch.zeros(1, dtype=torch.int64), torch.zeros(1), torch.ones(1)  # steps, extra tokens, positions

    def choose(decide_ms: float, **settings):
        policy = AdaptivePolicy(cost=LinearCost(overhead_ms=10.0, per_token_ms=0.5, per_pass_ms=0.0, per_row_ms=0.0),
                                online_cost=False, hold_max=32, hold_share=0.0, suffix_recalibrate=False, **settings)
        policy.cadence.decide_ms, policy.cadence.held_rate = decide_ms, 1.0  # every recent step held
        ctx = policy._ctx(rows, torch.device("cpu"))
        copy, choice = take_suffix(policy, rows, ctx, *(t.clone() for t in plan))
        return bool(copy[0]), float(choice.suffix_expect[0]) if choice.suffix_expect is not None else None

    taken, won = choose(0.0)
    assert taken and 0.05 < won < 1.0  # worth its 0.5 ms when plain steps cost 10.5 ms
    s = 10.5 - 11.0 / (1.0 + won) + 0.2  # just more than the copy's tokens pay for
    assert s < 0.5 * 10.5
    assert not choose(s)[0]
    assert choose(s, hold_price=False)[0]
    assert choose(s - 0.4)[0]  # a decision that costs less: the copy still pays
    policy = AdaptivePolicy(hold_max=32, hold_share=0.0)
    policy.cadence.decide_ms = 2.0
    assert policy.cadence.saving(policy, 1, 10.5) == 0.0  # no step held yet: nothing to save
    policy.cadence.left = 1
    policy.cadence.held()
    assert policy.cadence.saving(policy, 1, 10.5) == pytest.approx(0.2)  # one in ten recent steps held
