"""Draft sources as a registry (workers/draft_sources.py): a toy source added from here, without
touching the engine, drafts for the request pinned to it, and greedy output stays the target's."""

from __future__ import annotations

import pytest

from workers import draft_sources
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE, SUFFIX_CODE, PointMassSource
from workers.engine import DEMO_DRAFTER, DEMO_TARGET, Engine, EngineConfig
from workers.request import DecodeKnobs, EngineInputError, SamplingParams

PROMPTS = [[3, 7, 11, 13, 17], [4, 9, 2, 8], [5, 5, 5, 5, 5, 5]]


class RepeatAnchor(PointMassSource):
    """Drafts the row's last token ``limit`` times: right wherever the target repeats itself."""

    name, code = "repeat", 7

    def draft(self, engine, request, limit: int) -> list[int]:
        return [request.output[-1]] * limit


@pytest.fixture
def repeat():
    source = draft_sources.register(RepeatAnchor())
    yield source
    draft_sources.unregister("repeat")


def _run(knobs: list[DecodeKnobs], tokens: int = 24) -> dict[str, list[int]]:
    engine = Engine(EngineConfig(target=DEMO_TARGET, drafter=DEMO_DRAFTER, device="cpu", dtype="float32",
                                 max_batch=4, max_len=128))
    for i, (p, kn) in enumerate(zip(PROMPTS, knobs)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=tokens, ignore_eos=True), kn)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                out[o.request_id + ":stats"] = o.stats
    return out


def test_a_registered_toy_source_drafts_for_its_pinned_request_and_keeps_greedy_output(repeat):
    assert draft_sources.by_name("repeat") is repeat and draft_sources.by_code(7) is repeat
    knobs = [DecodeKnobs.pin(source="repeat", draft_len=4), DecodeKnobs(steps=1, draft_len=3),
             DecodeKnobs(source="suffix", draft_len=4)]
    got = _run(knobs)
    want = _run([DecodeKnobs(draft_len=0)] * 3)
    for rid in ("r0", "r1", "r2"):
        assert got[rid] == want[rid]  # greedy: token for token the target's own output
    stats = got["r0:stats"]["decode_stats"]
    assert stats["verified"].get("repeat", 0) > 0 and set(stats["source"]) <= {"repeat", "none"}
    assert got["r0:stats"]["rules_used"] == "GREEDY"  # a point mass: exact rules only


def test_the_registry_refuses_clashes_and_forgets_what_is_unregistered():
    assert (draft_sources.by_name("none").code, draft_sources.by_name("diffusion").code,
            draft_sources.by_name("suffix").code) == (NONE_CODE, DIFFUSION_CODE, SUFFIX_CODE)
    source = draft_sources.register(RepeatAnchor())
    try:
        with pytest.raises(ValueError, match="already registered"):
            draft_sources.register(RepeatAnchor())
        assert DecodeKnobs(source="repeat").source == "repeat"
    finally:
        draft_sources.unregister(source.name)
    with pytest.raises(EngineInputError, match="source must be one of"):
        DecodeKnobs(source="repeat")
    with pytest.raises(ValueError, match="built in"):
        draft_sources.unregister("suffix")
