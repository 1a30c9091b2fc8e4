"""Sampled decoding: exact configurations reproduce the target's distribution; seeds reproduce.

Goodness of fit: a vocabulary-8 target makes the joint law of three generated tokens small enough
(512 outcomes) to compute exactly from plain transformers forwards and to test with a chi-square
test. Every exact configuration the engine offers is covered, all in one mixed batch:
autoregressive, REJECTION (s = 1; s = 2 left-to-right), MATCH (most-confident-first s = 2, 4),
suffix drafts (point masses, MATCH), with and without top-k / top-p.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from kernels import Rule
from tests.tiny_models import make_tiny_pair, run_to_completion, single_thread
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams
from workers.sampling import probabilities

V = 8
PROMPT = [2, 5, 3]
N = 1500  # samples per configuration

CONFIGS = {  # name: (knobs, temperature, top_k, top_p, expected rule)
    "autoregressive": (DecodeKnobs(steps=1, draft_len=0), 1.0, 0, 1.0, None),
    "s1-rejection": (DecodeKnobs(steps=1, draft_len=4), 1.0, 0, 1.0, Rule.REJECTION),
    "s2-l2r-rejection": (DecodeKnobs(steps=2, draft_len=4, commit_order="left-to-right"), 1.0, 0, 1.0, Rule.REJECTION),
    "s2-confidence-match": (DecodeKnobs(steps=2, draft_len=4), 1.0, 0, 1.0, Rule.MATCH),
    "s4-confidence-match-topk-topp": (DecodeKnobs(steps=4, draft_len=4), 0.7, 5, 0.9, Rule.MATCH),
    "s1-rejection-topk-topp": (DecodeKnobs(steps=1, draft_len=4), 0.7, 5, 0.9, Rule.REJECTION),
    "suffix-match": (DecodeKnobs(draft_len=4, source="suffix"), 1.0, 0, 1.0, Rule.MATCH),
}

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("gof"), vocab=V, seed=2, hidden=32, heads=2, kv_heads=1,
                          intermediate=64, init_std=0.5)


def exact_law(target_dir, temperature, top_k, top_p) -> torch.Tensor:
    """P(x2, x3, x4) [V, V, V] after PROMPT (x1 summed out), from plain transformers logits."""
    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    seqs = torch.tensor(list(itertools.product(range(V), repeat=4)))  # [V^4, 4] all continuations
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = hf(ids).logits[:, len(PROMPT) - 1 : -1].float()  # [V^4, 4, V] predicting x1..x4
    n = logits.shape[0] * 4
    probs = probabilities(logits.reshape(n, V), torch.full((n,), temperature),
                          torch.full((n,), top_k) if top_k else None,
                          torch.full((n,), top_p) if top_p < 1 else None).view(-1, 4, V)
    p_seq = probs.gather(2, seqs[..., None]).squeeze(-1).prod(1)  # [V^4]
    return p_seq.view(V, V, V, V).sum(0)


def chi2_pvalue(samples: list[tuple[int, int, int]], law: torch.Tensor) -> float:
    counts = torch.zeros(V, V, V)
    for s in samples:
        counts[s] += 1
    expected = law.flatten() * len(samples)
    observed = counts.flatten()
    big = expected >= 5
    f_exp = torch.cat([expected[big], expected[~big].sum()[None]])
    f_obs = torch.cat([observed[big], observed[~big].sum()[None]])
    return float(chisquare(f_obs.numpy(), f_exp.numpy() * f_obs.sum().item() / f_exp.sum().item()).pvalue)


def sample_configs(engine: Engine, configs: dict, n: int) -> tuple[dict, dict, dict]:
    """Serve `n` seeded requests of each configuration of `configs` (name: (knobs, temperature,
    top_k, top_p, rule)) through `engine`, as many at once as it holds. Returns (outputs by
    request id, the rules each configuration's drafting steps used, its accepted drafts)."""
    pending = [(f"{name}/{i}", i) for i in range(n) for name in configs]
    rules_seen = {name: set() for name in configs}
    accepted = {name: 0 for name in configs}
    outs: dict[str, list[int]] = {}
    while pending or engine.has_unfinished():
        while pending and len(engine.waiting) + len(engine.running) < engine.config.max_batch:
            rid, seed = pending.pop()
            knobs, temp, top_k, top_p, _ = configs[rid.split("/")[0]]
            engine.add_request(rid, PROMPT, SamplingParams(max_tokens=6, temperature=temp, top_k=top_k, top_p=top_p,
                                                           seed=seed, ignore_eos=True), knobs)
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            name = o.request_id.split("/")[0]
            if o.stats["target_passes"] > 1 and o.stats["draft_len_used"] > 0:  # a step that verified drafts
                rules_seen[name].add(o.stats["rules_used"])
            if o.finished:
                accepted[name] += o.stats["accepted"]
    return outs, rules_seen, accepted


def test_every_exact_configuration_samples_the_target(pair):
    target, drafter = pair
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=96, max_len=32))
    outs, rules_seen, accepted = sample_configs(engine, CONFIGS, N)
    for name, (knobs, temp, top_k, top_p, rule) in CONFIGS.items():
        samples = [tuple(toks[1:4]) for rid, toks in outs.items() if rid.startswith(name + "/")]
        assert len(samples) == N
        p = chi2_pvalue(samples, exact_law(target, temp, top_k, top_p))
        assert p > 1e-3, f"{name}: the sampled law departs from the target's (chi-square p = {p:.2e})"
        if rule is not None:
            assert rules_seen[name] == {rule.name}
            assert accepted[name] > N // 8, f"{name}: too few accepted drafts to exercise verification"


