"""Engine exactness under greedy decoding: token for token equal to plain transformers.

Every row of a batch uses different knobs (s in {1, 2, 4}, both commit orders, k in {0, 1, 4, 16}),
requests join mid-flight, and a decision maker may change the knobs of every row every step.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels import Rule
from tests.tiny_models import make_tiny_pair, run_to_completion, single_thread
from workers.decisions import DraftIntent, StaticDecisions, VerifyDecision
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE, SUFFIX_CODE
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams

MAX_TOKENS = 24

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module", params=[512, 16], ids=["vocab512", "vocab16"])
def pair(request, tmp_path_factory):
    """Tiny target + drafter. Vocab 16 makes the random drafter agree often enough that accepted
    drafts, bonus tokens and long accepted runs all occur; vocab 512 exercises a realistic shape."""
    return make_tiny_pair(tmp_path_factory.mktemp("pair"), vocab=request.param, seed=3)


def greedy_reference(target_dir, prompts, n):
    """The target's own greedy continuation of each prompt, by plain transformers forwards."""
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            past, new = None, []
            for _ in range(n):
                res = hf(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                past = res.past_key_values
                nxt = int(res.logits[0, -1].argmax())
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
            out.append(new)
    return out


def knob_matrix():
    knobs = [DecodeKnobs(steps=1, draft_len=0)]
    for s in (1, 2, 4):
        for order in ("confidence", "left-to-right"):
            for k in (1, 4, 16):
                knobs.append(DecodeKnobs(steps=s, draft_len=k, commit_order=order))
    knobs += [DecodeKnobs(draft_len=k, source="suffix") for k in (2, 16)]  # suffix drafts in the same batch
    return knobs


def test_greedy_matrix_matches_transformers(pair):
    target, drafter = pair
    knobs = knob_matrix()
    gen = torch.Generator().manual_seed(1)
    vocab = AutoModelForCausalLM.from_pretrained(target).config.vocab_size
    prompts = [torch.randint(2, vocab, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in knobs]
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=32, max_len=96))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    half = len(knobs) // 2
    for i in range(half):
        engine.add_request(f"r{i}", prompts[i], params, knobs[i])
    late = [(f"r{i}", prompts[i], params, knobs[i]) for i in range(half, len(knobs))]
    outs = run_to_completion(engine, late, join_after={a[0]: 3 for a in late})
    expected = greedy_reference(target, prompts, MAX_TOKENS)
    for i, kn in enumerate(knobs):
        assert outs[f"r{i}"] == expected[i], f"row {i} with {kn} diverged from the target's greedy decoding"
    accepted = sum(outs[f"r{i}:stats"]["accepted"] for i in range(len(knobs)))
    assert outs["r0:stats"]["tau"] == 1.0 and outs["r0:stats"]["target_passes"] == MAX_TOKENS
    if vocab == 16:  # the accept paths really ran
        assert accepted >= 3
        suffix_rows = [i for i, kn in enumerate(knobs) if kn.source == "suffix"]
        assert sum(outs[f"r{i}:stats"]["accepted"] for i in suffix_rows) >= 3


class RandomKnobs(StaticDecisions):
    """Changes every row's source, steps, draft length and rule every step (seeded); reads suffix
    drafts, so suffix rows draft wherever a suffix draft exists."""

    reads_suffix = True

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def before_draft(self, rows):
        steps = torch.tensor([self.rng.choice([-1, 0, 1, 2, 3, 4]) for _ in range(rows.batch_size)])  # -1: a suffix copy
        source = torch.where(steps > 0, DIFFUSION_CODE, torch.where(steps < 0, SUFFIX_CODE, NONE_CODE))
        return DraftIntent(source, steps.clamp(min=0))

    def after_draft(self, rows, intent, draft):
        B = rows.batch_size
        k = torch.tensor([self.rng.randint(0, rows.block_size) for _ in range(B)])
        rule = torch.tensor([self.rng.choice([int(Rule.GREEDY), int(Rule.MATCH), int(Rule.EPS_TVD)]) for _ in range(B)],
                            dtype=torch.int32)
        return VerifyDecision(k, rule, torch.full((B,), 0.3), torch.zeros(B))


