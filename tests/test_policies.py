"""Policies: registry, the greedy prefix scheduler, promises (exact rules for lossless rows, TVD
budgets, non-anticipation), SLA weighting, and every policy running inside the real engine."""

from __future__ import annotations

import pytest
import torch

import policies
from adapt.controller import build_policy, reload
from adapt.policy_file import PolicyFile
from adapt.targets import RequestTargets
from kernels.rules import EXACT_RULES, Rule
from policies.adaptive.plan import lam, recent_accept
from policies.greedy import greedy_prefix
from workers.decisions import DraftFeatures, DraftIntent, RowState, StepOutcome, exact_rules
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE, SUFFIX_CODE
from workers.step_record import StepRecord
from workers.request import DecodeKnobs

BASE = ("adaptive", "batch-schedule", "dspark", "static")


def make_rows(B, K=8, quality=None, targets=None, temperature=None, tvd_spent=None, ids=None):
    quality = quality or ["lossless"] * B
    temp = torch.tensor(temperature if temperature is not None else [0.8] * B, dtype=torch.float32)
    return RowState(request_ids=ids or [f"r{i}" for i in range(B)],
                    knobs=[DecodeKnobs(draft_len=K, quality=q) for q in quality],
                    targets=targets or [RequestTargets(quality=q) for q in quality],
                    position=torch.full((B,), 64), generated=torch.full((B,), 10), temperature=temp,
                    recent_accept=torch.full((B,), 0.5),
                    tvd_spent=torch.tensor(tvd_spent if tvd_spent is not None else [0.0] * B),
                    remaining=torch.full((B,), 100), batch_size=B, block_size=K)


def make_draft(rows, steps, conf):
    B, K = conf.shape
    cond = (steps <= 1) | torch.zeros(B, dtype=torch.bool)
    return DraftFeatures(steps, conf, torch.rand(B, K), conf / 2, exact_rules(rows.temperature, cond), cond)


def intent_of(steps, span: int = 0) -> DraftIntent:
    """The applied intent of per-row steps: > 0 diffusion passes, 0 no draft, -1 a suffix copy."""
    steps = torch.as_tensor(steps).to(torch.int64).cpu()
    source = torch.where(steps > 0, DIFFUSION_CODE, torch.where(steps < 0, SUFFIX_CODE, NONE_CODE))
    return DraftIntent(source, steps.clamp(min=0), span)


def verify(p, rows, draft):
    """`after_draft` under the intent the draft was drafted with (its steps)."""
    return p.after_draft(rows, intent_of(draft.steps), draft)


def observe(p, rows, steps, outcome) -> None:
    """`observe` of a step whose rows drafted with ``steps`` [B] (`intent_of`)."""
    p.observe(StepRecord.of(rows, intent_of(steps), outcome))


def test_registry():
    assert set(BASE) <= set(policies.names())
    for name in policies.names():
        p = policies.get(name)
        assert p.name == name and hasattr(p, "before_draft") and hasattr(p, "after_draft") and hasattr(p, "observe")
    with pytest.raises(ValueError, match="unknown policy"):
        policies.get("nope")
    with pytest.raises(ValueError, match="bad settings"):
        policies.get("static", wings=2)
    with pytest.raises(ValueError, match="draft_len"):
        policies.get("static", draft_len=-1)
    with pytest.raises(ValueError, match="steps_grid"):
        policies.get("adaptive", steps_grid=(0,))


def test_greedy_prefix_admits_prefixes_by_value():
    values = torch.tensor([[0.9, 0.8, 0.1, 0.05], [0.95, 0.2, 0.1, 0.0]])
    flat = lambda n: torch.ones_like(n, dtype=torch.float32)  # noqa: E731  verification is free
    k, _ = greedy_prefix(values, 2.0, 2, flat, "argmax")
    assert k.tolist() == [4, 3]  # every slot worth anything (the zero slot is not admitted)
    steep = lambda n: 1.0 + 0.5 * n.float()  # noqa: E731  each token costs half a base step
    k, theta = greedy_prefix(values, 2.0, 2, steep, "argmax")
    assert k.tolist() == [0, 0] or k.tolist()[0] >= k.tolist()[1]
    # moderate cost: only high-survival slots
    k, _ = greedy_prefix(values, 2.0, 2, lambda n: 1.0 + 0.1 * n.float(), "argmax")
    assert k.tolist() == [2, 1]
    # a row whose values rise after a dip still gets a prefix (survival is made monotone)
    k, _ = greedy_prefix(torch.tensor([[0.9, 0.1, 0.9]]), 1.0, 1, flat, "first_drop")
    assert k.tolist() == [3] or k.tolist()[0] <= 3


