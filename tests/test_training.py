"""Tiny versions of both trainings (target, then drafter via `adapt train-drafter`) and the
evaluation harness's exactness."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from adapt.cli import main as adapt_main
from workers.drafter import load_drafter
from workers.training import target as target_training
from workers.training.drafter import load_target, sample_anchors, sample_known
from workers.training.regenerate import continue_greedy_or_sampled
from workers.training.spec_eval import speculative_decode

TINY_DRAFTER = ["--max-files", "5", "--regenerate", "--num-sequences", "8", "--prompt-len", "8",
                "--seq-len", "48", "--batch", "2", "--anchors", "4", "--block-size", "8", "--threads", "1",
                "--no-progress", "--fp32"]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    target_training.main(["--out", str(out), "--steps", "3", "--max-files", "5", "--hidden", "64", "--layers", "2",
                          "--heads", "2", "--intermediate", "128", "--vocab", "512", "--context", "64",
                          "--batch", "2", "--threads", "1"])
    return out


@pytest.fixture(scope="module")
def tiny_drafter(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    rc = adapt_main(["train-drafter", "--target", str(tiny_target), "--out", str(out), "--steps", "4",
                     "--save-every", "2", "--eval-prompts", "2", "--eval-prompt-len", "16", "--eval-tokens", "12",
                     *TINY_DRAFTER])
    assert rc == 0
    return out


def test_target_training_writes_a_transformers_directory(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 512
    assert json.loads((tiny_target / "train_metrics.json").read_text())["heldout"]["perplexity"] > 1


def test_train_drafter_writes_a_paired_drafter_and_its_evaluation(tiny_target, tiny_drafter):
    target, _ = load_target(tiny_target)
    drafter = load_drafter(tiny_drafter, target.config).bind(target.get_input_embeddings(), target.get_output_embeddings())
    assert drafter.config.block_size == 8 and drafter.config.target_layer_ids == [1]
    report = json.loads((tiny_drafter / "eval.json").read_text())
    runs = {(r["temperature"], r["steps"], r["commit_order"]) for r in report["eval"]}
    assert {(0.0, 1, "confidence"), (0.0, 4, "left-to-right"), (1.0, 2, "left-to-right")} <= runs
    for r in report["eval"]:
        assert 1.0 <= r["tau"] <= 9.0 and len(r["accept_per_position"]) == 8
    lines = (tiny_drafter / "train_log.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 4


def test_resume_continues_exactly(tiny_target, tiny_drafter, tmp_path):
    """Stopping after 2 of 4 steps, then --resume, gives the weights of 4 uninterrupted steps."""
    common = ["train-drafter", "--target", str(tiny_target), "--out", str(tmp_path), "--save-every", "2",
              "--eval-prompts", "0", *TINY_DRAFTER]
    assert adapt_main([*common, "--steps", "4", "--stop-after", "2"]) == 0
    assert not (tmp_path / "model.safetensors").exists()
    assert adapt_main([*common, "--steps", "4", "--resume"]) == 0
    straight = tmp_path / "straight"
    assert adapt_main([*common[:4], str(straight), *common[5:], "--steps", "4"]) == 0
    a, b = load_file(str(tmp_path / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_options_name_the_field(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="--target"):
        adapt_main(["train-drafter", "--target", str(tmp_path), "--out", str(tmp_path / "d")])
    with pytest.raises(ValueError, match="--anchors"):
        adapt_main(["train-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "d"), "--anchors", "0"])
    with pytest.raises(ValueError, match="block_size"):
        adapt_main(["train-drafter", "--target", str(tiny_target), "--out", str(tmp_path / "d"), *TINY_DRAFTER[:-4],
                    "--block-size", "17", "--steps", "1", "--eval-prompts", "0"])


def test_greedy_speculative_decoding_reproduces_target_greedy(tiny_target, tiny_drafter):
    target, _ = load_target(tiny_target)
    drafter = load_drafter(tiny_drafter, target.config).bind(target.get_input_embeddings(), target.get_output_embeddings())
    prompts = torch.randint(2, 512, (3, 10), generator=torch.Generator().manual_seed(0))
    ref = continue_greedy_or_sampled(target, prompts, 20, torch.zeros(3), torch.Generator(), autocast=False)[:, 10:]
    for steps, l2r in [(1, False), (2, False), (3, True)]:
        outs, res = speculative_decode(target, drafter, prompts.tolist(), 20, steps=steps, left_to_right=l2r, autocast=False)
        assert torch.equal(torch.tensor(outs), ref)
        assert res.passes >= 1 and res.tokens >= 20 * 3 - 3


def test_sampled_speculative_decoding_verifies_with_the_engine_rules(tiny_target, tiny_drafter):
    """T > 0: s = 1 verifies with REJECTION, confidence-ordered s = 2 with MATCH (the engine's
    `kernels.verify`); seeded runs repeat, and every output has its length."""
    target, _ = load_target(tiny_target)
    drafter = load_drafter(tiny_drafter, target.config).bind(target.get_input_embeddings(), target.get_output_embeddings())
    prompts = torch.randint(2, 512, (3, 10), generator=torch.Generator().manual_seed(2)).tolist()
    for steps, rule in ((1, "rejection"), (2, "match")):
        outs, res = speculative_decode(target, drafter, prompts, 20, steps=steps, temperature=1.0, autocast=False, seed=3)
        again, _ = speculative_decode(target, drafter, prompts, 20, steps=steps, temperature=1.0, autocast=False, seed=3)
        assert res.rule == rule and outs == again and all(len(o) == 20 for o in outs)
        assert res.tau >= 1.0 and len(res.accept_per_position) == drafter.config.block_size


def test_anchor_and_mask_sampling_shapes():
    g = torch.Generator().manual_seed(0)
    a = sample_anchors(3, 40, 5, 7, 8, g)
    assert a.shape == (3, 5) and a.min() >= 7 and a.max() <= 40 - 1 - 8
    assert (a.diff(dim=-1) > 0).all()
    known = sample_known(2, 500, 8, g)
    none = ~known.any(-1)
    assert 0.35 < none.float().mean() < 0.75  # about half the blocks fully masked


def test_manifest_hashes_shipped_files_and_detects_changes(tiny_target, tiny_drafter, tmp_path):
    import shutil

    from workers.training.manifest import check_manifest, write_manifest

    root = tmp_path / "demo"
    shutil.copytree(tiny_target, root / "target")
    shutil.copytree(tiny_drafter, root / "drafter")
    build = root / "build.sh"
    build.write_text('PY=python\n$PY -m workers.training.target --out x --seed 0\n'
                     '$PY -m adapt.cli train-drafter --target x \\\n  --out y --seed 3\n')
    m = write_manifest(root, build)
    assert "drafter/model.safetensors" in m["files"] and not any("checkpoint" in f for f in m["files"])
    assert m["seeds"] == {"target": 0, "drafter": 3} and len(m["commands"]) == 2
    assert m["drafter_eval"] and check_manifest(root) == []
    (root / "drafter" / "config.json").write_text("{}")
    assert check_manifest(root) == ["sha256 differs: drafter/config.json"]


def test_loop_detector_finds_periodic_tails_only():
    from workers.training.target_eval import is_loop

    periodic = torch.tensor([7, 8, 9]).repeat(40)                          # period 3
    late = torch.cat((torch.arange(100, 160), torch.arange(5).repeat(12)))  # loops only at the end
    varied = torch.arange(120)                                             # never repeats
    almost = periodic.clone()
    almost[-10] = 99                                                       # one break inside the window
    assert is_loop(torch.stack((periodic, late, varied, almost))).tolist() == [True, True, False, False]


def test_target_eval_reports_perplexity_and_loop_share(tiny_target, tmp_path):
    from workers.training import target_eval

    out = tmp_path / "target_eval.json"
    target_eval.main(["--target", str(tiny_target), "--num-prompts", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["heldout_perplexity"] > 1 and report["num_prompts"] == 3
    assert 0 < report["own_greedy_top1_prob"] <= 1 and report["own_greedy_entropy_nats"] >= 0
    share = report["loop_share_128_greedy"]
    assert 0.0 <= share <= 1.0 and abs(share * 3 - round(share * 3)) < 1e-6


def test_speculative_eval_reports_tau_without_looping_outputs(tiny_target, tiny_drafter):
    target, _ = load_target(tiny_target)
    drafter = load_drafter(tiny_drafter, target.config).bind(target.get_input_embeddings(), target.get_output_embeddings())
    prompts = torch.randint(2, 512, (4, 10), generator=torch.Generator().manual_seed(1)).tolist()
    outs, res = speculative_decode(target, drafter, prompts, 90, autocast=False)
    from workers.training.target_eval import is_loop

    loops = is_loop(torch.tensor(outs))
    assert res.loop_share == loops.float().mean().item()
    assert (res.tau_no_loop is None) == bool(loops.all())
    if res.tau_no_loop is not None:
        assert 1.0 <= res.tau_no_loop <= 9.0
    _, short = speculative_decode(target, drafter, prompts, 20, autocast=False)
    assert short.loop_share is None and short.tau_no_loop is None


def test_repeated_ngrams_are_marked_whole():
    from workers.training.unlikelihood import repeated_ngram_mask

    row = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 9, 9, 9, 9, 9]])
    assert repeated_ngram_mask(row).int().tolist() == [[0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1]]
    assert not repeated_ngram_mask(torch.arange(30)[None]).any()


def test_unlikelihood_fine_tuning_runs_and_writes_a_target(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from workers.training import unlikelihood

    report = unlikelihood.main(["--target", str(tiny_target), "--out", str(tmp_path), "--updates", "4",
                                "--ul-rows", "2", "--prompt-len", "8", "--new-tokens", "24", "--batch", "2",
                                "--context", "32", "--max-files", "5", "--eval-prompts", "0", "--threads", "1"])
    kinds = [next(k for k in e if k != "step") for e in report["log"]]
    assert kinds == ["unlikelihood", "likelihood"] * 2
    assert all(math.isfinite(e.get("unlikelihood", e.get("likelihood"))) for e in report["log"])
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 2


def test_compiled_loss_terms_match_eager_with_gradients():
    from workers.training.drafter import fused_loss_terms, loss_terms

    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(2, 3, 4, 50, generator=g)
    results = []
    for fn in (loss_terms, fused_loss_terms):
        logits = torch.randn(2, 3, 4, 50, generator=torch.Generator().manual_seed(1)).requires_grad_()
        ce, tv, labels = fn(logits, target_logits)
        (ce.sum() + 0.5 * tv.sum()).backward()
        results.append((ce, tv, labels, logits.grad))
    (ce0, tv0, l0, g0), (ce1, tv1, l1, g1) = results
    assert torch.equal(l0, l1) and torch.equal(l0, target_logits.argmax(-1))
    torch.testing.assert_close(ce0, ce1)
    torch.testing.assert_close(tv0, tv1)
    torch.testing.assert_close(g0, g1)
    assert (tv0 >= 0).all() and (tv0 <= 1).all()
