"""The target: a lean Llama / Qwen2 / Qwen3 forward over a slot-based KV cache.

`TargetModel` loads a local Hugging Face causal-LM directory (config.json, safetensors weights)
and runs the decoder without `generate`'s machinery: one call takes a padded batch of new tokens
`[B, T]`, writes their keys and values into a preallocated `KVCache` at each row's own start
position, attends causally over each row's cached prefix, and returns logits plus the hidden
states of the layers the drafter reads.

Family differences handled here: Qwen2 has q/k/v biases, Qwen3 has a per-head RMSNorm on q and k
(`q_norm`, `k_norm`) and an explicit `head_dim`, Llama may carry `attention_bias`/`mlp_bias`.
Parameter names match the Hugging Face checkpoints, so weights load with `load_state_dict`.

For inference `load_target` also calls `prepare_for_inference` (workers/linear.py): q/k/v and
gate/up become one matmul each (**fused projections**, the HF parameters become slices of the fused
weights), and on CPU every linear becomes shape-aware (small matmuls in fp32, large in bf16).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from workers.kv_cache import KVCache
from workers.layers import RMSNorm, SwiGLU, rope_cos_signed_sin, rotate_signed
from workers.linear import SMALL_MATMUL_MACS, WIDE_ROWS, Fusable, prepare_for_inference
from workers.request import ModelLoadError

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class TargetConfig:
    """The architecture facts the forward needs, read from a Hugging Face `config.json`."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position: int
    eos_token_ids: tuple[int, ...]
    hf_config: object = None  # the transformers PretrainedConfig, for loaders that want it

    @classmethod
    def from_hf(cls, hf) -> "TargetConfig":
        family = hf.model_type
        if family not in SUPPORTED_FAMILIES:
            raise ModelLoadError(f"target model_type {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"target rope_type {rope_type!r} is not supported (only 'default')")
        if getattr(hf, "use_sliding_window", False):
            raise ModelLoadError("target uses sliding-window attention, which is not supported")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attn_bias = bool(getattr(hf, "attention_bias", False))
        eos = hf.eos_token_id
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        return cls(
            family=family, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads, head_dim=head_dim,
            rope_theta=float(theta), rms_eps=float(hf.rms_norm_eps),
            qkv_bias=True if family == "qwen2" else attn_bias,
            o_bias=False if family == "qwen2" else attn_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            max_position=int(getattr(hf, "max_position_embeddings", 1 << 30)),
            eos_token_ids=eos, hf_config=hf,
        )


class Attention(Fusable):
    FUSE = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x, cos, sin, cache_k, cache_v, slot, mask, pack: Packing | None = None):
        """x [B, T, H], or [N, H] with `pack` (`TargetModel.forward`'s packed positions: the
        projections run on those N only); cos / signed sin [B or 1, T, 1, d] (`rope_cos_signed_sin`); cache_k/v
        [B, kvh, W, d] views of this layer's cache rows; slot: where the new tokens' K/V go, an
        int (every row's first new position in the views) or `(full_k, full_v, index)` (per-row
        positions: this layer's whole cache tensors and `write_kv`'s index into them);
        mask [B or 1, 1, T, W] additive (0 = attend, -inf = not) or None: causal with the T
        queries at the window's last T positions (one new token at the end: every key; a prefill
        whose window is its own T > `FEW_QUERIES` tokens: SDPA's `is_causal`)."""
        B, T = (x.shape[0], x.shape[1]) if pack is None else (pack.batch, pack.width)
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.fused("qkv")
        if qkv is not None:
            qkv = qkv(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), -1)
        qkv = unpack(qkv, pack).view(B, T, h + 2 * kvh, d)
        qk, v = qkv[:, :, : h + kvh], qkv[:, :, h + kvh :]  # [B, T, h + kvh, d], [B, T, kvh, d]
        if self.qk_norm:  # q_norm and k_norm in one norm: their weights stacked per head
            qk = self.q_norm.norm(qk, torch.cat((self.q_norm.weight.expand(h, d), self.k_norm.weight.expand(kvh, d))))
        qk = rotate_signed(qk, cos, sin)  # q and k heads in one RoPE
        q, k = qk[:, :, :h], qk[:, :, h:]
        write_kv(cache_k, cache_v, slot, k, v)
        q = q.to(cache_k.dtype)  # a cache kept in float32 under a bf16 model: attention in float32
        if pack is not None and pack.prompts:  # a packed prefill: each prompt over its own keys
            return self.o_proj(prompt_attention(q, cache_k, cache_v, pack.prompts).to(x.dtype))
        if pack is not None and pack.anchors is not None:  # only the rows' real queries attend
            out = ragged_query_attention(q, cache_k, cache_v, mask, pack)  # [N, h * d]
            return self.o_proj(out.to(x.dtype))
        if T <= FEW_QUERIES:
            out = few_query_attention(q, cache_k, cache_v, mask)  # [B, h, T, d]
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), cache_k, cache_v, attn_mask=mask, is_causal=mask is None, enable_gqa=h != kvh
            )  # [B, h, T, d]
        out = out.transpose(1, 2).reshape(B, T, h * d).to(x.dtype)
        return self.o_proj(out if pack is None else out.reshape(B * T, h * d)[pack.index])