def test_lossless_rows_get_exact_rules_and_eps_rows_stay_in_budget():
    B, K = 8, 8
    quality = ["lossless", "tvd=0.2"] * 4
    targets = [RequestTargets(quality=q, tvd_budget_total=(0.3 if q != "lossless" else None)) for q in quality]
    spent = [0.0, 0.0, 0.0, 0.25, 0.0, 0.3, 0.0, 0.1]
    rows = make_rows(B, K, quality, targets, temperature=[0.8] * 4 + [0.0, 0.8, 0.8, 0.8], tvd_spent=spent)
    conf = torch.rand(B, K, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.5
    for name in policies.names():
        # adaptive may decline to draft with the built-in stand-in predictor: made to draft here
        p = policies.get(name, **({"allow_no_draft": False} if name == "adaptive" else {}))
        steps = p.before_draft(rows).steps
        draft = make_draft(rows, torch.where(steps > 0, 1, 0), conf)
        d = verify(p, rows, draft)
        for i in range(B):
            if quality[i] == "lossless" or rows.temperature[i] == 0 or name == "dspark":  # dspark: exact only
                assert int(d.rule[i]) in EXACT_RULES, (name, i)
            if int(d.rule[i]) == Rule.EPS_TVD:
                eps = float(d.param[i])
                assert 0 < eps <= 0.2 + 1e-6
                left = 0.3 - spent[i]
                assert eps * int(d.draft_len[i]) <= left + 1e-6, (name, i)  # worst case stays in budget
        assert int(d.rule[5]) != Rule.EPS_TVD  # budget spent
        assert (d.draft_len <= K).all() and (d.draft_len >= 0).all()
        lenient = [i for i in range(B) if int(d.rule[i]) == Rule.EPS_TVD and int(d.draft_len[i]) > 0]
        if name != "dspark":
            assert lenient, f"{name}: no row spent its budget, so the checks above checked nothing"


def test_dspark_and_adaptive_verify_more_where_confidence_is_high():
    B, K = 4, 8
    rows = make_rows(B, K)
    conf = torch.tensor([[0.99] * K, [0.9] * K, [0.5] * K, [0.1] * K])
    pf = PolicyFile()
    pf.cost = __import__("adapt.cost_model", fromlist=["CostModel"]).CostModel(
        __import__("adapt.cost_model", fromlist=["Table"]).Table([1, 8, 64], [5.0, 8.0, 40.0]),
        __import__("adapt.cost_model", fromlist=["Table"]).Table([1, 64], [1.0, 4.0]))
    for name in ("dspark", "adaptive"):
        p = build_policy(name, pf, **({"flat_share": 0.0} if name == "adaptive" else {}))
        steps = p.before_draft(rows).steps
        d = verify(p, rows, make_draft(rows, torch.ones(B, dtype=torch.long), conf))
        k = d.draft_len.tolist()
        assert k == sorted(k, reverse=True) and k[0] > k[3], (name, k)


def test_adaptive_favours_rows_behind_their_target():
    B, K = 2, 8
    targets = [RequestTargets(tpot_ms=5.0), RequestTargets(tpot_ms=500.0)]
    rows = make_rows(B, K, targets=targets)
    from adapt.cost_model import CostModel, Table

    cost = CostModel(Table([1, 8, 64], [5.0, 6.0, 30.0]), Table([1, 64], [1.0, 4.0]))
    p = policies.get("adaptive", cost=cost, flat_share=0.0)
    conf = torch.full((B, K), 0.7)
    for _ in range(3):  # both rows get 10 ms per token: row 0 is 2x late, row 1 early
        intent = p.before_draft(rows)
        verify(p, rows, make_draft(rows, torch.ones(B, dtype=torch.long), conf))
        observe(p, rows, intent.steps, StepOutcome(torch.tensor([0, 0]), torch.tensor([4, 4]), torch.zeros(2), 0.010, 10))
    p.before_draft(rows)
    ctx = p._ctx(rows, "cpu")
    w = p.weights(ctx)
    assert w[0] > w[1] == 1.0
    d = verify(p, rows, make_draft(rows, torch.ones(B, dtype=torch.long), conf))
    assert d.draft_len[0] >= d.draft_len[1]


def test_adaptive_non_anticipating_rows_read_only_earlier_positions():
    """Sampled lossless rows after left-to-right s > 1 drafting: k at position j must not change
    when features of positions > j change (the threshold is fixed before drafting)."""
    B, K = 3, 8
    rows = RowState(request_ids=["a", "b", "c"],
                    knobs=[DecodeKnobs(draft_len=K, commit_order="left-to-right") for _ in range(B)],
                    targets=[None] * B, position=torch.full((B,), 10), generated=torch.full((B,), 5),
                    temperature=torch.full((B,), 0.9), recent_accept=torch.full((B,), 0.6),
                    tvd_spent=torch.zeros(B), remaining=torch.full((B,), 50), batch_size=B, block_size=K)
    p = policies.get("adaptive", steps_grid=(1, 2), flat_share=0.0)
    p.threshold = torch.tensor(0.3)
    steps = torch.full((B,), 2)
    cond = torch.ones(B, dtype=torch.bool)
    conf = torch.linspace(0.95, 0.3, K).expand(B, K).clone()
    p.before_draft(rows)
    d1 = verify(p, rows, DraftFeatures(steps, conf, torch.zeros(B, K), conf / 2,
                                             exact_rules(rows.temperature, cond), cond))
    assert (d1.rule == Rule.REJECTION).all()
    k = int(d1.draft_len[0])
    assert 0 < k < K
    for value in (0.999, 0.01):
        conf2 = conf.clone()
        conf2[:, k + 1:] = value  # positions after the first unverified one: no say in the decision
        p.threshold = torch.tensor(0.3)  # λ is fixed before drafting (the last step set it)
        d2 = verify(p, rows, DraftFeatures(steps, conf2, torch.zeros(B, K), conf2 / 2,
                                                 exact_rules(rows.temperature, cond), cond))
        assert d2.draft_len.tolist() == d1.draft_len.tolist()
    conf3 = conf.clone()
    conf3[:, k:] = 0.01  # lowering the first unverified position keeps every verified one verified
    p.threshold = torch.tensor(0.3)
    d3 = verify(p, rows, DraftFeatures(steps, conf3, torch.zeros(B, K), conf3 / 2,
                                             exact_rules(rows.temperature, cond), cond))
    assert d3.draft_len.tolist() == d1.draft_len.tolist()


def test_batch_schedule_follows_the_batch_size():
    p = policies.get("batch-schedule", schedule={1: 8, 4: 4, 16: 1})
    for B, want in ((1, 8), (3, 8), (4, 4), (20, 1)):
        rows = make_rows(B)
        p.before_draft(rows)
        d = verify(p, rows, make_draft(rows, torch.ones(B, dtype=torch.long), torch.rand(B, 8)))
        assert d.draft_len.tolist() == [want] * B
    with pytest.raises(ValueError, match="schedule"):
        policies.get("batch-schedule", schedule={4: 2})


def test_hot_reload_swaps_predictor_and_settings():
    p = build_policy("adaptive")
    pf = PolicyFile(settings={"sla_weight": 5.0, "steps_grid": [1, 3]})
    version = reload(p, pf)
    assert p.sla_weight == 5.0 and p.steps_grid == (1, 3) and p.predictor is pf.predictor and version == ""
    with pytest.raises(ValueError, match="not a setting"):
        p.update(colour=1)


def test_hot_reload_can_keep_the_workers_own_cost_model():
    from adapt.cost_model import CostModel

    own = CostModel()
    p = build_policy("adaptive", cost=own)
    reload(p, PolicyFile(settings={"sla_weight": 3.0}), keep_cost=True)
    assert p.cost is own and p.sla_weight == 3.0
    reload(p, PolicyFile())
    assert p.cost is not own


def _cost(draft_pass_ms: float, verify_ms: float = 5.0):
    from adapt.cost_model import CostModel, Table

    return CostModel(Table([1, 1024], [verify_ms, verify_ms + 0.01]), Table([1, 256], [draft_pass_ms, draft_pass_ms]))


def test_adaptive_decodes_without_drafts_when_drafting_does_not_pay():
    rows = make_rows(4)
    costly = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0))
    assert costly.before_draft(rows).steps.tolist() == [0, 0, 0, 0]
    cheap = policies.get("adaptive", cost=_cost(draft_pass_ms=0.01))
    assert (cheap.before_draft(rows).steps >= 1).all()
    never = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0), allow_no_draft=False)
    assert (never.before_draft(rows).steps >= 1).all()


