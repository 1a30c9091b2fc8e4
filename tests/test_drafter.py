"""The block-diffusion drafter module: masks, denoising, files and target pairing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from workers.drafter import (
    BlockDiffusionDrafter,
    DrafterConfig,
    DrafterPairingError,
    context_features,
    init_drafter,
    load_drafter,
)

V, T = 96, 24


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def setup(target):
    drafter = init_drafter(target.config, target.model.embed_tokens, target.lm_head, seed=1, block_size=8).eval()
    x = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = target(input_ids=x, output_hidden_states=True).hidden_states
    feats = context_features(hs, drafter.config.target_layer_ids)
    pos = torch.arange(T).expand(3, T)
    return drafter, x, feats, pos


def _block(drafter, x, feats, pos, L, tokens=None, masked=None):
    K = drafter.config.block_size
    B = x.shape[0]
    if tokens is None:
        tokens = torch.cat((x[torch.arange(B), L][:, None], torch.zeros(B, K, dtype=torch.long)), 1)
        masked = torch.ones(B, K + 1, dtype=torch.bool)
        masked[:, 0] = False
    kv = drafter.context_kv(feats, pos)
    ctx_mask = (pos < L[:, None])[:, None, :].expand(B, K + 1, T)
    return drafter.forward_block(drafter.embed_block(tokens, masked), L[:, None] + torch.arange(K + 1), kv, ctx_mask)


def test_default_config_spreads_layers_and_includes_last(target):
    cfg = DrafterConfig.for_target(target.config)
    assert cfg.target_layer_ids == [1, 3]
    assert DrafterConfig.for_target({**target.config.to_dict(), "num_hidden_layers": 6}).target_layer_ids == [1, 3, 5]
    with pytest.raises(ValueError, match="block_size"):
        DrafterConfig.for_target(target.config, block_size=17)
    with pytest.raises(ValueError, match="target_layer_ids"):
        DrafterConfig.for_target(target.config, target_layer_ids=[4])


def test_context_mask_hides_positions_at_and_after_anchor(setup):
    drafter, x, feats, pos = setup
    L = torch.tensor([5, 10, 17])
    with torch.no_grad():
        out = _block(drafter, x, feats, pos, L)
        changed = feats.clone()
        for r, l in enumerate(L.tolist()):
            changed[r, l:] = torch.randn_like(changed[r, l:])  # anchor and later: not visible
        assert torch.allclose(out, _block(drafter, x, changed, pos, L), atol=1e-6)
        changed = feats.clone()
        changed[:, 0] += 1.0  # a visible context position
        assert not torch.allclose(out, _block(drafter, x, changed, pos, L), atol=1e-4)


def test_attention_inside_the_block_is_non_causal(setup):
    drafter, x, feats, pos = setup
    L = torch.tensor([5, 10, 12])
    K = drafter.config.block_size
    tokens = torch.cat((x[torch.arange(3), L][:, None], torch.zeros(3, K, dtype=torch.long)), 1)
    masked = torch.ones(3, K + 1, dtype=torch.bool)
    masked[:, 0] = False
    with torch.no_grad():
        out = _block(drafter, x, feats, pos, L, tokens, masked)
        masked2 = masked.clone()
        masked2[:, -1] = False
        tokens2 = tokens.clone()
        tokens2[:, -1] = 7
        out2 = _block(drafter, x, feats, pos, L, tokens2, masked2)
    assert not torch.allclose(out[:, 0], out2[:, 0], atol=1e-5)  # the anchor sees the last position


def test_left_to_right_records_the_conditional_each_token_was_drawn_from(setup):
    drafter, x, feats, pos = setup
    K = drafter.config.block_size
    L = torch.tensor([6, 9, 13])
    kv = drafter.context_kv(feats, pos)
    anchor = x[torch.arange(3), L]
    tokens, q = drafter.draft(anchor, L, kv, pos < L[:, None], steps=K, left_to_right=True)
    assert tokens.shape == (3, K) and q.shape == (3, K, V)
    assert torch.equal(tokens, q.argmax(-1))
    # position j was drawn with positions < j committed and positions >= j masked
    for j in (0, 3, K - 1):
        block = torch.cat((anchor[:, None], tokens), 1)
        masked = torch.zeros(3, K + 1, dtype=torch.bool)
        masked[:, j + 1:] = True
        with torch.no_grad():
            logits = drafter.logits(_block(drafter, x, feats, pos, L, block, masked)[:, 1:]).float()
        assert torch.allclose(q[:, j], torch.softmax(logits[:, j], -1), atol=1e-5)


def test_confidence_order_commits_most_confident_first(setup):
    drafter, x, feats, pos = setup
    K = drafter.config.block_size
    L = torch.tensor([6, 9, 13])
    kv = drafter.context_kv(feats, pos)
    anchor = x[torch.arange(3), L]
    one, q1 = drafter.draft(anchor, L, kv, pos < L[:, None], steps=1)
    two, q2 = drafter.draft(anchor, L, kv, pos < L[:, None], steps=2)
    first = q1.max(-1).values.argsort(-1, descending=True)[:, : K // 2]  # committed in step 1
    assert torch.equal(one.gather(1, first), two.gather(1, first))
    assert torch.allclose(q1.gather(1, first[..., None].expand(-1, -1, V)), q2.gather(1, first[..., None].expand(-1, -1, V)))
    # sampling with given uniforms is reproducible and lies in the support of q
    u = torch.rand(3, 2, K, generator=torch.Generator().manual_seed(0))
    a, qa = drafter.draft(anchor, L, kv, pos < L[:, None], steps=2, temperature=1.0, uniforms=u)
    b, _ = drafter.draft(anchor, L, kv, pos < L[:, None], steps=2, temperature=1.0, uniforms=u)
    assert torch.equal(a, b) and (qa.gather(-1, a[..., None]) > 0).all()


def test_save_load_roundtrip_excludes_target_weights(setup, target, tmp_path):
    drafter, x, feats, pos = setup
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "adapt-block-diffusion"
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert not any("embed" in n and "mask" not in n or "lm_head" in n for n in names)
    loaded = load_drafter(tmp_path, target.config).bind(target.model.embed_tokens, target.lm_head)
    L = torch.tensor([4, 8, 16])
    with torch.no_grad():
        assert torch.equal(_block(drafter, x, feats, pos, L), _block(loaded, x, feats, pos, L))
    with pytest.raises(RuntimeError, match="bind"):
        load_drafter(tmp_path, target.config).logits(torch.zeros(1, 1, 32))


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 48, "hidden_size"),
    ("vocab_size", 100, "vocab_size"),
    ("num_hidden_layers", 2, "target_layer_ids"),
    ("intermediate_size", 80, "fingerprint"),
])
def test_pairing_errors_name_the_field(setup, target, tmp_path, field, value, match):
    drafter = setup[0]
    drafter.save_pretrained(tmp_path)
    other = {**target.config.to_dict(), field: value}
    with pytest.raises(DrafterPairingError, match=match):
        load_drafter(tmp_path, other)


def test_bind_rejects_other_embeddings(setup, target, tmp_path):
    drafter = setup[0]
    drafter.save_pretrained(tmp_path)
    other = LlamaForCausalLM(target.config)  # same architecture, different weights
    with pytest.raises(DrafterPairingError, match="embed_signature"):
        load_drafter(tmp_path, target.config).bind(other.model.embed_tokens, other.lm_head)
    with pytest.raises(ValueError, match="model_type"):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
        load_drafter(tmp_path, target.config)
    assert isinstance(drafter, BlockDiffusionDrafter)


def test_per_row_steps_match_separate_calls(setup):
    drafter, x, feats, pos = setup
    L = torch.tensor([6, 9, 13])
    kv = drafter.context_kv(feats, pos)
    anchor = x[torch.arange(3), L]
    mixed, qm = drafter.draft(anchor, L, kv, pos < L[:, None], steps=torch.tensor([1, 3, 0]))
    for row, s in ((0, 1), (1, 3)):
        tok, q = drafter.draft(anchor, L, kv, pos < L[:, None], steps=s)
        assert torch.equal(mixed[row], tok[row]) and torch.allclose(qm[row], q[row], atol=1e-6)
    assert (qm[2] == 0).all()  # s = 0: no draft


def test_cached_rope_and_block_in_cache_match_the_concatenating_path(setup):
    """The engine's decoding form (RoPE from the table, the block's keys / values written into the
    context buffer after the longest context, one additive mask) gives the training form's hidden
    states: the same attention over the same keys."""
    drafter, x, feats, pos = setup
    K, B = drafter.config.block_size, x.shape[0]
    L = torch.tensor([6, 9, 13])
    ref = _block(drafter, x, feats, pos, L)
    with torch.no_grad():
        C = int(L.max())
        kv = drafter.context_kv(feats[:, :C], pos[:, :C], bound=64)  # rows' contexts end at L <= C
        ctx = []
        for k, v in kv:  # buffers [B, kv, C + K + 1, d]: context, then room for the block
            pad = torch.zeros(B, k.shape[1], K + 1, k.shape[3])
            ctx.append((torch.cat((k, pad), 2), torch.cat((v, pad), 2)))
        cols = torch.arange(C + K + 1)
        attend = (cols[None] < L[:, None]) | (cols[None] >= C)
        mask = torch.zeros(B, 1, C + K + 1).masked_fill_(~attend[:, None], float("-inf"))
        tokens = torch.cat((x[torch.arange(B), L][:, None], torch.zeros(B, K, dtype=torch.long)), 1)
        masked = torch.ones(B, K + 1, dtype=torch.bool)
        masked[:, 0] = False
        positions = L[:, None] + torch.arange(K + 1)
        rope = drafter.rope(positions, torch.float32, bound=64)
        out = drafter.forward_block(drafter.embed_block(tokens, masked), positions, ctx, mask, rope=rope,
                                    block_in_ctx=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    cos, sin = drafter.rope(positions, torch.float32)  # computed, not looked up: the same values
    torch.testing.assert_close(cos, rope[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, rope[1], atol=0, rtol=0)
