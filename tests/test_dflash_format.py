"""Published DFlash drafters (workers/dflash_format.py): layout, conventions, exactness, refusals.

No hub: the DFlash checkpoints here are the shipped demo drafter written in the published layout
(`save_dflash`: DFlash names, block size counting the anchor, mask as `mask_embedding.pt` or as the
target's embedding row of `mask_token_id`). Loading them must give the original drafter's drafts,
τ and (greedy) the target's own output; an independent forward written from DFlash's description
with transformers' Qwen3 building blocks checks the conventions themselves (a name mapping that is
wrong both ways would survive a round trip, not this).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from adapt.cli import main as cli_main
from tests.tiny_models import run_to_completion, single_thread
from workers.dflash_format import (
    DFlashDrafter,
    DFlashFormatError,
    build_target_layer_ids,
    is_dflash_dir,
    load_dflash,
    save_dflash,
    supports_draft_vocab,
)
from workers.drafter import DrafterPairingError, context_features, init_drafter, load_drafter
from workers.engine import DEMO_DRAFTER, DEMO_TARGET, Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
NEW_TOKENS = 40
MASK_ID = 4095  # a demo-vocabulary token that these prompts and outputs do not contain


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The demo drafter in our format and as a DFlash export with mask_embedding.pt; the demo drafter
    with the target's row of MASK_ID as its mask, in our format and as a DFlash export without
    mask_embedding.pt (the standard z-lab layout)."""
    tmp = tmp_path_factory.mktemp("dflash")
    tcfg = AutoConfig.from_pretrained(DEMO_TARGET)
    drafter = load_drafter(DEMO_DRAFTER, tcfg)
    save_dflash(drafter, tcfg, tmp / "dflash_pt", MASK_ID)  # learned mask -> mask_embedding.pt
    # the standard z-lab layout: the mask is the target's embedding row of mask_token_id, so the
    # drafter it should equal is ours with that row as its mask vector
    target = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    row = target.get_input_embeddings().weight[MASK_ID].detach()
    with torch.no_grad():
        drafter.mask_embedding.copy_(row.to(drafter.mask_embedding))
    drafter.save_pretrained(tmp / "ours_row")
    drafter.bind(target.get_input_embeddings(), target.get_output_embeddings())
    save_dflash(drafter, tcfg, tmp / "dflash_row", MASK_ID, mask_embedding_file=False)
    return {"tmp": tmp, "tcfg": tcfg, "ours": DEMO_DRAFTER, "dflash_pt": tmp / "dflash_pt",
            "ours_row": tmp / "ours_row", "dflash_row": tmp / "dflash_row"}


_DECODED: dict = {}


def _decode(drafter_dir) -> tuple[dict, list]:
    """Greedy outputs and stats of PROMPTS through the engine (fp32, s = 1, k = the whole block),
    and the target's own greedy output (k = 0 rows of the same engine). Memoised per directory."""
    if str(drafter_dir) not in _DECODED:
        _DECODED[str(drafter_dir)] = _run_engine(drafter_dir)
    return _DECODED[str(drafter_dir)]


def _run_engine(drafter_dir) -> tuple[dict, list]:
    tok = AutoTokenizer.from_pretrained(DEMO_TARGET)
    engine = Engine(EngineConfig(target=DEMO_TARGET, drafter=drafter_dir, dtype="float32", max_batch=4,
                                 max_len=128))
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    K = engine.drafter.config.block_size
    adds = []
    for i, p in enumerate(PROMPTS):
        ids = tok(p)["input_ids"]
        adds.append((f"s{i}", ids, params, DecodeKnobs(steps=1, draft_len=K)))
        adds.append((f"a{i}", ids, params, DecodeKnobs(steps=1, draft_len=0)))
    return run_to_completion(engine, adds), [engine.drafter]


def _summary(outs) -> dict:
    return {i: (outs[f"s{i}"], outs[f"s{i}:stats"]["tau"], outs[f"s{i}:stats"]["accept_per_position"])
            for i in range(len(PROMPTS))}


def test_written_checkpoint_has_the_published_layout(dirs):
    cfg = json.loads((dirs["dflash_pt"] / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 17  # the anchor + our 16 drafted tokens
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 5]}
    assert cfg["num_target_layers"] == 6
    names = set(load_file(str(dirs["dflash_pt"] / "model.safetensors")))
    per_layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{p}.weight" for i in range(2) for p in per_layer}
    assert names == expected  # no embedding, no LM head, no mask vector among the weights
    assert (dirs["dflash_pt"] / "mask_embedding.pt").is_file()
    assert not (dirs["dflash_row"] / "mask_embedding.pt").exists()
    assert is_dflash_dir(dirs["dflash_pt"]) and not is_dflash_dir(DEMO_DRAFTER)


