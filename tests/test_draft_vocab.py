"""Reduced draft vocabularies and the feature-harvest training path.

- A drafter restricted to `draft_ids` gives q = 0 outside them, and the engine stays exact with it:
  sampled output passes the goodness-of-fit test of tests/test_engine_sampling.py, greedy output
  is the target's own.
- The harvest keeps exactly what the target computed: its greedy tokens and, at every position,
  the hidden states a teacher-forced forward of the whole sequence gives.
- Training on harvested features writes a drafter that loads, keeps its reduced vocabulary, and
  drafts through the engine with exact greedy output.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.test_engine_sampling import N, PROMPT, chi2_pvalue, exact_law
from tests.tiny_models import make_tiny_pair, run_to_completion, single_thread
from workers.drafter import load_drafter
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def restrict(drafter_dir, target_dir, ids: list[int], out):
    """Save a copy of the drafter in `drafter_dir` restricted to the target ids `ids`."""
    from transformers import AutoConfig

    from workers.drafter import BlockDiffusionDrafter

    src = load_drafter(drafter_dir, AutoConfig.from_pretrained(target_dir))
    cfg = src.config
    cfg.draft_vocab_size = len(ids)
    new = BlockDiffusionDrafter(cfg)
    new.load_state_dict({**src.state_dict(), "draft_ids": torch.tensor(ids)})
    new.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dv")
    target, drafter = make_tiny_pair(tmp, vocab=8, seed=2, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                     init_std=0.5)
    return target, restrict(drafter, target, [0, 2, 3, 5, 7], tmp / "restricted")


def test_draft_logits_are_minus_inf_outside_the_draft_vocabulary(small_pair):
    from transformers import AutoConfig

    from workers.target_model import load_target

    target_dir, drafter_dir = small_pair
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, AutoConfig.from_pretrained(target_dir))
    drafter.bind(target.model.embed_tokens, target.lm_head)
    hidden = torch.randn(2, 3, drafter.config.hidden_size)
    full = drafter.logits(hidden)                                      # [2, 3, 8]
    small = drafter.draft_logits(hidden)                               # [2, 3, 5]
    assert small.shape[-1] == 5 and full.shape[-1] == 8
    assert torch.isinf(full[..., [1, 4, 6]]).all() and (full[..., [1, 4, 6]] < 0).all()
    assert torch.equal(full[..., [0, 2, 3, 5, 7]], small)


def test_q_over_the_draft_vocabulary_spreads_to_zeros_elsewhere():
    """Drafting keeps q over the draft vocabulary only ([..., Vd]); verification spreads the rows
    it reads over the whole vocabulary, zero outside the draft ids."""
    from workers.drafter import expand_to_vocab

    q = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])           # [2, Vd = 3]
    full = expand_to_vocab(q, torch.tensor([1, 4, 6]), 8)             # [2, 8]
    assert full.shape == (2, 8) and torch.equal(full[:, [1, 4, 6]], q)
    assert torch.equal(full[:, [0, 2, 3, 5, 7]], torch.zeros(2, 5)) and torch.equal(full.sum(-1), q.sum(-1))
    assert expand_to_vocab(q, None, 3) is q  # no reduced vocabulary: q is already over the whole one


@pytest.mark.parametrize("steps", [1, 2])  # 2: the second pass reads the first pass's target ids
def test_reduced_vocabulary_sampling_is_exact(small_pair, steps):
    target, drafter = small_pair
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=96, max_len=32))
    adds = [(f"r{i}", PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True),
             DecodeKnobs(steps=steps, draft_len=4)) for i in range(N)]
    outs: dict[str, list[int]] = {}
    accepted = 0
    while adds or engine.has_unfinished():
        while adds and len(engine.waiting) + len(engine.running) < engine.config.max_batch:
            engine.add_request(*adds.pop())
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            accepted += o.stats["accepted"] if o.finished else 0
    samples = [tuple(t[1:4]) for t in outs.values()]
    assert chi2_pvalue(samples, exact_law(target, 1.0, 0, 1.0)) > 1e-3
    assert accepted > N // 8, "too few accepted drafts to exercise verification"


def test_reduced_vocabulary_greedy_is_the_targets_own(tmp_path):
    from workers.engine import DEMO_DRAFTER, DEMO_TARGET

    engine = Engine(EngineConfig(target=DEMO_TARGET, drafter=None, dtype="float32", max_batch=2))
    prompts = [engine.tokenizer(t)["input_ids"] for t in ("def fibonacci(n):\n", "import os\nimport sys\n")]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ar = run_to_completion(engine, [(f"p{i}", p, greedy, DecodeKnobs(steps=0, draft_len=0))
                                    for i, p in enumerate(prompts)])
    # the 2,048 lowest ids and every token of p0's answer but its 5th, which the drafter then never proposes
    keep = (set(range(2048)) | set(ar["p0"])) - {ar["p0"][4]}
    restricted = restrict(DEMO_DRAFTER, DEMO_TARGET, sorted(keep), tmp_path / "half")
    spec = run_to_completion(Engine(EngineConfig(target=DEMO_TARGET, drafter=restricted, dtype="float32",
                                                 max_batch=2)),
                             [(f"p{i}", p, greedy, DecodeKnobs(steps=s, draft_len=8)) for i, (p, s) in
                              enumerate(zip(prompts, (1, 2)))])
    for i in range(2):
        assert spec[f"p{i}"] == ar[f"p{i}"]
    assert spec["p0:stats"]["target_passes"] < 40, "no drafts accepted: the test exercises nothing"


@pytest.fixture(scope="module")
def harvested(tmp_path_factory):
    """A tiny target, and a harvest of its answers to 6 token prompts (2 sampled)."""
    from safetensors.torch import save_file

    from workers.target_model import load_target
    from workers.training.harvest import generate_with_features

    tmp = tmp_path_factory.mktemp("harvest")
    target_dir, _ = make_tiny_pair(tmp, vocab=512, seed=3)
    target = load_target(target_dir, torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [[5, 9, 11, 3], [7, 7, 2], [1, 2, 3, 4, 5, 6], [8, 3], [40, 41, 42], [9]]
    temps = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    shard = generate_with_features(target, prompts, answer_len=40, seq_len=48, layers=(0, 1), temperature=temps,
                                   stop_ids=(), gen=gen, top_k=4)
    out = tmp / "harvest"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in shard.items()}, str(out / "shard_000.safetensors"))
    (out / "harvest.json").write_text('{"layers": [0, 1], "stop_ids": [], "top_k": 4, '
                                      '"shards": ["shard_000.safetensors"]}')
    return target_dir, prompts, shard, out


def test_harvest_keeps_the_targets_tokens_and_hidden_states(harvested):
    from transformers import AutoModelForCausalLM

    target_dir, prompts, shard, _ = harvested
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for r, prompt in enumerate(prompts):
        pad, answer, end = int(shard["pad"][r]), int(shard["answer"][r]), int(shard["end"][r])
        assert answer - pad == len(prompt) and end == 48
        seq = shard["tokens"][r, pad:].long()
        assert seq[: len(prompt)].tolist() == prompt
        with torch.no_grad():
            out = hf(seq[None], output_hidden_states=True)
        if shard["temperature"][r] == 0:  # greedy rows: every answer token is the target's argmax
            assert torch.equal(out.logits[0, len(prompt) - 1 : -1].argmax(-1), seq[len(prompt):])
        # soft labels: the target's top 4 next tokens (temperature 1) for every answer column
        logp = torch.log_softmax(out.logits[0, len(prompt) - 1 : -1].float(), -1)     # [A, V]
        best = logp.topk(4, -1)
        assert torch.equal(shard["soft_ids"][r, answer:].long(), best.indices)
        assert torch.allclose(shard["soft_logp"][r, answer:].float(), best.values, atol=0.02)
        assert not shard["soft_ids"][r, :answer].any()
        want = torch.cat([out.hidden_states[1], out.hidden_states[2]], -1)[0]     # layers 0 and 1
        got = shard["features"][r, pad:].float()
        assert torch.allclose(got, want, atol=0.05, rtol=0.02), (got - want).abs().max()
        assert not shard["features"][r, :pad].any()


def test_training_on_features_writes_a_working_reduced_drafter(harvested, tmp_path):
    from workers.training.feature_drafter import train

    target_dir, prompts, _, data = harvested
    args = argparse.Namespace(target=target_dir, data=data, out=tmp_path / "drafter", steps=30, batch=4, anchors=3,
                              block_size=8, layers=1, intermediate=None, draft_vocab=128, gamma=7.0, lr=3e-3,
                              save_every=15, fp32=True, resume=False, threads=0, seed=0)
    report = train(args)
    log = [line for line in (tmp_path / "drafter" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) >= 3
    assert report["drafter"]["draft_vocab_size"] == 128
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    adds = [(f"p{i}", p, greedy, DecodeKnobs(steps=1, draft_len=8)) for i, p in enumerate(prompts[:3])]
    spec = run_to_completion(Engine(EngineConfig(target=target_dir, drafter=tmp_path / "drafter", dtype="float32",
                                                 max_batch=3)), adds)
    ar = run_to_completion(Engine(EngineConfig(target=target_dir, drafter=None, dtype="float32", max_batch=3)),
                           [(a[0], a[1], a[2], DecodeKnobs(steps=0, draft_len=0)) for a in adds])
    for i in range(3):
        assert spec[f"p{i}"] == ar[f"p{i}"]
    # training resumes from its checkpoint
    args.steps, args.resume = 40, True
    train(args)
    assert '"step": 40' in (tmp_path / "drafter" / "train_log.jsonl").read_text().splitlines()[-1]


def test_soft_cross_entropy_is_the_hard_loss_for_a_sure_target_and_skips_outside_tokens():
    from workers.training.feature_drafter import soft_cross_entropy

    t2d = torch.full((10,), -1, dtype=torch.long)
    t2d[torch.tensor([2, 5, 7])] = torch.arange(3)                      # draft vocabulary {2, 5, 7}
    logq = torch.log_softmax(torch.tensor([[0.3, -1.0, 2.0], [1.0, 1.0, 0.0]]), -1)   # [2, 3]
    # row 0: the target is sure of token 7 (draft id 2); row 1: 50/25/25 over 5, 9 (outside), 2
    ids = torch.tensor([[7, 0, 1], [5, 9, 2]], dtype=torch.int32)
    logp = torch.log(torch.tensor([[1.0, 1e-30, 1e-30], [0.5, 0.25, 0.25]])).half()
    loss, usable = soft_cross_entropy(logq, ids, logp, t2d)
    assert usable.all()
    assert torch.allclose(loss[0], -logq[0, 2], atol=1e-4)
    want = -(2 / 3 * logq[1, 1] + 1 / 3 * logq[1, 0])                 # renormalised over 5 and 2
    assert torch.allclose(loss[1], want, atol=1e-3)
    # nothing of the top k inside the draft vocabulary: not usable
    _, usable = soft_cross_entropy(logq[:1], torch.tensor([[0, 1, 3]], dtype=torch.int32), logp[:1], t2d)
    assert not usable.any()


def test_training_with_soft_labels_runs_and_needs_them(harvested, tmp_path):
    from workers.training.feature_drafter import train

    target_dir, _, _, data = harvested
    args = argparse.Namespace(target=target_dir, data=data, out=tmp_path / "soft", steps=12, batch=4, anchors=3,
                              block_size=8, layers=1, intermediate=None, draft_vocab=128, gamma=7.0, lr=3e-3,
                              save_every=6, fp32=True, resume=False, threads=0, seed=0, soft_weight=0.5)
    train(args)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "soft" / "train_log.jsonl").read_text().splitlines()]
    assert len(losses) >= 2 and all(0 < v < 20 for v in losses)
    # the same seeded first batch without soft labels gives another loss: the soft term is in it
    hard = argparse.Namespace(**{**vars(args), "soft_weight": 0.0, "steps": 1, "out": tmp_path / "hard"})
    train(hard)
    assert json.loads((tmp_path / "hard" / "train_log.jsonl").read_text().splitlines()[0])["loss"] != losses[0]
    plain = tmp_path / "plain"
    plain.mkdir()
    meta = json.loads((data / "harvest.json").read_text())
    meta["top_k"] = 0
    (plain / "harvest.json").write_text(json.dumps(meta))
    (plain / "shard_000.safetensors").symlink_to(data / "shard_000.safetensors")
    args.data, args.out = plain, tmp_path / "refused"
    with pytest.raises(ValueError, match="soft labels"):
        train(args)


def test_saving_in_bf16_keeps_the_draft_ids_exact(small_pair, tmp_path):
    """Integer buffers are not cast with the weights (bf16 holds integers only up to 256 exactly)."""
    from transformers import AutoConfig

    from workers.drafter import BlockDiffusionDrafter

    target_dir, drafter_dir = small_pair
    hf = AutoConfig.from_pretrained(target_dir)
    src = load_drafter(drafter_dir, hf)
    cfg = src.config
    cfg.vocab_size, cfg.draft_vocab_size = 50_000, 3  # a config only: ids above bf16's exact range
    big = BlockDiffusionDrafter(cfg)
    big.set_draft_vocab(torch.tensor([257, 30_001, 49_999]))
    big.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert saved["draft_ids"].dtype == torch.int64
    assert saved["draft_ids"].tolist() == [257, 30_001, 49_999]
    assert saved["fc.weight"].dtype == torch.bfloat16