class Packing(NamedTuple):
    """A packed forward's positions (`TargetModel.forward`'s `packed`), made once per forward.
    index [N]: flat positions, row-major into [batch, width]; with per-row counts also anchors
    [batch] (each row's first packed position) and drafting: (row, first packed position, count)
    of the rows with more than one query (host), which `ragged_query_attention` attends one by one;
    for a prefill from position 0, prompts: each row's prompt length (host), which
    `prompt_attention` attends row by row over the row's own keys."""

    index: torch.Tensor
    batch: int
    width: int
    anchors: torch.Tensor | None = None
    drafting: tuple[tuple[int, int, int], ...] = ()
    prompts: tuple[int, ...] = ()

    @classmethod
    def of(cls, index: torch.Tensor, batch: int, width: int, counts: list[int] | None,
           from_zero: bool = False) -> "Packing":
        if counts is None:
            return cls(index, batch, width)
        if len(counts) != batch or sum(counts) != index.shape[0]:
            raise ValueError(f"packed_counts: expected {batch} counts summing to {index.shape[0]}")
        if from_zero:
            return cls(index, batch, width, prompts=tuple(int(c) for c in counts))
        starts = list(itertools.accumulate(counts, initial=0))[:-1]
        drafting = tuple((r, s, c) for r, (s, c) in enumerate(zip(starts, counts)) if c > 1)
        return cls(index, batch, width, torch.tensor(starts, device=index.device), drafting)


def unpack(t: torch.Tensor, pack: Packing | None) -> torch.Tensor:
    """Packed rows t [N, D] back onto the padded layout [B, T, D] of `pack` (zeros elsewhere);
    t itself when ``pack`` is None."""
    if pack is None:
        return t
    full = t.new_zeros(pack.batch * pack.width, t.shape[-1])
    full.index_copy_(0, pack.index, t)
    return full.view(pack.batch, pack.width, t.shape[-1])


def ragged_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           pack: Packing) -> torch.Tensor:
    """Attention of each row's real queries only, in packed order: every row's first query (its
    anchor) in one batched call, then the further queries of each row that has some (a small loop
    over drafting rows, not tokens). A padded call would attend with every row padded to the
    longest: at 4 rows over ~300 cached tokens, one row verifying 8 drafts made SmolLM2's
    attention matmuls ~2x dearer for 3 rows that verify nothing.

    q [B, T, h, d] (padded layout); k, v [B, kvh, W, d]; mask [B or 1, 1, T, W] additive or None;
    pack: its `anchors` and `drafting`. Returns [N, h * d] in packed order."""
    B, T, h, d = q.shape
    first = few_query_attention(q[:, :1], k, v, None if mask is None else mask[:, :, :1])     # [B, h, 1, d]
    out = q.new_empty(pack.index.shape[0], h * d)
    out.index_copy_(0, pack.anchors, first.reshape(B, h * d))
    for r, start, c in pack.drafting:
        m = None if mask is None else mask[r if mask.shape[0] > 1 else 0][None, :, 1:c]
        rest = few_query_attention(q[r : r + 1, 1:c], k[r : r + 1], v[r : r + 1], m)          # [1, h, c - 1, d]
        out[start + 1 : start + c] = rest[0].transpose(0, 1).reshape(c - 1, h * d)
    return out


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """Causal attention of prompts prefilled from position 0, each over its own keys only: row r's
    first lengths[r] queries over its first lengths[r] keys (a loop over rows, not tokens). The
    padded call attends every row at the longest prompt's length: measured on SmolLM2, 16 mixed
    prompts of 46-257 tokens spent 15 % of their prefill in attention that way.

    q [B, T, h, d] (padded layout); k, v [B, kvh, W, d]. Returns [sum(lengths), h * d] in packed
    order (row-major)."""
    h, d = q.shape[2], q.shape[3]
    outs = []
    for r, n in enumerate(lengths):
        o = F.scaled_dot_product_attention(q[r : r + 1, :n].transpose(1, 2), k[r : r + 1, :, :n], v[r : r + 1, :, :n],
                                           is_causal=True, enable_gqa=h != k.shape[1])  # [1, h, n, d]
        outs.append(o[0].transpose(0, 1).reshape(n, h * d))
    return torch.cat(outs)