def test_a_negative_no_draft_margin_declines_drafts_that_are_not_predicted_to_pay_that_much():
    """Drafting nearly free: the default drafts every row; with ``no_draft_margin`` -0.9 a draft
    must be predicted to earn ten times a plain step's tokens per ms, which these rows' drafts
    are not, so every row goes without; below -0.9 the setting is refused."""
    rows = make_rows(4)
    assert (policies.get("adaptive", cost=_cost(draft_pass_ms=0.01)).before_draft(rows).steps >= 1).all()
    against = policies.get("adaptive", cost=_cost(draft_pass_ms=0.01), no_draft_margin=-0.9)
    assert against.before_draft(rows).steps.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="no_draft_margin"):
        policies.get("adaptive", no_draft_margin=-1.0)


def test_sla_guard_plan_keeps_a_protected_row_on_target_while_others_draft():
    """Row 0 meets a 5.02 ms/token target with 0.2 ms to spare (ten 5 ms plain steps). A drafter
    pass of one row costs 0.5 ms, of two rows 5 ms, so the unguarded plan drafts for the
    confident row 1 alone. That step (5.5 ms) would bring row 0 one token and put it past its
    target; drafting for both (10 ms) would too, as row 0's drafts are predicted to win little:
    with `sla_guard_plan` the plan keeps both rows plain."""
    import dataclasses

    from adapt.cost_model import CostModel, Table

    targets = [RequestTargets(tpot_ms=5.02), RequestTargets()]
    rows = dataclasses.replace(make_rows(2, targets=targets), recent_accept=torch.tensor([0.0, 0.95]))
    cost = CostModel(Table([1, 1024], [5.0, 5.01]), Table([1, 2, 256], [0.5, 5.0, 500.0]))
    chosen = {}
    for guard in (False, True):
        p = policies.get("adaptive", cost=cost, online_cost=False, hold_max=0, sla_slack=1.0, sla_guard_plan=guard)
        for _ in range(10):
            observe(p, rows, torch.zeros(2), StepOutcome(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                                                         torch.zeros(2), 0.005, 2))
        chosen[guard] = p.before_draft(rows).steps.tolist()
    assert chosen[False][0] == 0 and chosen[False][1] >= 1
    assert chosen[True] == [0, 0]


def test_adaptive_plans_short_drafts_before_it_knows_a_threshold():
    """A fresh policy has verified nothing, so λ (the worth of the marginal verified slot) is
    unknown; a plan at λ = 0 would verify the whole block, which on a CPU costs twice a plain
    step and prices drafting out for good (a plan that never drafts never learns a λ). The
    plain step's λ floors it: the first plan drafts a short prefix."""
    from adapt.cost_model import CostModel, Table

    cost = CostModel(Table([1, 4, 8, 17, 1024], [14.0, 14.5, 16.0, 30.0, 500.0]), Table([1, 256], [3.0, 3.0]))
    p = policies.get("adaptive", cost=cost)
    assert float(p.threshold) == 0.0
    assert p.before_draft(make_rows(1, 16, temperature=[0.0])).steps.tolist() == [1]
    assert 2 <= int(p._plan.toks[0]) <= 8  # planned verified positions (bonus included): a short prefix
    # where verifying the whole block is nearly free, the floor keeps every slot worth anything
    flat = policies.get("adaptive", cost=CostModel(Table([1, 1024], [14.0, 14.0]), Table([1, 256], [3.0, 3.0])))
    assert float(lam(flat, 1.0, 1)) == 0.0


def test_adaptive_offers_drafting_again_to_rows_that_stopped():
    p = policies.get("adaptive", idle_decay=0.5)
    import dataclasses

    rows = dataclasses.replace(make_rows(2), recent_accept=torch.tensor([0.1, 0.1]))
    p.predictor.typical_recent = torch.tensor([0.7, 0.7])
    # row 0 verified drafts, row 1 did not, for 6 steps
    for _ in range(6):
        observe(p, rows, torch.tensor([1, 0]), StepOutcome(torch.tensor([1, 0]), torch.tensor([2, 0]), torch.zeros(2), 0.01, 4))
    recent = recent_accept(p, rows, p._ctx(rows, "cpu")["idle"], p.predictor)
    assert recent[0] < 0.2 and recent[1] > 0.6  # the idle row reads close to its class's typical value
    with pytest.raises(ValueError, match="idle_decay"):
        policies.get("adaptive", idle_decay=1.5)


def test_rows_without_verified_drafts_read_their_class_typical_acceptance():
    import dataclasses

    from workers.decisions import RECENT_NONE

    p = policies.get("adaptive")
    p.predictor.typical_recent = torch.tensor([0.8, 0.3])
    rows = dataclasses.replace(make_rows(3), temperature=torch.tensor([0.0, 0.9, 0.9]),
                               recent_accept=torch.tensor([RECENT_NONE, RECENT_NONE, 0.6]))
    recent = recent_accept(p, rows, torch.zeros(3), p.predictor)
    assert recent.tolist() == pytest.approx([0.8, 0.3, 0.6])


# -- in the real engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.tiny_models import make_tiny_pair

    # vocab 16: even an untrained drafter gets a good share of its drafts accepted
    return make_tiny_pair(tmp_path_factory.mktemp("pair"), vocab=16, block_size=8, seed=3)