def _reference_dflash_logits(ckpt, target, feats, anchor, L):
    """DFlash's drafter forward as published, from transformers' Qwen3 parts and the checkpoint's
    own names: masked slots embedded as the target's row of mask_token_id; context = hidden_norm(fc(
    taps)); per layer q from the block only, k/v from [context ; block], q_norm / k_norm per head,
    RoPE at absolute positions (context 0..L-1, block L..L+B-1), no causal mask; logits =
    target lm_head(norm(h)) of the B-1 drafted slots."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3MLP,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = Qwen3Config.from_pretrained(str(ckpt))
    w = load_file(str(ckpt / "model.safetensors"))
    B, H, eps = cfg.block_size, cfg.hidden_size, cfg.rms_norm_eps
    nh, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(name, size):
        n = Qwen3RMSNorm(size, eps)
        n.weight.data = w[name].float()
        return n

    block = torch.full((1, B), cfg.dflash_config["mask_token_id"])
    block[0, 0] = anchor
    x = target.get_input_embeddings()(block)                                   # [1, B, H]
    ctx = norm("hidden_norm.weight", H)(feats @ w["fc.weight"].float().T)      # [1, L, H]
    rope = Qwen3RotaryEmbedding(cfg)
    cos, sin = rope(x, torch.arange(L + B)[None])                              # [1, L + B, d]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = norm(p + "input_layernorm.weight", H)(x)
        both = torch.cat((ctx, h), 1)                                          # [1, L + B, H]
        q = norm(p + "self_attn.q_norm.weight", d)((h @ w[p + "self_attn.q_proj.weight"].float().T).view(1, B, nh, d))
        k = (both @ w[p + "self_attn.k_proj.weight"].float().T).view(1, L + B, kvh, d)
        k = norm(p + "self_attn.k_norm.weight", d)(k)
        v = (both @ w[p + "self_attn.v_proj.weight"].float().T).view(1, L + B, kvh, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos[:, L:], sin[:, L:])
        k, _ = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
        k, v = k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1) @ v         # [1, nh, B, d]
        x = x + att.transpose(1, 2).reshape(1, B, nh * d) @ w[p + "self_attn.o_proj.weight"].float().T
        mlp = Qwen3MLP(cfg)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, n).weight.data = w[p + f"mlp.{n}.weight"].float()
        x = x + mlp(norm(p + "post_attention_layernorm.weight", H)(x))
    return target.get_output_embeddings()(norm("norm.weight", H)(x)[:, 1:])  # [1, B - 1, V]


@torch.no_grad()
def test_loaded_checkpoint_follows_the_dflash_reference_forward(dirs):
    target = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(DEMO_TARGET)(PROMPTS[1])["input_ids"]])
    L = ids.shape[1]
    out = target(ids, output_hidden_states=True)
    drafter = load_drafter(dirs["dflash_row"], dirs["tcfg"])
    assert isinstance(drafter, DFlashDrafter) and drafter.mask_from_target
    drafter.bind(target.get_input_embeddings(), target.get_output_embeddings()).eval()
    feats = context_features(out.hidden_states, drafter.config.target_layer_ids)
    anchor = out.logits[0, -1].argmax()
    ref = _reference_dflash_logits(dirs["dflash_row"], target, feats, anchor, L)
    K = drafter.config.block_size
    masked = torch.arange(K + 1)[None] > 0
    block = torch.cat((anchor.view(1, 1), torch.zeros(1, K, dtype=torch.long)), 1)
    hidden = drafter.forward_block(drafter.embed_block(block, masked),
                                   L + torch.arange(K + 1)[None], drafter.context_kv(feats, torch.arange(L)[None]),
                                   torch.ones(1, K + 1, L, dtype=torch.bool))
    torch.testing.assert_close(drafter.logits(hidden)[:, 1:], ref, atol=1e-4, rtol=1e-4)


def test_loading_dflash_gives_the_same_drafts_tau_and_greedy_output(dirs):
    base, _ = _decode(dirs["ours"])
    for i in range(len(PROMPTS)):
        assert base[f"s{i}"] == base[f"a{i}"]  # greedy speculative output = the target's own
        assert MASK_ID not in base[f"s{i}"]
    assert all(base[f"s{i}:stats"]["tau"] > 1.5 for i in range(len(PROMPTS)))  # the demo drafter drafts
    pt, (pt_drafter,) = _decode(dirs["dflash_pt"])
    assert isinstance(pt_drafter, DFlashDrafter) and not pt_drafter.mask_from_target
    assert _summary(pt) == _summary(base)
    row_ours, _ = _decode(dirs["ours_row"])
    row, (row_drafter,) = _decode(dirs["dflash_row"])
    assert row_drafter.mask_from_target
    assert _summary(row) == _summary(row_ours)
    for i in range(len(PROMPTS)):
        assert row[f"s{i}"] == base[f"a{i}"]


def test_convert_drafter_keeps_tau(dirs, capsys):
    out = dirs["tmp"] / "converted"
    assert cli_main(["convert-drafter", "--from", "dflash", str(dirs["dflash_row"]), "--target", str(DEMO_TARGET),
                     "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["mask"] == f"target embedding row {MASK_ID}" and summary["block_size"] == 16
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "adapt-block-diffusion" and cfg["target_fingerprint"] and cfg["embed_signature"]
    converted = load_drafter(out, dirs["tcfg"])
    expected = load_drafter(dirs["ours_row"], dirs["tcfg"])
    for name, tensor in expected.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    conv, _ = _decode(out)
    orig, _ = _decode(dirs["dflash_row"])
    assert _summary(conv) == _summary(orig)
    # the row mask is not what the demo drafter was trained with (tau ~1.05); with its learned mask
    # shipped as mask_embedding.pt the converted drafter keeps the demo drafter's tau (~1.9, 1.7)
    out_pt = dirs["tmp"] / "converted_pt"
    assert cli_main(["convert-drafter", "--from", "dflash", str(dirs["dflash_pt"]), "--target", str(DEMO_TARGET),
                     "--out", str(out_pt)]) == 0
    assert json.loads(capsys.readouterr().out)["mask"] == "mask_embedding.pt"
    conv_pt, _ = _decode(out_pt)
    base, _ = _decode(dirs["ours"])
    assert _summary(conv_pt) == _summary(base)


def _tiny_checkpoint(tmp_path, **edits):
    """A tiny drafter in the DFlash layout (target: 8 layers, hidden 32, vocab 64), then `edits`
    applied to its config.json (dotted keys reach into dflash_config; None deletes)."""
    tcfg = {"model_type": "llama", "hidden_size": 32, "vocab_size": 64, "num_hidden_layers": 8,
            "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64}
    drafter = init_drafter(tcfg, seed=0, block_size=8, target_layer_ids=[1, 5])  # 2 layers
    out = save_dflash(drafter, tcfg, tmp_path / "ckpt", mask_token_id=63, mask_embedding_file=False)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in edits.items():
        node, name = (cfg["dflash_config"], key.split(".", 1)[1]) if key.startswith("dflash_config.") else (cfg, key)
        if value is None:
            node.pop(name, None)
        else:
            node[name] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out, tcfg


def test_defaults_follow_dflash(tmp_path):
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16's taps
    assert build_target_layer_ids(8, 1) == [4]
    rope = {"rope_theta": 5e5, "rope_type": "default"}
    out, tcfg = _tiny_checkpoint(tmp_path, **{"dflash_config.target_layer_ids": None, "block_size": None,
                                              "dflash_config.block_size": 16, "rope_theta": None,
                                              "rope_scaling": None, "rope_parameters": rope})
    drafter = load_dflash(out, tcfg)
    assert drafter.config.target_layer_ids == build_target_layer_ids(8, 2) == [1, 5]
    assert drafter.config.block_size == 15 and drafter.config.rope_theta == 5e5
    with pytest.raises(RuntimeError, match="bind"):
        drafter.save_pretrained(tmp_path / "unbound")  # its mask comes from the target


@pytest.mark.parametrize("edits, match", [
    ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
    ({"dflash_config.causal": True}, "causal"),
    ({"dflash_config.use_swa": True}, "use_swa"),
    ({"dflash_config.attention_sink_bias": True}, "attention_sink_bias"),
    ({"dflash_config.projector_type": "domino"}, "projector_type"),
    ({"dflash_config.new_thing": 1}, "new_thing"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": None, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
     "use_sliding_window"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"logit_scale": 2.0}, "logit_scale"),
    ({"draft_vocab_size": 32}, "draft_vocab_size"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"block_size": 33}, "block_size"),
    ({"dflash_config.mask_token_id": None}, "mask_token_id"),
    ({"some_new_field": 3}, "some_new_field"),
])
def test_unimplemented_fields_are_refused_by_name(tmp_path, edits, match):
    out, tcfg = _tiny_checkpoint(tmp_path, **edits)
    with pytest.raises(DFlashFormatError, match=match):
        load_drafter(out, tcfg)


@pytest.mark.parametrize("edits, match", [
    ({"num_target_layers": 36}, "num_target_layers"),
    ({"dflash_config.target_layer_ids": [1, 9, 17]}, "target_layer_ids"),
    ({"vocab_size": 128}, "vocab_size"),
])
def test_pairing_mismatches_are_refused_by_name(tmp_path, edits, match):
    out, tcfg = _tiny_checkpoint(tmp_path, **edits)
    with pytest.raises(DrafterPairingError, match=match):
        load_drafter(out, tcfg)


@torch.no_grad()
def test_d2t_maps_onto_the_reduced_draft_vocabulary(tmp_path):
    """DFlash / EAGLE-3 `d2t` (target id = draft id + d2t[draft id]) becomes our `draft_ids` where
    our drafter has a reduced vocabulary; where it has none, the checkpoint is refused by name."""
    out, tcfg = _tiny_checkpoint(tmp_path)
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False)
    full = load_drafter(out, tcfg).bind(embed, head)
    ids = torch.tensor([2, 3, 5, 7, 11, 13, 40, 63])
    state = load_file(str(out / "model.safetensors"))
    t2d = torch.zeros(64, dtype=torch.bool).index_fill_(0, ids, True)
    save_file({**state, "d2t": ids - torch.arange(8), "t2d": t2d}, str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": 8}))
    if not supports_draft_vocab():
        with pytest.raises(DFlashFormatError, match="draft_vocab_size"):
            load_drafter(out, tcfg)
        return
    reduced = load_drafter(out, tcfg).bind(embed, head)
    assert torch.equal(reduced.draft_ids, ids)
    hidden = torch.randn(2, 3, 32)
    want = torch.full((2, 3, 64), float("-inf"))
    want[..., ids] = full.logits(hidden)[..., ids]
    torch.testing.assert_close(reduced.logits(hidden), want, atol=1e-6, rtol=1e-6)
    again = save_dflash(reduced, tcfg, tmp_path / "again", mask_token_id=63)
    written = load_file(str(again / "model.safetensors"))
    assert torch.equal(written["d2t"], ids - torch.arange(8)) and torch.equal(written["t2d"], t2d)
    assert torch.equal(load_drafter(again, tcfg).draft_ids, ids)
    (out / "config.json").write_text(json.dumps(cfg))  # d2t without draft_vocab_size
    with pytest.raises(DFlashFormatError, match="d2t"):
        load_drafter(out, tcfg)


@pytest.mark.parametrize("extra, match", [
    ({"lm_head.weight": torch.zeros(64, 32)}, "lm_head"),
    ({"embed_tokens.weight": torch.zeros(64, 32)}, "embed_tokens"),
    ({"layers.0.self_attn.q_proj.bias": torch.zeros(64)}, "q_proj.bias"),
])
def test_unimplemented_weights_are_refused_by_name(tmp_path, extra, match):
    out, tcfg = _tiny_checkpoint(tmp_path)
    state = load_file(str(out / "model.safetensors"))
    save_file({**state, **extra}, str(out / "model.safetensors"))
    with pytest.raises(DFlashFormatError, match=match):
        load_drafter(out, tcfg)


def test_missing_weights_and_sharded_files(tmp_path):
    out, tcfg = _tiny_checkpoint(tmp_path)
    state = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(state)
    save_file({n: state[n] for n in names[:10]}, str(out / "model-00001-of-00002.safetensors"))
    save_file({n: state[n] for n in names[10:]}, str(out / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {n: f"model-0000{1 if j < 10 else 2}-of-00002.safetensors" for j, n in enumerate(names)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_drafter(out, tcfg)
    assert torch.equal(loaded.fc.weight, state["fc.weight"])
    shutil.rmtree(out)
    out, tcfg = _tiny_checkpoint(tmp_path)
    save_file({n: t for n, t in state.items() if n != "hidden_norm.weight"}, str(out / "model.safetensors"))
    with pytest.raises(DFlashFormatError, match="hidden_norm"):
        load_drafter(out, tcfg)
