"""Host reads per decode step, with every policy (issue #18: a CPU-side count of host syncs).

On CPU nothing syncs, so what is counted is every read of a tensor's value into Python
(`Tensor.item / tolist / __bool__ / __int__ / __float__ / __index__ / numpy`, by call site:
`adapt.bench.gpu_check_engine.SyncCounter`, the counter the GPU check uses beside
`torch.cuda.set_sync_debug_mode`). On CUDA such a read syncs only when its tensor lives on the
GPU; reads of the host-side `RowState` and of a decision maker's CPU answers never do. The
engine's own reads per decode step are pinned exactly, with every policy (docs/engine.md, "Host
syncs"), so that a change that adds one fails a test; the policies decide on the host (their
reads are of host tensors after `DraftFeatures.to_host`, whose one packed copy is checked here).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from adapt.bench.gpu_check_engine import SyncCounter
from adapt.controller import build_policy
from workers.engine import DEMO_DRAFTER, DEMO_TARGET, Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(target=DEMO_TARGET, drafter=DEMO_DRAFTER, max_batch=4, max_len=256))


def _rows(K):
    """Four rows: greedy and sampled, lossless and lenient, s 1 and 2, ragged draft lengths."""
    out = []
    for i in range(4):
        params = SamplingParams(max_tokens=64, temperature=0.8 * (i % 2), seed=5 + i, ignore_eos=True)
        knobs = DecodeKnobs(steps=1 + i % 2, draft_len=K - 2 * i, quality="tvd=0.1" if i == 1 else "lossless")
        out.append((params, knobs))
    return out


def _count(engine, decisions, rows, steps=6):
    """Reads per decode step by site: (engine sites [workers/, kernels/], policy sites, steps that drafted)."""
    engine.decisions = decisions
    for i, (params, knobs) in enumerate(rows):
        engine.add_request(f"r{i}", [3 + i, 7, 11, 13, 17 + i], params, knobs)
    engine.step()  # prefill
    engine.step()  # the first decode step (the drafter context of the prompt written lazily)
    per_step = []
    for _ in range(steps):
        before = engine.step_count
        with SyncCounter(torch.device("cpu")) as c:
            engine.step()
        assert engine.step_count == before + 1
        own = Counter({k: v for k, v in c.host_reads.items() if "workers/" in k or "kernels/" in k})
        policy = Counter({k: v for k, v in c.host_reads.items() if "policies/" in k})
        per_step.append((own, policy))
    for rid in list(engine.requests):
        engine.abort(rid)
    return per_step


# The engine's reads per decode step. `_decode` reads the decision maker's steps (a host tensor:
# no sync on a GPU), `_plan` the draft lengths and rules (computed on the host when the decision
# maker answers with host tensors: no sync), and the step's one packed result read (the sync).
# kernels/reference.py's reads are the CPU reference's own (the Triton kernels on CUDA have none).
WITH_DRAFTS = {"_decode": 1, "_plan": 1, "commit": 1}
WITHOUT_DRAFTS = {"_decode": 1, "sample_next": 1}


def _engine_reads(own: Counter) -> dict:
    out = Counter()
    for site, n in own.items():
        if "kernels/reference.py" not in site:
            out[site.rsplit(" ", 1)[-1]] += n
    return dict(out)


@pytest.mark.parametrize("policy", ["static", "autoregressive", "batch-schedule", "dspark", "adaptive"])
def test_engine_reads_per_step_with_every_policy(engine, policy):
    from workers.decisions import StaticDecisions

    rows = _rows(engine.block)
    if policy == "autoregressive":
        rows = [(p, DecodeKnobs(steps=0, draft_len=0)) for p, _ in rows]
    decisions = StaticDecisions() if policy in ("static", "autoregressive") else build_policy(policy, "models/demo/policy.json")
    per_step = _count(engine, decisions, rows)
    for own, _policy_reads in per_step:
        reads = _engine_reads(own)
        assert reads in (WITH_DRAFTS, WITHOUT_DRAFTS), reads
    if policy == "autoregressive":
        assert all(_engine_reads(own) == WITHOUT_DRAFTS for own, _ in per_step)
    if policy == "static":
        assert all(_engine_reads(own) == WITH_DRAFTS for own, _ in per_step)


def test_features_to_host_is_one_packed_copy_of_the_same_values():
    """`DraftFeatures.to_host` (what a policy reads instead of one device value at a time) keeps
    every field and its dtype; the host fields pass through."""
    from workers.decisions import DraftFeatures

    g = torch.Generator().manual_seed(0)
    conf, ent, margin = (torch.rand(3, 5, generator=g) for _ in range(3))
    feats = DraftFeatures(torch.tensor([2, 0, 0]), conf, ent, margin, torch.tensor([1, 0, 2], dtype=torch.int32),
                          torch.tensor([True, False, True]), torch.tensor([1, 0, 2]))  # diffusion, none, suffix
    with SyncCounter(torch.device("cpu")) as c:
        host = feats.to_host()
    assert sum(c.host_reads.values()) == 0 and sum(c.to_host.values()) == 5  # 1 packed [B, 3K] + 4 host fields
    for name in ("steps", "confidence", "entropy", "margin", "exact_rule", "conditional", "source"):
        a, b = getattr(feats, name), getattr(host, name)
        assert torch.equal(a, b) and a.dtype == b.dtype, name
