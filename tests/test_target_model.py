"""The lean target forward matches plain transformers (logits and hidden states), per family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import make_tiny_target, single_thread
from workers.request import ModelLoadError
from workers.target_model import load_target

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_over_ragged_cache(tmp_path, family):
    path = make_tiny_target(tmp_path / family, family=family, vocab=128, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    model = load_target(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 128, (n,), generator=gen) for n in (12, 8, 16)]
    cache = model.new_cache(max_batch=4, max_len=64)

    # prefill ragged prompts (right-padded) into slots 1..3, then two ragged chunks of new tokens
    prompt_lens = [5, 2, 7]
    P = max(prompt_lens)
    ids = torch.stack([torch.cat([s[:n], torch.ones(P - n, dtype=torch.long)]) for s, n in zip(seqs, prompt_lens)])
    logits, hidden = model(ids, torch.zeros(3, dtype=torch.long), cache, row0=1, width=P, capture=(0, 1))
    with torch.no_grad():
        for r, (s, n) in enumerate(zip(seqs, prompt_lens)):
            ref = hf(s[None, :n], output_hidden_states=True)
            torch.testing.assert_close(logits[r, :n], ref.logits[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(hidden[r, :n], torch.cat([ref.hidden_states[1][0], ref.hidden_states[2][0]], -1),
                                       atol=1e-4, rtol=1e-4)
    lengths = list(prompt_lens)
    for chunk in ([2, 1, 4], [2, 2, 2]):
        T = max(chunk)
        new = torch.stack([torch.cat([s[L:L + c], torch.ones(T - c, dtype=torch.long)]) for s, L, c in zip(seqs, lengths, chunk)])
        start = torch.tensor(lengths)
        logits, _ = model(new, start, cache, row0=1, width=max(lengths) + T)
        with torch.no_grad():
            for r, (s, L, c) in enumerate(zip(seqs, lengths, chunk)):
                ref = hf(s[None, : L + c]).logits[0, L:]
                torch.testing.assert_close(logits[r, :c], ref, atol=1e-4, rtol=1e-4)
        lengths = [L + c for L, c in zip(lengths, chunk)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_long_prefill_from_position_zero_is_causal_without_a_mask(tmp_path, family):
    """A prefill from position 0 of more than `FEW_QUERIES` tokens whose window is its own tokens
    builds no mask (SDPA's `is_causal`): right-padded prompts of unequal lengths still give each
    prompt transformers' logits, and the cache it leaves decodes on as transformers does."""
    from workers.target_model import FEW_QUERIES

    path = make_tiny_target(tmp_path / family, family=family, vocab=128, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    model = load_target(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    lens = [FEW_QUERIES + 8, FEW_QUERIES + 1, FEW_QUERIES + 5]
    P = max(lens)
    seqs = [torch.randint(2, 128, (n + 2,), generator=gen) for n in lens]
    ids = torch.stack([torch.cat([s[:n], torch.ones(P - n, dtype=torch.long)]) for s, n in zip(seqs, lens)])
    cache = model.new_cache(max_batch=3, max_len=P + 8)
    logits, _ = model(ids, torch.zeros(3, dtype=torch.long), cache, row0=0, width=P, start_value=0)
    new = torch.stack([s[n : n + 2] for s, n in zip(seqs, lens)])                     # [3, 2]
    after, _ = model(new, torch.tensor(lens), cache, row0=0, width=P + 2)
    with torch.no_grad():
        for r, (s, n) in enumerate(zip(seqs, lens)):
            ref = hf(s[None, : n + 2]).logits[0]
            torch.testing.assert_close(logits[r, :n], ref[:n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(after[r], ref[n:], atol=1e-4, rtol=1e-4)


def test_unknown_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_target(tmp_path / "nope")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_common_start_gives_the_same_results(tmp_path, family):
    """`start_value` (every row starts at the same host-known position: plain K/V copies, a shared
    mask, none for one new token at the window's end) gives exactly the per-row path's results."""
    path = make_tiny_target(tmp_path / family, family=family, vocab=128, seed=2)
    model = load_target(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(2, 128, (3, 9), generator=gen)
    caches = [model.new_cache(max_batch=4, max_len=32) for _ in range(2)]
    outs = []
    for cache, common in zip(caches, (False, True)):
        kw = {"start_value": 0} if common else {}
        got = [model(prefix, torch.zeros(3, dtype=torch.long), cache, row0=1, width=9, capture=(0, 1), **kw)]
        for T, width in ((1, 10), (4, 14), (2, 20)):  # the last: a window wider than needed
            start = 9 if T == 1 else (10 if T == 4 else 14)
            new = torch.randint(2, 128, (3, T), generator=torch.Generator().manual_seed(T))
            kw = {"start_value": start} if common else {}
            got.append(model(new, torch.full((3,), start), cache, row0=1, width=width, capture=(1,), **kw))
        outs.append(got)
    for (l0, h0), (l1, h1) in zip(*outs):
        torch.testing.assert_close(l1, l0, atol=0, rtol=0)
        torch.testing.assert_close(h1, h0, atol=0, rtol=0)
    for c0, c1 in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        torch.testing.assert_close(c1[1:4, :, :16], c0[1:4, :, :16], atol=0, rtol=0)


def test_few_query_attention_matches_sdpa():
    """The decode/verify attention path (grouped matmuls) equals SDPA's, with per-row causal masks."""
    import torch.nn.functional as F

    from workers.target_model import causal_mask, few_query_attention

    torch.manual_seed(0)
    for B, T, h, kvh, W in ((1, 1, 9, 3, 40), (4, 5, 4, 4, 33), (3, 17, 8, 2, 64)):
        q = torch.randn(B, T, h, 16)
        k, v = torch.randn(B, kvh, W, 16), torch.randn(B, kvh, W, 16)
        starts = torch.randint(0, W - T + 1, (B,))
        mask = causal_mask(starts[:, None] + torch.arange(T), W, torch.float32)  # [B, 1, T, W]
        for m in (mask, None):
            want = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=m, enable_gqa=h != kvh)
            got = few_query_attention(q, k, v, m)
            assert got.shape == want.shape == (B, h, T, 16)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("common", [True, False], ids=["one-start", "per-row-starts"])
def test_packed_positions_give_the_padded_results(tmp_path, family, common):
    """`packed` (projections on each row's own positions) and `packed_counts` (attention of each
    row's real queries only) give the padded forward's logits and hidden states there."""
    path = make_tiny_target(tmp_path / family, family=family, vocab=128, seed=2)
    model = load_target(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    B, T = 5, 6
    counts = [6, 1, 3, 1, 1]  # row-major: each row's anchor and k_r drafts
    lens = [20] * B if common else [20, 17, 23, 9, 14]
    row = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
    col = torch.cat([torch.arange(c) for c in counts])
    packed = row * T + col
    ids = torch.randint(2, 128, (B, T), generator=gen)
    prompt = torch.randint(2, 128, (B, 24), generator=gen)
    outs = []
    for kwargs in ({}, {"packed": packed}, {"packed": packed, "packed_counts": counts}):
        cache = model.new_cache(max_batch=B, max_len=64)
        model(prompt, torch.zeros(B, dtype=torch.long), cache, 0, 24, start_value=0)
        start = torch.tensor(lens)
        logits, hidden = model(ids, start, cache, 0, max(lens) + T, capture=(0, 1),
                               start_value=lens[0] if common else None, **kwargs)
        outs.append((logits if not kwargs else None, logits, hidden))
    padded_logits, padded_hidden = outs[0][1][row, col], outs[0][2][row, col]
    for _, logits, hidden in outs[1:]:
        assert logits.shape == (sum(counts), 128)
        torch.testing.assert_close(logits, padded_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hidden[row, col], padded_hidden, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="packed_counts"):
        model(ids, torch.tensor(lens), model.new_cache(B, 64), 0, max(lens) + T, packed=packed, packed_counts=[1] * B)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_prefill_gives_the_padded_results(tmp_path, family):
    """A prefill of prompts of unequal lengths, packed (`packed` + `packed_counts` from position
    0: each prompt attends over its own keys) with logits at each prompt's last token, gives the
    padded prefill's logits, hidden states and cache, and the same next step after it."""
    path = make_tiny_target(tmp_path / family, family=family, vocab=128, seed=3)
    model = load_target(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    lens = [9, 1, 14, 5]
    B, P = len(lens), max(lens)
    ids = torch.randint(2, 128, (B, P), generator=gen)
    real = torch.arange(P)[None] < torch.tensor(lens)[:, None]  # [B, P]
    last = (torch.tensor(lens) - 1)[:, None]                    # [B, 1]
    packed = real.view(-1).nonzero().view(-1)
    zero = torch.zeros(B, dtype=torch.long)
    results = []
    for kwargs in ({}, {"packed": packed, "packed_counts": lens}):
        cache = model.new_cache(max_batch=B + 1, max_len=32)
        logits, hidden = model(ids, zero, cache, 1, P, capture=(0, 1), logits_index=last, start_value=0, **kwargs)
        nxt = torch.randint(2, 128, (B, 1), generator=torch.Generator().manual_seed(5))
        step, _ = model(nxt, torch.tensor(lens), cache, 1, P + 1)
        k = torch.stack([cache.k[0][1 + r, :, : lens[r]].sum() for r in range(B)])
        results.append((logits, hidden[real], step, k))
    assert results[1][0].shape == (B, 1, 128)
    for want, got in zip(results[0], results[1]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
