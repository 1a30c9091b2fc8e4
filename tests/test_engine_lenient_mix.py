"""Lenient and exact rows with partial draft lengths and non-drafting rows share one step.

Regression: with every row verifying k = 1 (a slice of q that reshapes to a strided view) and a rule that reads the draft
probabilities, the engine once handed the kernels a non-contiguous view of q and crashed."""

from __future__ import annotations

import pytest

from tests.tiny_models import make_tiny_pair, run_to_completion, single_thread
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams

_threads = pytest.fixture(autouse=True, scope="module")(single_thread)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("lenient-mix"))


@pytest.mark.parametrize("draft_lens", [(1, 1, 1), (3, 3, 3), (3, 0, 5), (16, 2, 0)])
def test_lenient_rows_with_partial_draft_lengths(pair, draft_lens):
    target, drafter = pair
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=4, max_len=128))
    adds = []
    for i, k in enumerate(draft_lens):
        knobs = DecodeKnobs(steps=1 + i % 2, draft_len=k, quality="tvd=0.2" if i != 1 else "lossless",
                            commit_order="left-to-right")
        adds.append((f"r{i}", list(range(5 + i, 17 + i)), SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True), knobs))
    outs = run_to_completion(engine, adds)
    done = {rid[: -len(":stats")]: stats for rid, stats in outs.items() if rid.endswith(":stats")}
    assert sorted(done) == ["r0", "r1", "r2"]
    for rid, stats in done.items():
        assert stats["tokens"] == 12
        budget = 0.0 if rid == "r1" else 0.2
        assert stats["tvd_spent"] <= budget * stats["tokens"] + 1e-6
