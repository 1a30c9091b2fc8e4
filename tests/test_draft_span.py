"""The draft span: the engine denoises only the block positions a step may verify
(`DraftIntent.span`, workers/decisions.py), and stays exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import policies
from policies.adaptive.plan import Plan, price_span, span_of
from tests.test_policies import make_rows
from workers.draft_sources import DIFFUSION_CODE
from workers.engine import DEMO_DRAFTER, DEMO_TARGET, Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams

PROMPTS = [[3, 7, 11, 13, 17], [4, 9, 2, 8], [5, 5, 6, 1, 12, 3], [2, 14, 7]]


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(target=DEMO_TARGET, drafter=DEMO_DRAFTER, device="cpu", dtype="float32",
                               max_batch=4, max_len=128, **kw))


def _record_block_widths(engine) -> list[int]:
    """Wrap the engine's denoising pass; returns the list its block widths (K + 1 per pass) go to."""
    widths, inner = [], engine.drafting.draft_pass

    def draft_pass(tokens, masked, *rest):
        widths.append(tokens.shape[1])
        return inner(tokens, masked, *rest)

    engine.drafting.draft_pass = draft_pass
    return widths


def _run(engine, knobs: list[DecodeKnobs], temperature: float = 0.0, tokens: int = 24) -> dict[str, list[int]]:
    for i, (p, kn) in enumerate(zip(PROMPTS, knobs)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=tokens, temperature=temperature, seed=i,
                                                       ignore_eos=True), kn)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_static_knobs_denoise_only_the_longest_verified_draft_and_stay_greedy_exact():
    engine = _engine()
    K = engine.block
    widths = _record_block_widths(engine)
    knobs = [DecodeKnobs(steps=1, draft_len=k) for k in (2, 3, 0, 3)]
    got = _run(engine, knobs)
    assert widths and set(widths) <= {3, 4} and 4 in widths  # [anchor, MASK x span], span = 3 < K
    assert K > 4
    ar = _run(_engine(), [DecodeKnobs(draft_len=0)] * 4)
    assert got == ar  # greedy: token for token the target's own output


def test_sampled_rows_with_a_short_span_and_rows_that_do_not_draft_decode_to_the_end():
    """Sampled lossless and lenient rows beside a row that does not draft: q is `span` wide, rows
    are scattered into it, and every request finishes with its tokens."""
    engine = _engine()
    widths = _record_block_widths(engine)
    knobs = [DecodeKnobs(steps=1, draft_len=2), DecodeKnobs(draft_len=0),
             DecodeKnobs(steps=2, draft_len=3, quality="tvd=0.1"), DecodeKnobs(steps=1, draft_len=1)]
    out = _run(engine, knobs, temperature=0.8, tokens=20)
    assert sorted(out) == ["r0", "r1", "r2", "r3"] and all(len(v) == 20 for v in out.values())
    assert widths and max(widths) == 4


def test_an_intent_with_span_0_drafts_the_whole_block():
    class Whole:
        reads_draft_features = reads_suffix = False

        def __init__(self):
            from workers.decisions import StaticDecisions
            self.inner = StaticDecisions()

        def before_draft(self, rows):
            return dataclasses.replace(self.inner.before_draft(rows), span=0)

        def after_draft(self, rows, intent, draft):
            assert intent.span == engine.block  # the applied intent: the span the drafter denoised
            return self.inner.after_draft(rows, intent, draft)

        def observe(self, record):
            return None

    engine = _engine()
    engine.decisions = Whole()
    widths = _record_block_widths(engine)
    _run(engine, [DecodeKnobs(steps=1, draft_len=2)] * 4, tokens=6)
    assert set(widths) == {engine.block + 1}


def test_adaptive_span_is_the_plans_longest_draft_plus_headroom():
    rows = make_rows(3, K=16)
    assert policies.get("adaptive").span_headroom == 1  # the default: one position past the plan (docs/policies.md)
    p = policies.get("adaptive", flat_share=0.0, span_headroom=2)
    toks = torch.tensor([3.0, 1.0, 5.0])  # verified positions per row, bonus included
    p._plan = Plan(tuple(rows.request_ids), 1, torch.tensor([1, 0, 2]), torch.zeros(3), toks)
    assert span_of(p, rows, [1, 0, 2])[0] == 4 + 2      # row 2 plans k = 4
    assert span_of(p, rows, [1, 0, 0])[0] == 2 + 2      # row 2 took its suffix draft instead
    p.span_headroom = None
    assert span_of(p, rows, [1, 0, 2])[0] == 16
    p.span_headroom = 2
    p._plan = Plan(("other",), 1, torch.tensor([1]), torch.zeros(1), torch.tensor([4.0]))
    assert span_of(p, rows, [1, 0, 2])[0] == 16           # no plan for these rows: the whole block
    with pytest.raises(ValueError, match="span_headroom"):
        policies.get("adaptive", span_headroom=-1)


def test_adaptive_prices_drafting_at_the_span_it_drafts():
    from adapt.cost_model import CostModel, Table
    cost = CostModel(draft_pass=Table([1, 8], [4.0, 16.0], "cost.draft_pass"), span_share=0.4, block=16)
    p = policies.get("adaptive", cost=cost, flat_share=0.0, span_headroom=2)
    rows = make_rows(2, K=16)
    p.before_draft(dataclasses.replace(rows, fixed_span=True))  # an engine that drafts whole blocks: no span asked
    assert cost.span == 5  # before any span: the headroom over a 3-token plan
    for _ in range(20):
        p._plan = Plan(tuple(rows.request_ids), 1, torch.tensor([1, 1]), torch.zeros(2), torch.tensor([2.0, 2.0]))
        p._span(rows, [1, 1])
    price_span(p, 16)
    assert cost.span == 3 and cost.span_scale() == pytest.approx(0.4 + 0.6 * 2 / 15)