def _serve(pair, decisions, requests, trace=None):
    from workers.engine import Engine, EngineConfig
    from workers.request import SamplingParams

    engine = Engine(EngineConfig(target=pair[0], drafter=pair[1], device="cpu", dtype="float32", max_batch=8,
                                 max_len=128), decisions=decisions, trace_sink=trace)
    outs: dict[str, list[int]] = {}
    for rid, prompt, temp, quality, targets in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=24, temperature=temp, seed=7, ignore_eos=True),
                           DecodeKnobs(draft_len=8, quality=quality), targets=targets)
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o.stats
    return outs, final


def test_every_policy_runs_in_the_engine_and_keeps_its_promises(pair):
    from workers.engine import Engine, EngineConfig
    from workers.request import SamplingParams
    from workers.traces import ListTraceSink

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 16, (6,), generator=g).tolist() for _ in range(6)]
    quality = ["lossless", "tvd=0.2", "lossless", "tvd=0.2", "lossless", "lossless"]
    temps = [0.0, 0.8, 0.8, 0.8, 0.0, 0.0]
    budget = [None, 0.5, None, 0.5, None, None]
    requests = [(f"r{i}", prompts[i], temps[i], quality[i],
                 RequestTargets(tpot_ms=50, quality=quality[i], tvd_budget_total=budget[i])) for i in range(6)]
    # reference: the target alone, greedy (autoregressive: no drafter)
    ref_engine = Engine(EngineConfig(target=pair[0], drafter=None, device="cpu", dtype="float32", max_batch=8,
                                     max_len=128))
    reference = {}
    for rid, prompt, temp, q, _ in requests:
        if temp == 0:
            ref_engine.add_request(rid, prompt, SamplingParams(max_tokens=24, ignore_eos=True), DecodeKnobs(draft_len=0))
    while ref_engine.has_unfinished():
        for o in ref_engine.step():
            reference.setdefault(o.request_id, []).extend(o.new_token_ids)
    # adaptive twice: forced to draft (so verification is exercised), and as configured by default,
    # where it may decode rows without drafts when the stand-in cost model says drafting does not pay
    runs = [(name, {}) for name in BASE + ("explore",)] + [("adaptive", {"allow_no_draft": False})]
    for name, settings in runs:
        sink = ListTraceSink()
        outs, stats = _serve(pair, build_policy(name, **settings), requests, sink)
        assert all(len(v) == 24 for v in outs.values()), name
        for rid in reference:  # lossless greedy rows: token for token the target's own greedy output
            assert outs[rid] == reference[rid], (name, rid)
        if settings or name != "adaptive":
            assert sum(rec["accepted"] for rec in sink.records) > 10, name  # drafts were really accepted
        for rec in sink.records:
            i = int(rec["request_id"][1:])
            if quality[i] == "lossless":
                assert rec["rule"] in EXACT_RULES, (name, rec)
            elif rec["rule"] == Rule.EPS_TVD:
                assert rec["param"] <= 0.2 + 1e-6
        for i in (1, 3):
            assert stats[f"r{i}"]["tvd_spent"] <= 0.5 + 1e-5, (name, stats[f"r{i}"])


def test_profile_engine_times_the_engine_and_leaves_it_clean(pair):
    from adapt.controller import profile_engine
    from workers.decisions import StaticDecisions
    from workers.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(target=pair[0], drafter=pair[1], device="cpu", dtype="float32", max_batch=4,
                                 max_len=128))
    before = engine.decisions
    cost = profile_engine(engine, token_grid=(1, 8, 36), row_grid=(1, 2, 4), repeats=1, overhead_steps=4)
    assert cost.source == "profile" and cost.overhead_ms >= 0.0
    assert cost.verify.at(36.0) >= cost.verify.at(1.0) > 0 and cost.draft_pass.at(4.0) > 0
    assert cost.block == engine.block and 0.0 < cost.span_share <= 1.0  # a one-position pass against a block
    assert not engine.has_unfinished() and engine.decisions is before
    assert isinstance(before, StaticDecisions)
    engine.add_request("later", [1, 2, 3], None, None)  # the engine serves normally afterwards
    while engine.has_unfinished():
        engine.step()
    # by default every token count up to 8 is timed (a compiled forward is not linear between
    # powers of two there), then coarser counts up to 128
    default = profile_engine(engine, repeats=1, overhead_steps=2)
    assert default.verify.xs.tolist()[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 10] and default.verify.xs.tolist()[-1] == 128


def test_adaptive_charges_the_drafting_paths_learned_extra_cost():
    """Steps that verify drafts took 50 ms more than the cost model said, steps without drafts
    took what it said: the policy learns that difference (`draft_overhead_ms`) and stops drafting
    rows it drafted before."""
    import dataclasses

    from policies.base import rows_per_pass

    rows = dataclasses.replace(make_rows(4, 8), recent_accept=torch.full((4,), 0.97))
    p = policies.get("adaptive")
    assert p.before_draft(rows).steps.gt(0).all() and p.draft_overhead_ms == 0.0
    for drafted in [False, True] * 10:
        steps = torch.full((4,), 1 if drafted else 0)
        n = 4 * (5 if drafted else 1)
        predicted = p.cost.step_ms_at(float(n), rows_per_pass(steps))
        observe(p, rows, steps, StepOutcome(torch.zeros(4, dtype=torch.long), torch.full((4,), 4 if drafted else 0),
                                    torch.zeros(4), (predicted + (50.0 if drafted else 0.0)) / 1e3, n))
    assert 40.0 < p.draft_overhead_ms <= 50.0 + 1e-6
    p._plan = None  # re-plan now
    assert p.before_draft(rows).steps.eq(0).all()


