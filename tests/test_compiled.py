"""Compiled decode steps (workers/compiled.py): exact, warmed up, and state-neutral.

One engine per module (compiling its four programs takes most of this file's time): greedy
decoding through the compiled target forward is token for token the target's own greedy decoding
by plain transformers, for rows that draft and rows that do not, one row and many; `warm_up`
compiles every program that such decoding needs and leaves the engine as it found it.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import greedy_reference
from tests.tiny_models import make_tiny_pair, run_to_completion, single_thread
from workers.compiled import CompiledTarget
from workers.decisions import StaticDecisions
from workers.engine import PENDING_WINDOW, Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams

MAX_TOKENS = 20

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def _programs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """(target dir, drafter dir, a compiled fp32 engine after warm_up, warm_up's report)."""
    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("pair"), vocab=16, seed=3)
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=96,
                                 compile="on"))
    decisions = engine.decisions
    report = engine.warm_up()
    assert engine.decisions is decisions and engine.step_count == 0
    assert not engine.running and not engine.waiting and not engine.has_unfinished()
    return target, drafter, engine, report


def test_warm_up_compiles_every_program_decoding_needs(warmed):
    target, drafter, engine, report = warmed
    assert isinstance(engine.target_forward, CompiledTarget)
    assert report["steps"] > 0 and report["seconds"] > 0
    before = _programs()
    assert before >= 6  # target: one row / several, one token / several, one start / per row; drafter pass
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    knobs = [DecodeKnobs(steps=1, draft_len=0), DecodeKnobs(steps=2, draft_len=4), DecodeKnobs(steps=1, draft_len=16)]
    for i, kn in enumerate(knobs):  # one row at a time, then three together with different lengths
        run_to_completion_single(engine, [5 + i, 3, 7], params, kn)
    for i, kn in enumerate(knobs):
        engine.add_request(f"b{i}", list(range(2, 5 + 3 * i)), params, kn)
    run_to_completion(engine, [])
    # rows that decode without drafts for a while, then draft (the drafter context of several
    # stashed positions is written at once): one row, then two with different lengths
    for rows in (1, 2):
        for i in range(rows):
            engine.add_request(f"s{i}", list(range(3, 6 + 4 * i)), params, DecodeKnobs(draft_len=0))
        for _ in range(3):
            engine.step()
        for i in range(rows):
            engine.set_knobs(f"s{i}", DecodeKnobs(steps=1, draft_len=16))
        run_to_completion(engine, [])
    # two rows that decode without drafts until their stashes of target hidden states are full
    # (PENDING_WINDOW positions written to the drafter context at once), then draft
    for i in range(2):
        engine.add_request(f"long{i}", [4, 5, 6 + i], SamplingParams(max_tokens=PENDING_WINDOW + 8, ignore_eos=True),
                           DecodeKnobs(draft_len=0))
    for _ in range(PENDING_WINDOW + 2):
        engine.step()
    for i in range(2):
        engine.set_knobs(f"long{i}", DecodeKnobs(steps=1, draft_len=16))
    run_to_completion(engine, [])
    assert _programs() == before, "decoding after warm_up compiled a new program"


def run_to_completion_single(engine, prompt, params, knobs):
    engine.add_request("single", prompt, params, knobs)
    return run_to_completion(engine, [])


def test_compiled_greedy_decoding_equals_transformers(warmed):
    target, drafter, engine, _ = warmed
    gen = torch.Generator().manual_seed(5)
    knobs = [DecodeKnobs(steps=1, draft_len=0), DecodeKnobs(steps=1, draft_len=16), DecodeKnobs(steps=2, draft_len=4),
             DecodeKnobs(steps=4, draft_len=16, commit_order="left-to-right"), DecodeKnobs(steps=1, draft_len=1)]
    prompts = [torch.randint(2, 16, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in knobs]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = greedy_reference(target, prompts, MAX_TOKENS)
    # one row at a time (batch 1 programs), then all together with one joining late (batch > 1)
    for i, kn in enumerate(knobs):
        engine.add_request(f"one{i}", prompts[i], params, kn)
        assert run_to_completion(engine, [])[f"one{i}"] == expected[i], f"batch 1, {kn}"
    for i in range(len(knobs) - 1):
        engine.add_request(f"r{i}", prompts[i], params, knobs[i])
    last = len(knobs) - 1
    outs = run_to_completion(engine, [(f"r{last}", prompts[last], params, knobs[last])], join_after={f"r{last}": 2})
    for i, kn in enumerate(knobs):
        assert outs[f"r{i}"] == expected[i], f"batched row {i} with {kn} diverged from the target's greedy decoding"
    assert sum(outs[f"r{i}:stats"]["accepted"] for i in range(len(knobs))) >= 3  # drafts were accepted


def test_compiled_forward_matches_the_eager_one(warmed):
    """Logits and written K/V of the compiled decode programs equal the eager forward's (fp32)."""
    _, _, engine, _ = warmed
    target, cache, capture = engine.target, engine.tcache, engine.capture
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for B, T, ragged in ((1, 1, False), (1, 5, False), (3, 1, True), (3, 6, True), (3, 1, False), (3, 6, False)):
            start = torch.tensor([9, 4, 12][:B]) if ragged else torch.full((B,), 9)
            ids = torch.randint(0, 16, (B, T), generator=gen)
            width = int(start.max()) + T
            start_value = int(start[0]) if not ragged else None
            got_logits, got_hidden = engine.target_forward(ids, start, cache, 0, width, start_value=start_value)
            got_k = [cache.k[i][:B].clone() for i in range(cache.num_layers)]
            ref_logits, ref_hidden = target(ids, start, cache, 0, width, capture, start_value=start_value)
            torch.testing.assert_close(got_logits, ref_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_hidden, ref_hidden, rtol=1e-4, atol=1e-4)
            for i in range(cache.num_layers):
                torch.testing.assert_close(got_k[i], cache.k[i][:B], rtol=1e-5, atol=1e-5)


def test_eager_engine_does_not_compile(tmp_path):
    target, drafter = make_tiny_pair(tmp_path, vocab=16, seed=3)
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=2, max_len=64),
                    decisions=StaticDecisions())
    assert engine.backend.name == "eager" and not isinstance(engine.target_forward, CompiledTarget)
    assert engine.warm_up() == {"seconds": 0.0, "steps": 0}


def test_two_compiled_targets_keep_their_own_programs(tmp_path):
    """Compiled programs skip guards on module attributes, and freezing bakes the weights in, so
    each compiled function must have its own programs: two targets of the same architecture and
    different weights, compiled in one process, each give their own logits."""
    from workers.compiled import mark_static
    from workers.target_model import load_target

    targets = [load_target(make_tiny_pair(tmp_path / f"p{seed}", vocab=16, seed=seed)[0]) for seed in (1, 2)]
    ids, start = torch.tensor([[3, 5]]), torch.tensor([4])
    with torch.inference_mode():
        for target in targets:
            cache = target.new_cache(2, 32)
            mark_static(*cache.k, *cache.v)
            compiled = CompiledTarget(target, (0,))
            for _ in range(3):  # the first call runs eagerly; the second compiles; the third reuses
                got, _ = compiled(ids, start, cache, 0, 6, start_value=4)
            want, _ = target(ids, start, cache, 0, 6, (0,), start_value=4)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(targets[0](ids, start, targets[0].new_cache(2, 32), 0, 6)[0],
                                  targets[1](ids, start, targets[1].new_cache(2, 32), 0, 6)[0])