def test_adaptive_verifies_the_whole_span_where_it_costs_nearly_nothing():
    """Verification nearly flat up to the span the drafter denoised (here 5 positions of a
    16-token block, where the whole block would cost twice a plain step): every drafted
    position of the span is verified, none past it (their confidence is 0: never denoised)."""
    from adapt.cost_model import CostModel, Table
    from workers.decisions import DraftFeatures, exact_rules

    cost = CostModel(Table([1, 6, 17, 1024], [14.0, 14.5, 28.0, 900.0]), Table([1, 256], [3.0, 3.0]))
    p = policies.get("adaptive", cost=cost, span_headroom=2)
    rows = make_rows(1, K=16)
    p._plan = Plan(tuple(rows.request_ids), 1, torch.tensor([1]), torch.zeros(1), torch.tensor([4.0]))
    intent = p.before_draft(rows)
    assert intent.steps.tolist() == [1] and intent.span == 5
    # it will verify the whole span whatever the features say: it asks the engine for none
    assert p.reads_draft_features is False
    conf = torch.zeros(1, 16)
    conf[0, :5] = torch.tensor([0.9, 0.2, 0.1, 0.05, 0.02])  # low: the predictor would drop most
    cond = torch.ones(1, dtype=torch.bool)
    d = p.after_draft(rows, intent, DraftFeatures(torch.tensor([1]), conf, torch.zeros(1, 16), conf / 2,
                                                  exact_rules(rows.temperature, cond), cond))
    assert d.draft_len.tolist() == [5]
    zeros = torch.zeros(1, 16)  # what the engine passes when it computed none: the same decision
    d0 = p.after_draft(rows, intent, DraftFeatures(torch.tensor([1]), zeros, zeros, zeros,
                                                   exact_rules(rows.temperature, cond), cond))
    assert d0.draft_len.tolist() == [5] and d0.rule.tolist() == d.rule.tolist()
    p.flat_share = 0.0  # not flat: the predictor and the greedy decide, within the span
    p._plan = Plan(tuple(rows.request_ids), 1, torch.tensor([1]), torch.zeros(1), torch.tensor([4.0]))
    intent = p.before_draft(rows)
    assert intent.source.tolist() == [DIFFUSION_CODE] and intent.span == 5
    assert p.reads_draft_features
    d = p.after_draft(rows, intent, DraftFeatures(torch.tensor([1]), conf, torch.zeros(1, 16), conf / 2,
                                                  exact_rules(rows.temperature, cond), cond))
    assert int(d.draft_len[0]) < 5


def test_a_suffix_row_verifying_past_the_span_beside_a_sampled_diffusion_row():
    """A greedy row copying 8-token suffix drafts (its own earlier answer, in the suffix drafter's
    memory) beside a sampled row whose diffusion drafts span 2 positions: q is 2 wide, the copy
    verifies up to 8 in the same step (q narrower than the copy must not index past q). The copy's
    output is still the target's own."""
    engine = _engine()
    widths = []
    verify = engine.verifier.verify

    def spy(batch, logits, drafts, q, *rest, **kw):
        widths.append((max(batch.plan.draft_len_host), None if q is None else q.shape[1]))
        return verify(batch, logits, drafts, q, *rest, **kw)

    engine.verifier.verify = spy
    prompt, greedy = PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True)

    def run(reqs):
        for rid, p, sp, kn in reqs:
            engine.add_request(rid, p, sp, kn)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    want = run([("first", prompt, greedy, DecodeKnobs(draft_len=0))])["first"]
    got = run([("copy", prompt, greedy, DecodeKnobs(source="suffix", draft_len=8)),
               ("diff", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True),
                DecodeKnobs(steps=1, draft_len=2))])
    assert got["copy"] == want and len(got["diff"]) == 40
    assert any(q == 2 and k > 2 for k, q in widths)  # the case itself happened


def test_the_engine_computes_no_draft_features_for_an_adaptive_policy_that_verifies_every_slot(monkeypatch):
    """Where verifying every drafted slot is nearly free (`flat_share` large here) the adaptive
    policy reads no draft features, the engine skips computing them, and greedy output is still
    the target's own, token for token."""
    import workers.sampling as sampling

    calls = []
    inner = sampling.draft_features

    def counted(q):
        calls.append(q.shape)
        return inner(q)

    monkeypatch.setattr(sampling, "draft_features", counted)
    engine = _engine()
    engine.decisions = policies.get("adaptive", flat_share=100.0, hold_max=0, use_suffix=False)
    widths = _record_block_widths(engine)
    got = _run(engine, [DecodeKnobs()] * 4)
    assert widths and not calls  # it drafted, and computed no features
    engine.decisions = policies.get("adaptive", flat_share=0.0, hold_max=0, use_suffix=False)
    _run(engine, [DecodeKnobs()] * 4)
    assert calls  # a policy that reads them gets them
    assert got == _run(_engine(), [DecodeKnobs(draft_len=0)] * 4)