def test_adaptive_learns_the_drafting_paths_extra_cost_per_batch_size():
    """The drafting path's fixed cost grows with the batch (attention over drafted positions, the
    acceptance path): drafting steps of 8 rows took 60 ms more than the cost model said, of 2
    rows 1 ms more. The policy keeps one estimate per batch-size bucket, so the dear one does
    not stop a 2-row batch from drafting; a size it never saw borrows the nearest bucket, scaled
    up by the ratio of rows where that bucket is smaller (`overhead_scales`), never down."""
    import dataclasses

    from policies.adaptive import batch_bucket
    from policies.base import rows_per_pass

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]
    p = policies.get("adaptive")
    for B, extra in ((8, 60.0), (2, 1.0)):
        rows = dataclasses.replace(make_rows(B, 8), recent_accept=torch.full((B,), 0.97))
        for drafted in [False, True] * 12:
            steps = torch.full((B,), 1 if drafted else 0)
            n = B * (5 if drafted else 1)
            predicted = p.cost.step_ms_at(float(n), rows_per_pass(steps))
            observe(p, rows, steps, StepOutcome(torch.zeros(B, dtype=torch.long), torch.full((B,), 4 if drafted else 0),
                                        torch.zeros(B), (predicted + (extra if drafted else 0.0)) / 1e3, n))
    assert 45.0 < p.draft_overhead_at(8) <= 60.0 + 1e-6
    assert 0.5 < p.draft_overhead_at(2) <= 1.0 + 1e-6
    assert p.draft_overhead_at(6) == p.draft_overhead_at(8)        # the same bucket
    assert p.draft_overhead_at(32) == 4 * p.draft_overhead_at(8)   # nearest bucket seen, 4x the rows
    assert p.draft_overhead_at(4) == 2 * p.draft_overhead_at(2)    # (2 and 8 equally near: the smaller)
    assert p.draft_overhead_at(1) == p.draft_overhead_at(2)        # a larger bucket: not scaled down
    p.overhead_scales = False
    assert p.draft_overhead_at(32) == p.draft_overhead_at(8)
    two = dataclasses.replace(make_rows(2, 8), recent_accept=torch.full((2,), 0.97))
    p._plan = None
    assert p.before_draft(two).steps.gt(0).all()


def _observe_steps(p, rows, kinds, extra_ms):
    """Feed policy ``p`` one step per kind ("plain" or "diffusion") over ``rows``, each taking its
    cost model's prediction plus ``extra_ms(i, kind)``."""
    from policies.base import rows_per_pass

    B = len(rows.request_ids)
    for i, kind in enumerate(kinds):
        steps = torch.full((B,), 1 if kind == "diffusion" else 0)
        n = B * (5 if kind == "diffusion" else 1)
        predicted = p.cost.step_ms_at(float(n), rows_per_pass(steps))
        observe(p, rows, steps, StepOutcome(torch.zeros(B, dtype=torch.long), torch.full((B,), 4 if kind == "diffusion" else 0),
                                    torch.zeros(B), (predicted + extra_ms(i, kind)) / 1e3, n))


def test_adaptive_learns_nothing_from_one_stalled_step():
    """A drafting step that stalled 600 ms (a page fault, a noisy neighbour) among steps that took
    what the cost model said: the drafting path's learned extra cost stays ~0 (each residual EMA
    follows the median of its kind's last three steps), and the policy goes on drafting."""
    import dataclasses

    rows = dataclasses.replace(make_rows(1, 8), recent_accept=torch.full((1,), 0.97))
    p = policies.get("adaptive")
    _observe_steps(p, rows, ["plain", "diffusion"] * 6, lambda i, kind: 600.0 if i == 5 else 0.0)
    assert abs(p.draft_overhead_at(1)) < 1.0
    p._plan = None
    assert p.before_draft(rows).steps.gt(0).all()


def test_adaptive_halves_a_drafting_penalty_that_no_step_has_measured_for_long():
    """Drafting steps learned to cost 50 ms more than plain ones (a slow spell), so the policy
    stopped drafting and no step measures that extra again: after `STALE_STEPS` plain
    steps the penalty is halved, after as many more halved again, until the policy drafts (and
    measures) once more."""
    import dataclasses

    from adapt.cost_model import STALE_STEPS

    rows = dataclasses.replace(make_rows(1, 8), recent_accept=torch.full((1,), 0.97))
    p = policies.get("adaptive", hold_max=0)
    _observe_steps(p, rows, ["plain", "diffusion"] * 6, lambda i, kind: 50.0 if kind == "diffusion" else 0.0)
    learned = p.draft_overhead_at(1)
    assert learned > 40.0
    p._plan = None
    assert p.before_draft(rows).steps.eq(0).all()  # priced out
    _observe_steps(p, rows, ["plain"] * (STALE_STEPS - 2), lambda i, kind: 0.0)
    assert p.draft_overhead_at(1) == pytest.approx(learned, rel=0.05)  # not yet stale
    _observe_steps(p, rows, ["plain"] * 4, lambda i, kind: 0.0)
    assert p.draft_overhead_at(1) == pytest.approx(learned / 2, rel=0.1)
    _observe_steps(p, rows, ["plain"] * (4 * STALE_STEPS), lambda i, kind: 0.0)
    assert p.draft_overhead_at(1) < learned / 8
    p._plan = None
    assert p.before_draft(rows).steps.gt(0).all()  # tried again: the next drafting step measures the cost anew