def test_goodness_of_fit_test_detects_a_wrong_law(pair):
    """The test above has power: the same samples fail against a different temperature's law."""
    target, drafter = pair
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=96, max_len=32))
    for i in range(N):
        engine.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True),
                           DecodeKnobs(steps=1, draft_len=4))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    samples = [tuple(t[1:4]) for t in outs.values()]
    assert chi2_pvalue(samples, exact_law(target, 1.0, 0, 1.0)) > 1e-3
    assert chi2_pvalue(samples, exact_law(target, 0.8, 0, 1.0)) < 1e-6


def test_seeded_requests_reproduce_regardless_of_batch(pair):
    target, drafter = pair
    cfg = EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=64)
    mine = ("x", [1, 2, 3], SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True),
            DecodeKnobs(steps=2, draft_len=6, commit_order="left-to-right"))
    alone = run_to_completion(Engine(cfg), [mine])["x"]
    again = run_to_completion(Engine(cfg), [mine])["x"]
    others = [(f"o{i}", [4, i % V], SamplingParams(max_tokens=20 + i, temperature=0.5 + 0.1 * i, seed=100 + i,
                                                    ignore_eos=True), DecodeKnobs(steps=1 + i % 3, draft_len=i % 5))
              for i in range(5)]
    crowd = run_to_completion(Engine(cfg), others + [mine], join_after={"x": 2, "o3": 4})["x"]
    assert alone == again == crowd


def test_lenient_rule_reports_bounded_tvd(pair):
    target, drafter = pair
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=64))
    adds = [(f"t{i}", PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True),
             DecodeKnobs(steps=1, draft_len=4, quality="tvd=0.1")) for i in range(4)]
    adds.append(("exact", PROMPT, SamplingParams(max_tokens=40, temperature=1.0, seed=9, ignore_eos=True),
                 DecodeKnobs(steps=1, draft_len=4)))
    outs = run_to_completion(engine, adds)
    for i in range(4):
        st = outs[f"t{i}:stats"]
        assert st["rules_used"] == "EPS_TVD"
        assert 0.0 < st["tvd_spent"] <= 0.1 * (st["accepted"] + st["target_passes"]) + 1e-6
    assert outs["exact:stats"]["tvd_spent"] == 0.0


def test_packed_verification_changes_no_token(pair):
    """A ragged batch (rows verifying 0, 2, 4 drafts, greedy and sampled, diffusion and suffix
    drafts) gives the same tokens with packed verification forwards (each row's own positions)
    as with the batch padded to its longest row; prompts of unequal lengths are prefilled packed."""
    target, drafter = pair
    reqs = [(f"r{i}", [1 + i % 5, 2, 3] + [1 + (3 * i) % 7] * (i % 4), SamplingParams(max_tokens=24, temperature=(0.0, 1.0, 0.7)[i % 3], seed=11 + i,
                                                         ignore_eos=True),
             DecodeKnobs(steps=1 + i % 2, draft_len=(0, 2, 4)[i % 3], source="suffix" if i == 5 else "diffusion"))
            for i in range(6)]
    outs = {}
    for pack in ("on", "off"):
        engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=64, pack=pack))
        assert engine.pack == (pack == "on")
        outs[pack] = run_to_completion(engine, reqs)
    assert all(outs["on"][f"r{i}"] == outs["off"][f"r{i}"] for i in range(6))
    # 8 rows, one drafting: the forward's attention runs each row's real queries only
    few = [(f"f{i}", [1 + i % 5, 3] + [2] * i, SamplingParams(max_tokens=20, temperature=0.0 if i % 2 else 0.9, seed=i,
                                                     ignore_eos=True), DecodeKnobs(draft_len=6 if i == 0 else 0))
           for i in range(8)]
    got = {}
    for pack in ("on", "off"):
        engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=64, pack=pack))
        got[pack] = run_to_completion(engine, few)
    assert all(got["on"][f"f{i}"] == got["off"][f"f{i}"] for i in range(8))
    assert got["on"]["f0:stats"]["verified"] > 0
    with pytest.raises(Exception, match="pack"):
        Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", pack="sometimes"))


SHARP = {"s1-rejection": CONFIGS["s1-rejection"], "s2-confidence-match": CONFIGS["s2-confidence-match"],
         "s1-rejection-topk-topp": CONFIGS["s1-rejection-topk-topp"]}


def test_sharpened_drafts_still_sample_the_target(pair):
    """A drafter sampling at a lower temperature than the row's (`draft_temperature_scale`) changes
    which drafts are proposed, never the law of the output: rejection sampling reads the q each
    draft was drawn from. The drafts differ (the accepted counts move) and each law passes."""
    target, drafter = pair
    accepted = {}
    for scale in (1.0, 0.3):
        engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=96, max_len=32,
                                     draft_temperature_scale=scale))
        assert engine.drafting.temperature_scale == scale
        outs, _, accepted[scale] = sample_configs(engine, SHARP, N)
        if scale == 1.0:
            continue
        for name, (knobs, temp, top_k, top_p, _) in SHARP.items():
            samples = [tuple(t[1:4]) for rid, t in outs.items() if rid.startswith(name + "/")]
            p = chi2_pvalue(samples, exact_law(target, temp, top_k, top_p))
            assert p > 1e-3, f"{name} at scale {scale}: the sampled law departs from the target's (p = {p:.2e})"
            assert accepted[scale][name] > N // 8
    assert accepted[0.3] != accepted[1.0]  # the scale reached the drafter
    with pytest.raises(Exception, match="draft_temperature_scale"):
        Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", draft_temperature_scale=0.0))