def test_knobs_changing_every_step_stay_exact(tmp_path):
    target, drafter = make_tiny_pair(tmp_path, vocab=16, seed=5)
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=64),
                    decisions=RandomKnobs())
    prompts = [[3, 4, 5], [7], [9, 9, 2, 1, 4], [11, 12]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("a", prompts[0], params, DecodeKnobs())
    engine.add_request("b", prompts[1], params, DecodeKnobs(commit_order="left-to-right"))
    late = [("c", prompts[2], params, DecodeKnobs()), ("d", prompts[3], params, DecodeKnobs(draft_len=0))]
    outs = run_to_completion(engine, late, join_after={a[0]: 1 for a in late})
    expected = greedy_reference(target, prompts, 30)
    for rid, exp in zip("abcd", expected):
        assert outs[rid] == exp
        assert outs[rid + ":stats"]["tvd_spent"] == 0.0  # lossless rows never got the lossy rule


def test_abort_frees_the_slot_and_others_continue(pair):
    target, drafter = pair
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=2, max_len=64))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[2, 3, 4], [5, 6], [7, 8, 9, 10]]
    engine.add_request("a", prompts[0], params, DecodeKnobs(steps=2, draft_len=4))
    engine.add_request("b", prompts[1], params, DecodeKnobs(steps=1, draft_len=8))
    engine.add_request("c", prompts[2], params, DecodeKnobs(steps=1, draft_len=16, commit_order="left-to-right"))
    outs = {}
    for _ in range(3):
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.free_slots == 0 and len(engine.waiting) == 1
    final = engine.abort("a")
    assert final.finished and final.finish_reason == "abort"
    assert engine.free_slots == 1 and "a" not in engine.requests
    assert engine.abort("a") is None
    rest = run_to_completion(engine)
    for rid in "bc":
        outs.setdefault(rid, []).extend(rest.get(rid, []))
    expected = greedy_reference(target, prompts, 16)
    assert outs["b"] == expected[1]
    assert outs["c"] == expected[2]  # joined in the freed slot
    assert engine.free_slots == 2 and not engine.has_unfinished()


class BurstyDrafting(StaticDecisions):
    """No drafts for long runs (past the stash window), then a draft step, per row by a seeded coin."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.step = 0

    def before_draft(self, rows):
        self.step += 1
        burst = self.step % 80 > 70  # ~70 steps without drafts, then a few with
        steps = torch.tensor([1 if burst or self.rng.random() < 0.01 else 0 for _ in rows.request_ids])
        return DraftIntent(torch.where(steps > 0, DIFFUSION_CODE, NONE_CODE), steps)


def test_lazy_drafter_context_equals_the_eager_one(tmp_path):
    """The drafter context written lazily (stash, overflow flushes, slot moves on departure) equals
    the context of a full target forward over each row's committed tokens."""
    from workers.engine import PENDING_WINDOW

    target, drafter = make_tiny_pair(tmp_path, vocab=16, seed=5)
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=4, max_len=256),
                    decisions=BurstyDrafting())
    for rid, n in (("short", 20), ("long", 240), ("mid", 200)):
        engine.add_request(rid, [3, 4, 5, 6], SamplingParams(max_tokens=n, ignore_eos=True), DecodeKnobs())
    for _ in range(120):  # "short" finishes early: the last slot moves into its place
        engine.step()
    run = engine.running
    assert len(run) == 2 and max(r.length - r.ctx_len for r in run) > 0
    assert max(r.length for r in run) > PENDING_WINDOW
    engine.drafting.flush(engine.running, list(range(len(run))))
    tm, dr = engine.target, engine.drafter
    for slot, req in enumerate(run):
        L = req.length
        ids = torch.tensor([(req.prompt + req.output)[:L]])
        cache = tm.new_cache(1, L + 1)
        _, hidden = tm(ids, torch.zeros(1, dtype=torch.long), cache, 0, L, engine.capture)
        ref = dr.context_kv(hidden, torch.arange(L)[None])
        for layer, (k, v) in enumerate(ref):
            torch.testing.assert_close(engine.dcache.k[layer][slot, :, :L], k[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(engine.dcache.v[layer][slot, :, :L], v[0], atol=1e-4, rtol=1e-4)