def test_adaptive_holds_a_plain_decision_for_a_growing_number_of_steps():
    """Decision cadence: after a plain decision (nothing pays) the policy answers the next 1, 2,
    4, ... (at most hold_max) steps without deciding and asks the engine for no suffix drafts;
    requests leaving the batch keep the hold, a request joining it keeps it too in batches of at
    least `hold_joins_rows` rows, else ends it; a decision that drafts resets the growth."""
    import dataclasses

    rows = make_rows(4)
    p = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0), hold_max=4, hold_share=0.0, hold_joins_rows=4)
    decided = []
    inner = p._choose
    p._choose = lambda r, ctx: decided.append(1) or inner(r, ctx)
    held = []
    for _ in range(16):
        held.append(p.holding)
        assert p.reads_suffix == (not p.holding)
        assert p.before_draft(rows).steps.tolist() == [0, 0, 0, 0]
    assert [i for i, h in enumerate(held) if h] == [1, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14]  # holds of 1, 2, 4, 4
    assert len(decided) == 5 and p.stats()["held_share"] == pytest.approx(11 / 16)
    assert p.holding  # a hold of 4 begins after step 15's plain decision
    # a request leaves (and the slots are reordered): nothing new to look at, the hold goes on
    assert p.before_draft(make_rows(3, ids=["r2", "r0", "r1"])).steps.tolist() == [0, 0, 0]
    # a request joins a batch of 4 rows (`hold_joins_rows`): it takes plain steps until the hold runs out
    joined = make_rows(4, ids=["r0", "r1", "r2", "new"])
    assert p.before_draft(joined).steps.tolist() == [0, 0, 0, 0]
    assert len(decided) == 5 and p.holding
    # in a batch below `hold_joins_rows` (the default 8) a request joining ends the hold: the
    # policy decides (without the suffix drafts the engine skipped) and does not hold
    strict = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0), hold_max=4, hold_share=0.0)
    strict_decided = []
    inner_strict = strict._choose
    strict._choose = lambda r, ctx: strict_decided.append(1) or inner_strict(r, ctx)
    for _ in range(3):  # decided, held, decided: a hold of 2 begins
        strict.before_draft(rows)
    assert strict.holding and len(strict_decided) == 2
    strict.before_draft(make_rows(3, ids=["r2", "r0", "r1"]))  # a request left: still held
    assert len(strict_decided) == 2 and strict.holding
    strict.before_draft(joined)
    assert len(strict_decided) == 3 and not strict.holding and strict.reads_suffix
    # hold_max = 0: decides every step
    q = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0), hold_max=0)
    for _ in range(3):
        q.before_draft(rows)
        assert not q.holding
    # deciding is cheap against a step (hold_share): no hold; dear: hold
    cheap = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0), hold_max=4, hold_share=0.05)
    cheap.costs.plain_ms = 1e6
    cheap.before_draft(rows)
    assert not cheap.holding
    cheap.costs.plain_ms = 1e-6
    cheap.before_draft(rows)
    assert cheap.holding
    # the comparison is with one row's share of the step (plain_ms / B): deciding delays all 4
    # rows, a copy it may catch wins one row's tokens
    share = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0), hold_max=4, hold_share=0.05)
    share.cadence.decide_ms, share.costs.plain_ms = 1000.0, 40_000.0  # ~900 ms after the EMA: < 5 % of the step, > 5 % of a row's share
    share.before_draft(rows)
    assert share.holding
    one = policies.get("adaptive", cost=_cost(draft_pass_ms=500.0), hold_max=4, hold_share=0.05)
    one.cadence.decide_ms, one.costs.plain_ms = 1000.0, 40_000.0
    one.before_draft(make_rows(1))  # a row's share is the whole step at batch 1
    assert not one.holding
    # a decision that drafts: no hold, and the next plain decision holds 1 step again
    r = policies.get("adaptive", cost=_cost(draft_pass_ms=0.01), hold_max=4)
    sure = dataclasses.replace(rows, recent_accept=torch.full((4,), 0.97))
    assert (r.before_draft(sure).steps > 0).all() and not r.holding
    with pytest.raises(ValueError, match="hold_max"):
        policies.get("adaptive", hold_max=-1)
    with pytest.raises(ValueError, match="hold_share"):
        policies.get("adaptive", hold_share=2.0)
    with pytest.raises(ValueError, match="hold_joins_rows"):
        policies.get("adaptive", hold_joins_rows=0)


def test_adaptive_keeps_the_drafting_paths_fixed_cost_out_of_its_cost_tables():
    """A drafting step teaches the cost tables its time less the learned `draft_overhead_ms`
    (charged separately), so the fixed cost is not counted twice; plain steps teach all of it."""
    p = policies.get("adaptive")
    # learned: drafting steps of 2 rows cost 1.5 ms more, of 5–8 rows 20 ms more
    p.costs.step_residual = {("draft", 2): 2.0, ("plain", 2): 0.5, ("draft", 8): 30.0, ("plain", 8): 10.0}
    drafted = StepOutcome(torch.tensor([1, 0]), torch.tensor([3, 0]), torch.zeros(2), 0.010, 6)
    plain = StepOutcome(torch.tensor([0, 0]), torch.tensor([0, 0]), torch.zeros(2), 0.010, 2)
    def record(outcome, steps):
        return StepRecord.of(make_rows(len(steps)), intent_of(steps), outcome)

    drafted = record(drafted, [1, 0])
    assert p._table_ms(drafted, 10.0) == pytest.approx(8.5)
    assert p._table_ms(record(plain, [0, 0]), 10.0) == pytest.approx(10.0)
    wide = StepOutcome(torch.zeros(6, dtype=torch.long), torch.tensor([3, 0, 0, 0, 0, 0]), torch.zeros(6), 0.1, 9)
    assert p._table_ms(record(wide, [1, 0, 0, 0, 0, 0]), 100.0) == pytest.approx(80.0)
    assert policies.get("dspark")._table_ms(drafted, 10.0) == 10.0


def test_adaptive_prices_diffusion_and_suffix_steps_by_one_estimate_of_the_drafting_extra():
    """Suffix-only steps that took 40 ms more than the cost model said and diffusion steps that
    took 1 ms more: one estimate of every drafting step's extra prices both sources (one per
    source measured worse live at 2 and 8 requests, docs/benchmarks.md)."""
    import dataclasses

    from policies.base import rows_per_pass

    B = 2
    rows = dataclasses.replace(make_rows(B, 8), recent_accept=torch.full((B,), 0.97))
    p = policies.get("adaptive", hold_max=0)
    for kind in ["plain", "suffix", "diffusion"] * 12:
        steps = torch.full((B,), {"plain": 0, "suffix": -1, "diffusion": 1}[kind])
        n = B * (1 if kind == "plain" else 5)
        predicted = p.cost.step_ms_at(float(n), rows_per_pass(steps))
        extra = {"plain": 0.0, "suffix": 40.0, "diffusion": 1.0}[kind]
        observe(p, rows, steps, StepOutcome(torch.zeros(B, dtype=torch.long), torch.full((B,), 0 if kind == "plain" else 4),
                                    torch.zeros(B), (predicted + extra) / 1e3, n))
    assert p.draft_overhead_at(B) == p.draft_overhead_at(B, "suffix") > 10.0
    assert p.draft_overhead_ms == p.draft_overhead_at(B)
    assert "draft@2" in p.stats()["step_residual"]