# Decode and verification steps (a few new tokens per row) attend with plain matmuls: on CPU,
# SDPA's flash kernel spends ~1.1 ms per call on 8 rows x 1 query x 330 keys (SmolLM2's 9 query /
# 3 KV heads), 60 % of a decode step; grouped matmuls over the KV heads take a fraction of that.
FEW_QUERIES = 32


def few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of a few queries over a KV cache, grouped-query heads without copies.

    q [B, T, h, d]; k, v [B, kvh, W, d] (h a multiple of kvh); mask [B or 1, 1, T, W] additive or
    None. Scores are computed in the input dtype (fp32 accumulation) and soft-maxed in fp32, as
    transformers' eager attention does. Returns [B, h, T, d]."""
    B, T, h, d = q.shape
    kvh, W = k.shape[1], k.shape[2]
    g = h // kvh
    qg = q.reshape(B, T, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * T, d)  # query head j*g+i -> kv head j
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * (d ** -0.5)          # [B, kvh, g*T, W]
    if mask is not None:
        m = mask.float().reshape(mask.shape[0], 1, 1, T, W).expand(-1, 1, g, T, W).reshape(mask.shape[0], 1, g * T, W)
        scores = scores + m
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)                                                     # [B, kvh, g*T, d]
    return out.view(B, kvh, g, T, d).reshape(B, h, T, d)


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, slot, k: torch.Tensor, v: torch.Tensor) -> None:
    """New keys / values k, v [B, T, kvh, d] into the cache at `slot`: an int (all rows from that
    position of the views cache_k / cache_v [B, kvh, W, d]: one plain copy each), or
    `(full_k, full_v, index)` for per-row positions: `index_put_` into the layer's whole cache
    tensors [max_batch, kvh, max_len, d] at index = (slots [B, T, 1], heads [1, 1, kvh],
    positions [B, T, 1]). Writing into the whole tensor rather than into the views lets a compiled
    forward write in place (through a view, functionalization copies the window out and back:
    ~0.8 ms of a 3.6 ms forward at 8 rows)."""
    if not isinstance(slot, tuple):  # an int (a SymInt under torch.export)
        T = k.shape[1]
        cache_k.narrow(2, slot, T).copy_(k.transpose(1, 2))
        cache_v.narrow(2, slot, T).copy_(v.transpose(1, 2))
    else:
        full_k, full_v, index = slot
        full_k.index_put_(index, k.to(full_k.dtype))
        full_v.index_put_(index, v.to(full_v.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, x, cos, sin, cache_k, cache_v, slot, mask, pack: Packing | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache_k, cache_v, slot, mask, pack)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    """Holds the parameters under the same names as the HF `model.` prefix."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class TargetModel(nn.Module):
    """Causal LM forward over a `KVCache`. Parameters are named as in the HF checkpoint."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.config = cfg
        self.model = _Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _rope(self, positions: torch.Tensor | int, T: int, dtype: torch.dtype, device: torch.device):
        """cos and signed sin (`rope_cos_signed_sin`), each [B, T, 1, d] (broadcast over heads), for
        positions [B, T], or [1, T, 1, d] for the positions `positions .. positions + T - 1` (an int):
        one lookup in a table built once."""
        need = int(self.config.max_position) + 64
        table = self.__dict__.get("_rope_table")
        if table is None or table.dtype != dtype or table.device != device or table.shape[0] < need:
            pos = torch.arange(need, device=device)
            table = rope_cos_signed_sin(pos, self.config.head_dim, self.config.rope_theta, dtype)  # [need, 2, d]
            self.__dict__["_rope_table"] = table
        cs = table[positions] if isinstance(positions, torch.Tensor) else table[positions : positions + T][None]
        return cs[:, :, 0:1], cs[:, :, 1:2]  # cs [B or 1, T, 2, d]

    def prepare_for_inference(self, shape_aware: bool = True, fuse: bool = True,
                              threshold: int = SMALL_MATMUL_MACS, wide_rows: int | None = WIDE_ROWS) -> "TargetModel":
        """Fused q/k/v and gate/up projections, and (CPU only) shape-aware linears; see
        workers/linear.py. Parameter names and `state_dict` are unchanged. Returns self."""
        return prepare_for_inference(self, shape_aware=shape_aware, fuse=fuse, threshold=threshold, wide_rows=wide_rows)

    def new_cache(self, max_batch: int, max_len: int, dtype=None) -> KVCache:
        """A KV cache for this model. Default dtype: the model's on accelerators; float32 on CPU,
        where bf16 attention matmuls (few queries over a long cache) take a slow path: measured
        at 8 rows x 600 cached tokens, SmolLM2's decode step took 24.5 ms with a float32 cache
        against 29.7 ms with a bf16 one (the attention then runs in float32, the linears in the
        model's dtype)."""
        cfg = self.config
        p = self.model.embed_tokens.weight
        if dtype is None:
            dtype = torch.float32 if p.device.type == "cpu" else p.dtype
        return KVCache(cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim,
                       dtype=dtype, device=p.device)

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, cache: KVCache, row0: int, width: int,
                capture: tuple[int, ...] = (), logits_index: torch.Tensor | None = None,
                start_value: int | None = None, packed: torch.Tensor | None = None,
                packed_counts: list[int] | None = None):
        """Run new tokens through the model, appending their K/V to the cache.

        input_ids [B, T] int64: new tokens of cache rows `row0 .. row0 + B - 1`, row r's token t
            sits at position start[r] + t (padding past a row's real tokens is harmless: its K/V
            land beyond the row's length and are overwritten before they are ever attended).
        start [B] int64: each row's cached length before this call.
        width: host-known bound on the attended window, >= max(start) + T.
        capture: decoder-layer indices whose outputs to return (0 = after the first layer; the last
            layer's entry is after the final norm, as in HF `output_hidden_states`, which the
            drafter was trained on).
        logits_index [B, J] int64 or None: if given, only those token positions get logits (with
            `packed` too: positions of the padded layout, each one `packed` keeps).
        start_value: optional host-side promise that every entry of `start` equals it; the forward
            then writes K/V with plain copies, slices its RoPE table and shares one mask across
            rows (none at all for one new token at the end of the window). Same results.
        packed [N] int64 or None: the flat positions (row-major into B·T) that matter, e.g. each
            row's anchor and the drafts it verifies. The projections, MLPs and LM head then run
            on those N positions only, and attention on the padded layout (zeros elsewhere).
            Padded positions cost as much as real ones in a compute-bound forward, so on a CPU
            this makes a row's draft (or a short prompt prefilled beside a long one) cost only
            its own positions. Logits come back [N, V], or [B, J, V] with `logits_index`.
        packed_counts: with `packed`, the host list of positions per row (`packed` must then be
            each row's first `counts[r]` positions, row-major); attention then runs each row's
            real queries only (`ragged_query_attention`), not the padded layout's; in a prefill
            (`start_value` 0), each prompt over its own keys (`prompt_attention`).
        Returns logits [B, T or J, V] ([N, V] with `packed` alone) in float32 and hidden
        [B, T, len(capture) * H] (or None; zeros at positions `packed` leaves out).
        """
        B, T = input_ids.shape
        device = input_ids.device
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        pack = None
        if packed is not None:
            pack = Packing.of(packed, B, T, packed_counts, from_zero=start_value == 0 and T > 1)
            x = x.reshape(B * T, -1)[packed]  # [N, H]
        index = None  # per-row starts: where the new K/V go in the whole cache tensors
        if start_value is not None:  # one start for all rows
            cos, sin = self._rope(start_value, T, x.dtype, device)  # [1, T, 1, d] each: cos, signed sin
            positions = None if T == 1 and width == start_value + 1 else \
                torch.arange(start_value, start_value + T, device=device)[None]  # [1, T]
        else:
            positions = start[:, None] + torch.arange(T, device=device)  # [B, T]
            heads = torch.arange(self.config.num_kv_heads, device=device)
            index = ((row0 + torch.arange(B, device=device))[:, None, None], heads[None, None], positions[:, :, None])
            cos, sin = self._rope(positions, T, x.dtype, device)  # [B, T, 1, d] each: cos, signed sin
        # no mask to build where attention is causal by itself: a packed prefill's prompt_attention,
        # and a prefill whose window is its own tokens (SDPA's is_causal skips the masked half of the
        # scores: 30 against 56 ms a layer for a 1,773-token prompt on SmolLM2, 2 CPU threads)
        from_zero = start_value == 0 and width == T and T > FEW_QUERIES and pack is None
        mask = None
        if positions is not None and not (pack is not None and pack.prompts) and not from_zero:
            mask = causal_mask(positions, width, cache.k[0].dtype)  # the attention's dtype
        captured: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            ck, cv = cache.view(i, row0, B, width)
            slot = start_value if index is None else (cache.k[i], cache.v[i], index)
            x = layer(x, cos, sin, ck, cv, slot, mask, pack)
            if i in capture and i != last:
                captured[i] = unpack(x, pack)
        x = self.model.norm(x)
        if last in capture:  # as in HF's output_hidden_states, the last entry is after the final norm
            captured[last] = unpack(x, pack)
        hidden = torch.cat([captured[i] for i in capture], -1) if capture else None
        if logits_index is not None and pack is not None:  # padded positions -> packed order
            order = torch.full((B * T,), -1, dtype=torch.long, device=device)
            order[pack.index] = torch.arange(pack.index.shape[0], device=device)
            x = x[order[(torch.arange(B, device=device)[:, None] * T + logits_index).reshape(-1)]]
            x = x.view(B, logits_index.shape[1], -1)  # [B, J, H]
        elif logits_index is not None:
            x = x.gather(1, logits_index[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(x).float()
        return logits, hidden


def causal_mask(positions: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [N, 1, T, W] for queries at positions [N, T] over cache positions < width:
    0 where key position <= query position, -inf elsewhere (SDPA is ~10% faster with an additive
    mask than with a boolean one)."""
    N, T = positions.shape
    keys = torch.arange(width, device=positions.device)  # [W]
    mask = torch.zeros(N, 1, T, width, dtype=dtype, device=positions.device)
    return mask.masked_fill_((keys > positions[:, :, None])[:, None], float("-inf"))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = the fastest on the device: bfloat16 on CPUs and on GPUs that support it."""
    if name == "auto":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists():
        return load_file(str(single))
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(path / shard)))
        return state
    raise ModelLoadError(f"target directory {path} has no model.safetensors (or sharded index)")


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                shape_aware: bool = True, fuse: bool = True, wide_rows: int | None = WIDE_ROWS) -> TargetModel:
    """Load a local HF Llama/Qwen2/Qwen3 directory into a `TargetModel` (eval mode, no grad),
    prepared for inference (`TargetModel.prepare_for_inference(shape_aware, fuse, wide_rows=...)`)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"target directory {str(path)!r} does not exist or has no config.json")
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        raise ModelLoadError(f"target config in {path} cannot be read: {exc}") from exc
    cfg = TargetConfig.from_hf(hf)
    with torch.device("meta"):
        model = TargetModel(cfg)
    state = {k: v for k, v in _read_state_dict(path).items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = set(model.state_dict()) - set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ModelLoadError(f"target weights in {path} do not match a {cfg.family} model: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model.prepare_for_inference(shape_aware=shape_aware, fuse=fuse, wide_rows=wide_rows)
