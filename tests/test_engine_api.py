"""Engine API edges: bad input gives clear errors and the engine keeps serving; trace records."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import make_tiny_pair, single_thread
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, EngineInputError, ModelLoadError, PromptTooLongError, SamplingParams
from workers.traces import TRACE_FIELDS, TRACE_VERSION, FileTraceSink, read_traces

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("api"), vocab=512, seed=4)


@pytest.fixture()
def engine(pair):
    target, drafter = pair
    return Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=4, max_len=32))


def test_bad_input_names_the_field_and_the_engine_keeps_serving(engine):
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("ok", [5, 6, 7], greedy, DecodeKnobs(steps=2, draft_len=4))
    engine.step()
    cases = [
        (lambda: engine.add_request("long", list(range(2, 40)), greedy), PromptTooLongError, "prompt has 38 tokens"),
        (lambda: engine.add_request("empty", "", greedy), EngineInputError, "prompt must not be empty"),
        (lambda: engine.add_request("empty2", [], greedy), EngineInputError, "prompt must not be empty"),
        (lambda: engine.add_request("vocab", [5, 9999], greedy), EngineInputError, "prompt token ids"),
        (lambda: engine.add_request("ok", [5], greedy), EngineInputError, "already in use"),
        (lambda: engine.add_request("k", [5], greedy, DecodeKnobs(draft_len=17)), EngineInputError, "block size 16"),
        (lambda: DecodeKnobs(steps=-1), ValueError, "steps"),
        (lambda: DecodeKnobs(draft_len=100), ValueError, "draft_len"),
        (lambda: DecodeKnobs(quality="tvd=2"), ValueError, "quality"),
        (lambda: DecodeKnobs(quality="fast"), ValueError, "quality"),
        (lambda: DecodeKnobs(commit_order="random"), ValueError, "commit_order"),
        (lambda: SamplingParams(temperature=-1.0), ValueError, "temperature"),
        (lambda: SamplingParams(top_p=0.0), ValueError, "top_p"),
        (lambda: SamplingParams(top_k=-2), ValueError, "top_k"),
        (lambda: SamplingParams(max_tokens=0), ValueError, "max_tokens"),
        (lambda: engine.add_request("stop", [5], SamplingParams(stop_token_ids=(600,))), EngineInputError, "stop_token_ids"),
    ]
    for call, exc, words in cases:
        with pytest.raises(exc, match=words):
            call()
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert len(out) == 11 and set(engine.requests) == set()  # 12 tokens, the first one came from step 1


def test_text_prompt_and_stop_token(engine):
    engine.add_request("a", "def add(a, b):", SamplingParams(max_tokens=20, ignore_eos=True), DecodeKnobs(draft_len=4))
    toks = []
    while engine.has_unfinished():
        toks += [t for o in engine.step() for t in o.new_token_ids]
    stop = toks[5]
    engine.add_request("b", "def add(a, b):", SamplingParams(max_tokens=20, stop_token_ids=(stop,), ignore_eos=True),
                       DecodeKnobs(draft_len=4))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    got = [t for o in outs for t in o.new_token_ids]
    assert got == toks[: toks.index(stop) + 1] and outs[-1].finish_reason == "stop"


def test_context_limit_finishes_with_length(engine):
    engine.add_request("a", list(range(2, 30)), SamplingParams(max_tokens=50, ignore_eos=True), DecodeKnobs(draft_len=16))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert sum(len(o.new_token_ids) for o in outs) == 32 - 28 and outs[-1].finish_reason == "length"


def test_unknown_model_directories(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ModelLoadError, match="target directory .*nope.* does not exist"):
        Engine(EngineConfig(target=tmp_path / "nope", drafter=drafter))
    with pytest.raises(EngineInputError, match="drafter directory .*nope.* does not exist"):
        Engine(EngineConfig(target=target, drafter=tmp_path / "nope"))
    no_drafter = Engine(EngineConfig(target=target, drafter=None, dtype="float32", max_batch=2, max_len=32))
    with pytest.raises(EngineInputError, match="needs a drafter"):
        no_drafter.add_request("a", [3], SamplingParams(), DecodeKnobs(draft_len=4))
    no_drafter.add_request("b", [3], SamplingParams(max_tokens=3))  # default knobs: autoregressive
    while no_drafter.has_unfinished():
        no_drafter.step()


def test_trace_records_follow_the_contract(pair, tmp_path):
    target, drafter = pair
    sink = FileTraceSink(tmp_path / "t.jsonl")
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=4, max_len=64),
                    trace_sink=sink)
    engine.add_request("a", [5, 6], SamplingParams(max_tokens=10, ignore_eos=True), DecodeKnobs(steps=2, draft_len=5))
    engine.add_request("b", [7], SamplingParams(max_tokens=10, temperature=1.0, seed=1, ignore_eos=True),
                       DecodeKnobs(draft_len=0))
    while engine.has_unfinished():
        engine.step()
    sink.close()
    records = read_traces(tmp_path / "t.jsonl")
    assert {r["request_id"] for r in records} == {"a", "b"}
    for r in records:
        assert tuple(r) == TRACE_FIELDS and r["v"] == TRACE_VERSION
        K = 16 if r["steps"] else 0
        assert len(r["confidence"]) == len(r["entropy"]) == len(r["margin"]) == K
        assert len(r["accept_flags"]) == r["draft_len"] and sum(r["accept_flags"]) == r["accepted"]
        assert r["accept_flags"] == sorted(r["accept_flags"], reverse=True)
        same = [x for x in records if x["step"] == r["step"]]
        if engine.pack:  # the forward runs each row's own positions (CPU default)
            assert r["num_tokens"] == sum(x["draft_len"] + 1 for x in same)
        else:  # the forward pads rows to the longest
            assert r["num_tokens"] == len(same) * (max(x["draft_len"] for x in same) + 1)
        assert r["batch_size"] == sum(1 for x in records if x["step"] == r["step"])
    a = [r for r in records if r["request_id"] == "a"]
    assert [r["steps"] for r in a] == [2] * len(a) and a[0]["rule"] == 0 and a[0]["position"] == 2
    assert all(0.0 <= c <= 1.0 for c in a[0]["confidence"])
    b = [r for r in records if r["request_id"] == "b"]
    assert [r["generated"] for r in b] == list(range(1, 10)) and all(r["draft_len"] == 0 for r in b)
    assert torch.tensor([r["step_ms"] for r in records]).gt(0).all()