def test_request_book_measures_time_per_token_as_the_client_does():
    """With the rows' wall time since their first token (`RowState.decode_ms`, as the engine
    gives it), the book's elapsed time, token count and lateness are the client's TPOT, prefills
    between decode steps included; `sla_clock="decode"` keeps the sum of the steps' own times."""
    import dataclasses

    from policies.adaptive import AdaptivePolicy
    from policies.common import RequestBook

    rows = RowState(request_ids=["a", "b"], knobs=[DecodeKnobs()] * 2, targets=[RequestTargets(tpot_ms=50.0), None],
                    position=torch.tensor([10, 12]), generated=torch.tensor([5, 1]), temperature=torch.zeros(2),
                    recent_accept=torch.zeros(2), tvd_spent=torch.zeros(2), remaining=torch.tensor([20, 20]),
                    batch_size=2, block_size=4)
    book = RequestBook()
    book.observe(rows, torch.tensor([4, 0]), 30.0)  # the sum of decode steps: 30 ms for row a's 4 tokens
    decode = book.tensors(rows, None)
    assert decode["elapsed_ms"].tolist() == [30.0, 30.0] and decode["lateness"][0] == pytest.approx(30.0 / 4 / 50.0)
    walled = dataclasses.replace(rows, decode_ms=torch.tensor([400.0, 10.0]))  # a prefill stalled row a
    wall = book.tensors(walled, None)
    assert wall["elapsed_ms"].tolist() == [400.0, 10.0] and wall["tokens"].tolist() == [4.0, 0.0]
    assert wall["lateness"][0] == pytest.approx(400.0 / 4 / 50.0) and wall["lateness"][1] == 0.0
    policy = AdaptivePolicy(sla_clock="decode")
    assert policy.sla_clock == "decode" and not policy.book.wall_clock
    policy.update(sla_clock="wall")
    assert policy.book.wall_clock
    with pytest.raises(ValueError, match="sla_clock"):
        AdaptivePolicy(sla_clock="cpu")



def _learn_diffusion(p, rows, won_share, steps: int) -> list[list[int]]:
    """``steps`` engine steps in which each diffusion row wins ``won_share(level)`` of the extra
    tokens the plan's prior predicted for it; returns the steps chosen, step by step."""
    B = len(rows.request_ids)
    history = []
    for _ in range(steps):
        chosen = p.before_draft(rows).steps
        history.append(chosen.tolist())
        expect, level = p.step.diffusion_expect
        won = (expect * won_share(level)).round().long()
        observe(p, rows, chosen, StepOutcome(won, (chosen > 0).long() * 3, torch.zeros(B), 0.02, B))
    return history


def test_adaptive_recalibrates_the_plans_diffusion_acceptance_per_class():
    """Greedy rows whose diffusion drafts win nothing pull the greedy class's
    `diffusion_accept_ratio` to its floor while sampled rows that win what the plan predicted
    keep theirs at 1; a greedy row alone then no longer drafts, a sampled one does. With
    ``diffusion_recalibrate=False`` the ratios stay 1 and both draft."""
    from adapt.cost_model import CostModel, Table

    cost = CostModel(Table([1, 4, 8, 17, 1024], [14.0, 14.5, 16.0, 30.0, 500.0]), Table([1, 256], [6.0, 6.0]))
    rows = make_rows(2, 16, temperature=[0.0, 1.0])
    for recalibrate in (True, False):
        p = policies.get("adaptive", cost=cost, online_cost=False, hold_max=0, replan_every=1, use_suffix=False,
                         steps_grid=(1,), diffusion_recalibrate=recalibrate)
        assert (p.before_draft(rows).steps >= 1).all()
        # the greedy row (0) wins nothing, the sampled row (1) what was predicted
        _learn_diffusion(p, rows, lambda level: torch.tensor([0.0, 1.0]), 60)
        (greedy,), (sampled,) = p.diffusion_accept_ratio.tolist()
        # alone (no other row's drafter pass to share), a greedy row no longer drafts, a sampled one does
        alone = [p.before_draft(make_rows(1, 16, temperature=[t], ids=[f"r{t}"])).steps.item() for t in (0.0, 1.0)]
        if recalibrate:
            assert greedy < 0.4 and 0.7 < sampled < 1.3
            assert p.stats()["diffusion_accept"]["drafts"] > 60
            assert p.stats()["diffusion_accept"]["ratio"]["greedy"]["1"] == pytest.approx(greedy, abs=1e-3)
            assert alone[0] == 0 and alone[1] >= 1
        else:
            assert greedy == sampled == 1.0 and min(alone) >= 1


def test_adaptive_recalibrates_each_step_count_of_its_grid():
    """The ratio is kept per denoising step count: a plan whose one-step drafts win nothing moves
    the row to two steps (whose ratio stays at 1 while they win what the prior predicts); as
    the evidence against one step fades over steps without it, one step is retried now and then."""
    from adapt.cost_model import CostModel, Table

    cost = CostModel(Table([1, 4, 8, 17, 1024], [14.0, 14.5, 16.0, 30.0, 500.0]), Table([1, 256], [0.5, 0.5]))
    rows = make_rows(1, 16, temperature=[0.0])
    p = policies.get("adaptive", cost=cost, online_cost=False, hold_max=0, replan_every=1, use_suffix=False,
                     steps_grid=(1, 2))
    assert p.before_draft(rows).steps.tolist() == [1]
    _learn_diffusion(p, rows, lambda level: (level == 1).double(), 40)  # one step wins nothing, two win all
    ratio = p.diffusion_accept_ratio
    assert float(ratio[0, 0]) < 0.95 and float(ratio[0, 1]) >= 1.0
    assert p.before_draft(rows).steps.tolist() == [2]
    history = _learn_diffusion(p, rows, lambda level: (level == 1).double(), 400)
    # mostly two steps; one step retried now and then, as its evidence fades
    assert 0 < history.count([1]) < 40 and history.count([2]) > 300


