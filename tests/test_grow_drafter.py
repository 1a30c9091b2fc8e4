"""A warm-started drafter grown deeper (`grow_drafter`, `adapt train-drafter --features ...
--init DIR --layers N`) drafts exactly as the drafter it grew from until training moves it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers.drafter import DrafterPairingError, load_drafter
from workers.training.feature_drafter import grow_drafter, target_parts

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"


def block_logits(drafter, feats, positions, tokens, masked):
    ctx_kv = drafter.context_kv(feats, positions)                                    # per layer [1, kv, T, d]
    block_pos = positions[:, -1:] + 1 + torch.arange(tokens.shape[1])[None]          # [1, K + 1]
    mask = torch.ones(1, tokens.shape[1], positions.shape[1], dtype=torch.bool)
    hidden = drafter.forward_block(drafter.embed_block(tokens, masked), block_pos, ctx_kv, mask)
    return drafter.draft_logits(hidden[:, 1:])


def test_a_grown_drafter_starts_as_the_drafter_it_grew_from():
    hf, embed, lm_head = target_parts(DEMO / "target")
    small = load_drafter(DEMO / "drafter", hf).bind(embed, lm_head).eval()
    n = small.config.num_layers
    big = grow_drafter(small, n + 1, hf, embed, lm_head, seed=3).eval()
    assert big.config.num_layers == n + 1 and len(big.layers) == n + 1
    assert sum(p.numel() for p in big.parameters()) > sum(p.numel() for p in small.parameters())
    torch.manual_seed(0)
    T, K = 12, small.config.block_size
    feats = torch.randn(1, T, len(small.config.target_layer_ids) * small.config.target_hidden_size)
    positions = torch.arange(T)[None]
    tokens = torch.randint(0, small.config.vocab_size, (1, K + 1))
    masked = torch.ones(1, K + 1, dtype=torch.bool)
    masked[:, 0] = False
    with torch.no_grad():
        assert torch.equal(block_logits(big, feats, positions, tokens, masked),
                           block_logits(small, feats, positions, tokens, masked))
    # the added layer is trainable: its output projections get gradients
    big.train()
    block_logits(big, feats, positions, tokens, masked).logsumexp(-1).sum().backward()
    assert big.layers[n].o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="only add layers"):
        grow_drafter(small, n, hf, embed, lm_head)


def test_growing_compares_the_embedding_signature_within_the_pairing_tolerance():
    """A signature off by rounding (another dtype's target parts) grows; one off by far is refused."""
    hf, embed, lm_head = target_parts(DEMO / "target")
    small = load_drafter(DEMO / "drafter", hf).bind(embed, lm_head)
    n = small.config.num_layers
    small.config.embed_signature = [x * (1 + 1e-4) for x in small.config.embed_signature]
    assert grow_drafter(small, n + 1, hf, embed, lm_head).config.num_layers == n + 1
    small.config.embed_signature = [x * 1.5 for x in small.config.embed_signature]
    with pytest.raises(DrafterPairingError, match="embed_signature"):
        grow_drafter(small, n + 1, hf, embed, lm_head)
