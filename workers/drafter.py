"""Block-diffusion drafter in the DFlash style: a few transformer layers that borrow the target.

Words used here:
- **block**: the drafter's input `[anchor, MASK × K]` at positions `L .. L + K`, where the
  **anchor** is the last known token (its KV is not yet in the target cache) and `L` is the
  committed length. Block index `j` (1..K) predicts the token at position `L + j`.
- **context**: hidden states of several target decoder layers (`target_layer_ids`, 0 = output of
  the first layer) at the committed positions `< L`, concatenated `[*, n * H]`, projected by `fc`
  and RMS-normed. Every drafter layer turns them into extra keys/values (**KV injection**); the
  block's queries attend to those and, non-causally, to the whole block.
- **denoising step**: one drafter pass over the block. With `s` steps, each pass re-predicts the
  still-masked positions and commits some of them (most confident first, or left to right); the
  committed tokens enter the next pass as ordinary token embeddings.

The drafter has no embedding or LM head of its own: `bind(embed_tokens, lm_head)` lends it the
target's (not registered as parameters, never saved). For inference the engine calls
`workers.linear.prepare_for_inference` on it: each layer's q/k/v and gate/up become one matmul, and
`context_kv` projects the keys and values of all layers in one matmul (`ctx_kv`); training
never prepares the drafter and runs the per-layer projections. On disk: `config.json`
(`"model_type": "adapt-block-diffusion"`) and `model.safetensors`. `load_drafter` checks that the
drafter was trained for the target it is paired with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from workers.layers import RMSNorm, SwiGLU, rope_cos_signed_sin, rotate_signed
from workers.linear import Fusable

MODEL_TYPE = "adapt-block-diffusion"
MAX_BLOCK_SIZE = 16
# Target config fields that define its architecture; hashed into the pairing fingerprint.
FINGERPRINT_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "intermediate_size")


class DrafterPairingError(ValueError):
    """The drafter was not trained for this target (sizes, layers or fingerprint differ)."""


def _field(config, name, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def target_fingerprint(target_config) -> str:
    """Short sha256 of the target's architecture fields (HF config object or dict)."""
    fields = {k: _field(target_config, k) for k in FINGERPRINT_FIELDS}
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def target_rope_theta(target_config) -> float:
    params = _field(target_config, "rope_parameters") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or _field(target_config, "rope_theta", 10000.0))