def test_adaptive_credits_drafting_that_runs_under_an_overpriced_profile():
    """A start-up profile priced the drafter pass 12 ms where drafting steps take ~10 ms less:
    with `draft_credit` (the default) diffusion plans get that back as a negative extra, at most
    one drafter pass, and a row whose drafts the overpriced tables priced out drafts again; the
    tables learn the measured time (no credit in `_table_ms`); suffix choices get no credit.
    Without it the extra stays 0 and the row stays plain."""
    import dataclasses

    from adapt.cost_model import CostModel, Table

    rows = dataclasses.replace(make_rows(1, 8), recent_accept=torch.full((1,), 0.3))
    for credit in (True, False):
        cost = CostModel(Table([1, 4, 8, 17, 1024], [14.0, 14.5, 16.0, 30.0, 500.0]), Table([1, 256], [12.0, 12.0]))
        p = policies.get("adaptive", cost=cost, hold_max=0, replan_every=1, steps_grid=(1,), draft_credit=credit)
        assert not bool(p.before_draft(rows).steps.gt(0).any())  # priced out by the profile
        p._plan = None
        _observe_steps(p, rows, ["plain", "diffusion"] * 6, lambda i, kind: -10.0 if kind == "diffusion" else 0.0)
        overhead = p.draft_overhead_at(1)
        out = StepOutcome(torch.zeros(1, dtype=torch.long), torch.full((1,), 4), torch.zeros(1), 0.02, 5)
        assert p._table_ms(StepRecord.of(rows, intent_of([1]), out), 20.0) == pytest.approx(20.0)  # the tables learn what the step took
        assert p.draft_overhead_at(1, "suffix") == 0.0
        p._plan = None
        drafts = bool(p.before_draft(rows).steps.gt(0).all())
        if credit:
            assert -cost.draft_ms_at([1]) - 1e-9 <= overhead < -5.0
            assert drafts
        else:
            assert overhead == 0.0
            assert not drafts


def test_adaptive_acceptance_corrections_skip_pinned_rows():
    """A pinned row drafted as its request said, not as the policy chose: the suffix and
    diffusion acceptance corrections learn only from the other rows (`StepRecord.pinned`)."""
    from policies.adaptive.plan import StepDecision

    def learn(pinned: list[bool]):
        p = policies.get("adaptive", hold_max=0, online_cost=False)
        rows = make_rows(2)
        # row 0 copied its suffix draft (4 tokens predicted), row 1 drafted by diffusion (2 predicted)
        p.step = StepDecision(suffix_expect=torch.tensor([4.0, 0.0]),
                              diffusion_expect=(torch.tensor([0.0, 2.0]), torch.tensor([0, 0])))
        outcome = StepOutcome(torch.tensor([0, 0]), torch.tensor([4, 4]), torch.zeros(2), 0.01, 10)
        p.observe(StepRecord(0, rows, intent_of([-1, 1]), None, outcome, torch.tensor(pinned), {}))
        return p.suffix.drafts, p.suffix.predicted, p.diffusion.drafts, sum(p.diffusion.sums(len(p.steps_grid))[1])

    assert learn([False, False]) == (1, 4.0, 1, 2.0)
    assert learn([True, False]) == (0, 0.0, 1, 2.0)   # the copy was pinned: nothing learned of it
    assert learn([False, True]) == (1, 4.0, 0, 0.0)   # the diffusion draft was pinned


def test_step_costs_are_learned_per_context_bucket():
    """What steps take beyond the cost tables is kept per context bucket of the batch's longest
    row: residuals learned over ~1,800-token documents do not price a short chat request's drafts
    (its bucket starts without evidence, so drafting is tried), and come back when a long row does.
    With ``cost_by_context=False`` one set serves every context."""
    import dataclasses

    from policies.adaptive.calibration import StepCosts, context_bucket

    assert [context_bucket(n) for n in (0, 300, 512, 513, 1800, 2048, 2049)] == [512, 512, 512, 1024, 2048, 2048, 4096]
    costs = StepCosts()
    costs.use_context(1800)
    costs.step_residual.update({("draft", 1): 15.0, ("plain", 1): 4.0})
    costs.plain_ms = 20.0
    assert costs.draft_overhead_at(1, "diffusion", True, True, None) == 11.0
    costs.use_context(300)
    assert costs.step_residual == {} and costs.plain_ms is None and costs.context == 512
    assert costs.draft_overhead_at(1, "diffusion", True, True, None) == 0.0
    costs.use_context(1900)
    assert costs.draft_overhead_at(1, "diffusion", True, True, None) == 11.0 and costs.plain_ms == 20.0

    rows = make_rows(1, 16)
    for by_context in (True, False):
        p = policies.get("adaptive", hold_max=0, online_cost=False, cost_by_context=by_context)
        p.costs.step_residual[("draft", 1)] = 9.0
        long = dataclasses.replace(rows, position=torch.full((1,), 1800))
        p.before_draft(long)
        assert (("draft", 1) in p.costs.step_residual) is not by_context


def test_a_drafting_credit_never_drafts_rows_that_plan_nothing():
    """Drafting steps of 8 rows ran 10 ms under the tables, so diffusion plans get a credit (a
    negative drafting extra) of up to an 8-row drafter pass (12 ms here), while a pass of one
    row costs 1 ms. Rows whose drafts are predicted to win nothing worth verifying (no planned
    prefix) must still not draft: a plan that raised one of them would pay a drafter pass for
    nothing, and with the credit that step was priced under the plain step (measured live on the
    edit prompts at 8 requests: 0.86x autoregressive decoding). The credit lowers what drafting
    adds, never a step below its verify."""
    import dataclasses

    from adapt.cost_model import CostModel, Table

    cost = CostModel(Table([1, 8, 16, 1024], [10.0, 27.0, 40.0, 900.0]), Table([1, 8, 256], [1.0, 12.0, 12.0]))
    p = policies.get("adaptive", cost=cost, hold_max=0, replan_every=1, steps_grid=(1,))
    rows = dataclasses.replace(make_rows(8, 8), recent_accept=torch.full((8,), 0.97))
    _observe_steps(p, rows, ["plain", "diffusion"] * 8, lambda i, kind: -10.0 if kind == "diffusion" else 0.0)
    assert p.draft_overhead_at(8) < -5.0  # the credit
    p.threshold = torch.tensor(50.0)  # no slot is worth verifying: every row plans nothing
    p._plan = None
    assert p.before_draft(rows).steps.tolist() == [0] * 8
    assert p._plan.extra.tolist() == [0.0] * 8