def default_layer_ids(num_target_layers: int, count: int | None = None) -> list[int]:
    """`count` target layers spread evenly across depth, always including the last one."""
    count = count or min(5, max(1, num_target_layers // 2))
    return sorted({round((i + 1) * num_target_layers / count) - 1 for i in range(count)})


@dataclass
class DrafterConfig:
    hidden_size: int                      # = the target's hidden size (shared embedding / LM head)
    vocab_size: int                       # = the target's vocabulary
    target_layer_ids: list[int]           # target decoder layers feeding the context
    target_hidden_size: int               # hidden size of those layers' outputs
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 768
    block_size: int = MAX_BLOCK_SIZE      # K, drafted tokens per block (≤ 16)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    draft_vocab_size: int = 0             # 0 = the whole target vocabulary; else the `draft_ids` subset
    target_fingerprint: str = ""          # see `target_fingerprint`
    embed_signature: list[float] = field(default_factory=list)  # norms of embedding rows 0..7
    model_type: str = MODEL_TYPE

    def __post_init__(self):
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 0..vocab_size ({self.vocab_size}), got {self.draft_vocab_size}")
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"model_type must be {MODEL_TYPE!r}, got {self.model_type!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown drafter config fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def for_target(cls, target_config, num_layers: int = 2, block_size: int = MAX_BLOCK_SIZE,
                   target_layer_ids: list[int] | None = None, intermediate_size: int | None = None,
                   num_heads: int | None = None) -> "DrafterConfig":
        """A drafter config sized after the target (HF config object or dict)."""
        hidden = _field(target_config, "hidden_size")
        n_layers = _field(target_config, "num_hidden_layers")
        heads = num_heads or _field(target_config, "num_attention_heads")
        ids = list(target_layer_ids) if target_layer_ids is not None else default_layer_ids(n_layers)
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target with {n_layers} layers")
        return cls(
            hidden_size=hidden, vocab_size=_field(target_config, "vocab_size"), target_layer_ids=ids,
            target_hidden_size=hidden, num_layers=num_layers, num_heads=heads, num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=intermediate_size or _field(target_config, "intermediate_size") or 3 * hidden,
            block_size=block_size, rope_theta=target_rope_theta(target_config),
            rms_norm_eps=float(_field(target_config, "rms_norm_eps", 1e-6)),
            target_fingerprint=target_fingerprint(target_config),
        )


class DrafterLayer(Fusable):
    """Pre-norm transformer layer whose attention also sees the injected context keys/values."""

    FUSE = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.unflatten(-1, (n, self.cfg.head_dim)).transpose(1, 2)  # [B, n, T, d]

    def _qkv_fused(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The fused projection's output [B, Q, (nh + 2 kv) d] -> q, k, v [B, heads, Q, d], with q
        and k normed and rotated together (one norm with the two weights stacked, one RoPE):
        the same per-head values as `q_norm` / `k_norm` and RoPE applied to each."""
        cfg = self.cfg
        nh, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        B, Q, _ = qkv.shape
        qkv = qkv.view(B, Q, nh + 2 * kv, d)
        weight = torch.cat((self.q_norm.weight.expand(nh, d), self.k_norm.weight.expand(kv, d)))  # [nh + kv, d]
        qk = rotate_signed(self.q_norm.norm(qkv[:, :, : nh + kv], weight), cos[:, :, None], sin[:, :, None])
        return qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2), qkv[:, :, nh + kv :].transpose(1, 2)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, H] (already normed) -> k, v each [B, kv_heads, T, d], RoPE on k.
        cos / sin [B, T, d]: cos and signed sin (`BlockDiffusionDrafter.rope`)."""
        return self.finish_kv(self.k_proj(x), self.v_proj(x), cos, sin)

    def finish_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projected k, v [B, T, kv_heads * d] -> k (normed, RoPE) and v, each [B, kv_heads, T, d]."""
        k = self.k_norm(self._heads(k, self.cfg.num_kv_heads))
        return rotate_signed(k, cos[:, None], sin[:, None]), self._heads(v, self.cfg.num_kv_heads)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, block_in_ctx: bool = False):
        """x [B, Q, H]; cos / signed sin [B, Q, d]; ctx_k/v [B, kv, C, d]; mask [B, Q or 1, C + Q]
        bool (True = attend) or additive float, or None (attend to everything).
        `block_in_ctx`: ctx_k/v are [B, kv, C + Q, d] buffers (cache views) whose last Q columns
        receive the block's keys / values, so attention reads them in place instead of a
        concatenated copy of the whole context."""
        cfg = self.cfg
        h = self.input_norm(x)
        qkv = self.fused("qkv")
        if qkv is not None:
            q, k, v = self._qkv_fused(qkv(h), cos, sin)
        else:
            q = self.q_proj(h)
            k, v = self.project_kv(h, cos, sin)
            q = rotate_signed(self.q_norm(self._heads(q, cfg.num_heads)), cos[:, None], sin[:, None])  # [B, nh, Q, d]
        if block_in_ctx:
            Q, W = k.shape[2], ctx_k.shape[2]
            ctx_k.narrow(2, W - Q, Q).copy_(k)
            ctx_v.narrow(2, W - Q, Q).copy_(v)
            k, v = ctx_k, ctx_v  # [B, kv, C + Q, d]
        else:
            k = torch.cat((ctx_k.to(k.dtype), k), dim=2)  # [B, kv, C + Q, d]
            v = torch.cat((ctx_v.to(v.dtype), v), dim=2)
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if mask is None else mask[:, None], enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        x = x + self.o_proj(attn.transpose(1, 2).flatten(2))
        return x + self.mlp(self.post_norm(x))


class BlockDiffusionDrafter(Fusable):
    """See the module docstring. Call `bind(embed_tokens, lm_head)` before `embed_block`/`logits`."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        # context k/v of every layer as one matmul, [B, T, layers * 2 * kv_heads * d] (after fuse())
        self.FUSE = {"ctx_kv": tuple(f"layers.{i}.{p}" for i in range(config.num_layers) for p in ("k_proj", "v_proj"))}
        n_ctx = len(config.target_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(n_ctx, config.hidden_size, bias=False)
        self.ctx_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        # reduced draft vocabulary: the target ids the drafter may propose, [draft_vocab_size] int64
        self.register_buffer("draft_ids", torch.zeros(config.draft_vocab_size, dtype=torch.long)
                             if config.draft_vocab_size else None)
        self.__dict__["embed_tokens"] = None  # borrowed from the target, not parameters
        self.__dict__["lm_head"] = None
        self.__dict__["draft_head"] = None    # the LM-head rows of `draft_ids`, made by `bind`

    # -- the target's parts -------------------------------------------------------------
    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "BlockDiffusionDrafter":
        """Borrow the target's input embedding and LM head (kept out of this module's state)."""
        weight = embed_tokens.weight
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise DrafterPairingError(
                f"embed_tokens has shape {tuple(weight.shape)}, drafter expects "
                f"(vocab_size={self.config.vocab_size}, hidden_size={self.config.hidden_size})")
        expected = self.config.embed_signature
        if expected:
            got = embedding_signature(weight)
            if not torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=0.02, atol=1e-3):
                raise DrafterPairingError(
                    "embed_tokens differ from those the drafter was trained with (embed_signature "
                    f"{[round(x, 4) for x in got]} != {[round(x, 4) for x in expected]}): wrong target weights?")
        self.__dict__["embed_tokens"] = embed_tokens
        self.__dict__["lm_head"] = lm_head
        self.__dict__["draft_head"] = None if self.draft_ids is None else _rows_of(lm_head, self.draft_ids)
        return self

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Restrict proposals to the target ids `ids` [draft_vocab_size] (sorted, distinct); rebinds."""
        ids = ids.to(torch.long).flatten()
        if len(ids) != self.config.draft_vocab_size or len(ids.unique()) != len(ids):
            raise ValueError(f"draft ids must be {self.config.draft_vocab_size} distinct target ids, got {len(ids)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft ids must lie in 0..{self.config.vocab_size - 1}")
        self.draft_ids.copy_(ids.to(self.draft_ids.device))
        if self.lm_head is not None:
            self.__dict__["draft_head"] = _rows_of(self.lm_head, self.draft_ids)

    def _require_bound(self):
        if self.embed_tokens is None or self.lm_head is None:
            raise RuntimeError("drafter is not bound: call drafter.bind(target_embed_tokens, target_lm_head)")

    def embed_block(self, tokens: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """tokens [B, Q] int64, masked [B, Q] bool -> [B, Q, H]: token embeddings, MASK where masked."""
        self._require_bound()
        emb = self.embed_tokens(tokens.clamp(min=0)).to(self.mask_embedding.dtype)  # [B, Q, H]
        return torch.where(masked[..., None], self.mask_embedding, emb)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Q, H] -> logits over the draft vocabulary, [B, Q, V_draft] (V_draft = V
        without a reduced vocabulary): the final norm, then the target's LM head (its `draft_ids` rows)."""
        self._require_bound()
        h = self.norm(hidden)
        head = self.lm_head if self.draft_head is None else self.draft_head
        return head(h.to(head.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, Q, H] -> [B, Q, V] over the whole target vocabulary. With a reduced draft
        vocabulary the ids outside it get −inf, so q is exactly zero there: verification against
        the target's full distribution stays exact (q is the distribution actually drafted from)."""
        return expand_to_vocab(self.draft_logits(hidden), self.draft_ids, self.config.vocab_size, float("-inf"))

    # -- the network ------------------------------------------------------------------
    def rope(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None):
        """cos and signed sin (`workers.layers.rope_cos_signed_sin`), each [B, T, d], for positions
        [B, T]. With `bound` (a host-known promise: every position < bound) they are looked up in
        a table built once per dtype and device (grown when a larger bound comes); without it they
        are computed (training). The same values either way."""
        cfg = self.config
        if bound is None:
            cs = rope_cos_signed_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)  # [B, T, 2, d]
        else:
            table = self.__dict__.get("_rope_table")
            if table is None or table.dtype != dtype or table.device != positions.device or table.shape[0] < bound:
                size = max(bound, 2 * (0 if table is None else table.shape[0]))
                pos = torch.arange(size, device=positions.device)
                table = rope_cos_signed_sin(pos, cfg.head_dim, cfg.rope_theta, dtype)  # [size, 2, d]
                self.__dict__["_rope_table"] = table
            cs = table[positions]
        return cs[..., 0, :], cs[..., 1, :]

    def context_kv(self, hidden: torch.Tensor, positions: torch.Tensor,
                   bound: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """hidden [B, T, n * H_t] (target layers concatenated), positions [B, T] ->
        per drafter layer (k, v), each [B, kv_heads, T, head_dim], RoPE applied. `bound`: as in
        `rope`."""
        ctx = self.ctx_norm(self.fc(hidden.to(self.fc.weight.dtype)))  # [B, T, H]
        cos, sin = self.rope(positions, ctx.dtype, bound)
        ctx_kv = self.fused("ctx_kv")
        if ctx_kv is None:
            return [layer.project_kv(ctx, cos, sin) for layer in self.layers]
        # k0, v0, k1, v1, ...: one norm (each layer's k_norm weight) and one RoPE for all layers' keys
        cfg, n = self.config, len(self.layers)
        B, T, _ = ctx.shape
        kv = ctx_kv(ctx).view(B, T, n, 2, cfg.num_kv_heads, cfg.head_dim)
        weight = torch.stack([layer.k_norm.weight for layer in self.layers])[:, None]  # [n, 1, d]
        k = rotate_signed(self.layers[0].k_norm.norm(kv[:, :, :, 0], weight),
                          cos[:, :, None, None], sin[:, :, None, None])  # [B, T, n, kv, d]
        return [(k[:, :, i].transpose(1, 2), kv[:, :, i, 1].transpose(1, 2)) for i in range(n)]

    def forward_block(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                      ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_mask: torch.Tensor | None,
                      block_mask: torch.Tensor | None = None, *, rope=None,
                      block_in_ctx: bool = False) -> torch.Tensor:
        """block_embeds [B, Q, H], positions [B, Q], ctx_kv per layer [B, kv, C, d],
        ctx_mask [B, Q, C] bool (True = may attend). `block_mask` [B, Q, Q] bool restricts
        attention inside the queries (training packs many blocks in one row); default: every
        query sees the whole block (non-causal). Returns hidden [B, Q, H].

        Decoding (the engine) may pass `rope` = `self.rope(positions, ...)` computed once for all
        denoising passes, and `block_in_ctx=True` with ctx_kv [B, kv, C + Q, d] cache views whose
        last Q columns take the block's keys / values (`DrafterLayer.forward`); ctx_mask is then
        the whole mask, [B, Q or 1, C + Q] (bool or additive), or None to attend to everything."""
        B, Q, _ = block_embeds.shape
        if block_in_ctx:
            mask = ctx_mask
        else:
            if block_mask is None:
                block_mask = torch.ones(B, Q, Q, dtype=torch.bool, device=block_embeds.device)
            mask = torch.cat((ctx_mask, block_mask), dim=-1)  # [B, Q, C + Q]
        x = block_embeds.to(self.mask_embedding.dtype)
        cos, sin = rope if rope is not None else self.rope(positions, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask, block_in_ctx)
        return x

    def block_logits(self, tokens: torch.Tensor, masked: torch.Tensor, ctx_kv, mask: torch.Tensor | None,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One denoising pass as the engine runs it: tokens / masked [B, K + 1] (the anchor first),
        ctx_kv per layer [B, kv, C + K + 1, d] cache views whose last K + 1 columns take the block's
        keys / values, mask [B, 1, C + K + 1] additive or None (attend to all), cos / signed sin
        [B, K + 1, d] (`rope`). Returns the logits [B, K, Vd] (float32) of the K drafted positions
        over the draft vocabulary (`draft_logits`; its target ids are `draft_ids`, or all of them)."""
        hidden = self.forward_block(self.embed_block(tokens, masked), None, ctx_kv, mask, rope=(cos, sin),
                                    block_in_ctx=True)
        return self.draft_logits(hidden[:, 1:]).float()

    # -- drafting -----------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, anchor: torch.Tensor, start: torch.Tensor, ctx_kv, ctx_mask_ctx: torch.Tensor,
              steps: int | torch.Tensor = 1, left_to_right: bool | torch.Tensor = False,
              temperature: float | torch.Tensor = 0.0, uniforms: torch.Tensor | None = None,
              generator: torch.Generator | None = None, block_size: int | None = None):
        """Denoise one block per row in `steps` passes over a context given as tensors (training
        and evaluation; the engine drafts from its cache, `workers.drafting.DrafterContext`). Both
        run the one denoising loop, `workers.drafting.denoise`.

        anchor [B] int64 (token at position `start`), start [B] int64 (= L), ctx_kv per layer
        [B, kv, C, d], ctx_mask_ctx [B, C] bool (context positions < L that exist).
        `steps` (int or [B] int64): denoising passes per row (rows with s = 0 commit nothing and
        return q = 0); `left_to_right` (bool or [B] bool): commit order; `temperature` (float or
        [B]; 0 = argmax). uniforms [B, max(steps), K] U(0, 1), one per (pass, position), for
        sampled rows (drawn from `generator` if None and a row samples).
        Returns tokens [B, K] int64 and q [B, K, V] float32, the distribution each token was
        drawn from (`workers.sampling.probabilities`: softmax(logits / T); plain softmax at T = 0).
        """
        from workers.drafting import denoise

        K = block_size or self.config.block_size
        B, dev = anchor.shape[0], anchor.device
        positions = start[:, None] + torch.arange(K + 1, device=dev)  # [B, K + 1]
        ctx_mask = ctx_mask_ctx[:, None, :].expand(B, K + 1, -1)       # [B, K + 1, C]
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(B).contiguous()
        l2r = torch.as_tensor(left_to_right, dtype=torch.bool, device=dev).expand(B).contiguous()
        s_host = [steps] * B if isinstance(steps, int) else [int(s) for s in steps.tolist()]  # one host read
        passes = max(s_host, default=0)
        if passes == 0:  # no row drafts
            return torch.zeros(B, K, dtype=torch.long, device=dev), torch.zeros(B, K, self.config.vocab_size, device=dev)
        if uniforms is None and bool((temp > 0).any()):
            uniforms = torch.rand(B, passes, K, generator=generator).to(dev)

        def one_pass(tokens, masked):
            hidden = self.forward_block(self.embed_block(tokens, masked), positions, ctx_kv, ctx_mask)
            return self.draft_logits(hidden[:, 1:]).float()            # [B, K, Vd]

        tokens, q = denoise(one_pass, anchor, s_host, K, temp, None, None, l2r, uniforms, self.draft_ids)
        return tokens, expand_to_vocab(q, self.draft_ids, self.config.vocab_size)

    # -- files --------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write `config.json` and `model.safetensors` (the drafter's own weights only)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in self.state_dict().items()}  # integer buffers (draft_ids) keep their type
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "model_type": MODEL_TYPE})
        (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")


def expand_to_vocab(x: torch.Tensor, vocab_ids: torch.Tensor | None, vocab: int,
                    fill: float = 0.0) -> torch.Tensor:
    """x [..., Vd] over the draft vocabulary -> [..., vocab] over the target's, `fill` outside
    `vocab_ids` [Vd] (0 for a distribution q, −inf for logits); `x` itself when `vocab_ids` is None."""
    if vocab_ids is None:
        return x
    return x.new_full((*x.shape[:-1], vocab), fill).index_copy_(-1, vocab_ids, x)


def _rows_of(lm_head: nn.Module, ids: torch.Tensor) -> nn.Linear:
    """A frozen linear made of the LM head's rows `ids` (derived, never saved); shape-aware on CPU
    when the head is (workers/linear.py)."""
    from workers.linear import ShapeAwareLinear

    weight = lm_head.weight.detach()[ids.to(lm_head.weight.device)]  # [V_draft, H]
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight, requires_grad=False)
    if isinstance(lm_head, ShapeAwareLinear):
        return ShapeAwareLinear.from_linear(head, lm_head.threshold, lm_head.wide_rows)
    return head


def embedding_signature(weight: torch.Tensor) -> list[float]:
    """Norms of embedding rows 0..7: a cheap check that the bound embedding is the trained-with one."""
    return [float(x) for x in weight[:8].detach().float().norm(dim=-1).cpu()]


def init_drafter(target_config, embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None,
                 seed: int = 0, draft_ids: torch.Tensor | None = None, **config_kwargs) -> BlockDiffusionDrafter:
    """A randomly initialised drafter sized for `target_config`; bound if embed/lm_head given.
    `draft_ids` [V_draft]: a reduced draft vocabulary (target ids the drafter may propose)."""
    cfg = DrafterConfig.for_target(target_config, **config_kwargs)
    if embed_tokens is not None:
        cfg.embed_signature = embedding_signature(embed_tokens.weight)
    if draft_ids is not None:
        cfg.draft_vocab_size = len(draft_ids)
    gen = torch.Generator().manual_seed(seed)
    drafter = BlockDiffusionDrafter(cfg)
    if draft_ids is not None:
        drafter.set_draft_vocab(draft_ids)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[1])))
            elif name == "mask_embedding":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for layer in drafter.layers:  # residual branches start small
            layer.o_proj.weight.mul_(1.0 / math.sqrt(2 * cfg.num_layers))
            layer.mlp.down_proj.weight.mul_(1.0 / math.sqrt(2 * cfg.num_layers))
    if embed_tokens is not None and lm_head is not None:
        drafter.bind(embed_tokens, lm_head)
    return drafter


def load_drafter(path: str | Path, target_config, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> BlockDiffusionDrafter:
    """Load a drafter directory and check it pairs with `target_config` (HF config or dict).

    Raises `DrafterPairingError` naming the field that differs (hidden size, vocab size,
    layer ids, fingerprint); `FileNotFoundError` / `ValueError` for a broken directory.
    A published DFlash checkpoint (`"architectures": ["DFlashDraftModel"]`) loads through
    `workers.dflash_format.load_dflash`.
    """
    from safetensors.torch import load_file

    from workers.dflash_format import is_dflash_dir, load_dflash

    path = Path(path)
    if is_dflash_dir(path):  # a published DFlash checkpoint (workers/dflash_format.py)
        return load_dflash(path, target_config, device, dtype)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise FileNotFoundError(f"drafter directory {path} has no {f.name}")
    data = json.loads(cfg_file.read_text())
    if data.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{cfg_file}: model_type is {data.get('model_type')!r}, expected {MODEL_TYPE!r}")
    cfg = DrafterConfig.from_dict(data)
    checks = [
        ("hidden_size", cfg.hidden_size, _field(target_config, "hidden_size")),
        ("vocab_size", cfg.vocab_size, _field(target_config, "vocab_size")),
        ("target_hidden_size", cfg.target_hidden_size, _field(target_config, "hidden_size")),
    ]
    for name, mine, theirs in checks:
        if mine != theirs:
            raise DrafterPairingError(f"drafter {name} = {mine} but the target has {theirs}")
    n_layers = _field(target_config, "num_hidden_layers")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < n_layers]
    if bad:
        raise DrafterPairingError(f"drafter target_layer_ids {bad} do not exist in a target with {n_layers} layers")
    fp = target_fingerprint(target_config)
    if cfg.target_fingerprint and cfg.target_fingerprint != fp:
        raise DrafterPairingError(
            f"drafter target_fingerprint {cfg.target_fingerprint} != this target's {fp}: "
            "the drafter was trained for a different target architecture")
    drafter = BlockDiffusionDrafter(cfg)
    state = load_file(str(weights))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{weights}: missing weights {missing}, unexpected weights {unexpected}")
    return drafter.to(device=device, dtype=dtype) if dtype else drafter.to(device)


def context_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """HF `output_hidden_states` tuple (index i + 1 = output of decoder layer i) ->
    the drafter's context input [B, T, len(layer_ids) * H]."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
