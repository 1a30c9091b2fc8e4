"""Published DFlash drafters (z-lab/dflash's `DFlashDraftModel` layout) as our drafter.

A DFlash checkpoint directory holds `config.json` (a Qwen3-style layer config with
`"architectures": ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and `dflash_config`
{`mask_token_id`, `target_layer_ids`, sometimes `block_size`}), safetensors weights and sometimes
`mask_embedding.pt`. Its network is ours (`workers.drafter.BlockDiffusionDrafter`) under other
names and two conventions:

- **block size**: DFlash counts the anchor (`block_size` 16 drafts 15 tokens); our `block_size` is
  the number of drafted tokens K, so K = DFlash `block_size` − 1.
- **mask slot**: DFlash embeds a masked position as the target's embedding of `mask_token_id`
  (vLLM and SGLang do the same), or as the vector in `mask_embedding.pt` when one is shipped; ours
  is the `mask_embedding` vector. `DFlashDrafter` fills that vector from the target's embedding
  when it is bound (or from `mask_embedding.pt` when it is loaded), so drafts are the same.

Everything else maps name for name: `fc` → `fc`, `hidden_norm` → `ctx_norm` (the context norm after
`fc`), `layers.i.input_layernorm` / `post_attention_layernorm` → `layers.i.input_norm` /
`post_norm`, `layers.i.self_attn.{q,k,v,o}_proj`, `{q,k}_norm` → `layers.i.*`,
`layers.i.mlp.{gate,up,down}_proj` → `layers.i.mlp.*`, `norm` → `norm`. `target_layer_ids` index
decoder-layer outputs in both (HF `hidden_states[i + 1]`). Context keys get each layer's k_proj,
k_norm and RoPE at their absolute positions in both; the block attends non-causally.

A reduced draft vocabulary (`draft_vocab_size` + `d2t`, target id = draft id + d2t[draft id])
maps onto our `draft_ids` when our drafter has them (`supports_draft_vocab`); the logits are then
the target's LM-head rows of those ids, so a checkpoint with an LM head of its own is refused.
What a checkpoint asks for beyond that (sliding-window or causal layers, attention sinks, logit
soft-capping or scaling, its own embedding / LM head, DFlash2, projector variants, quantized
weights, scaled RoPE, biases) is refused with a `DFlashFormatError` naming the field, and so is
any config field this module does not know.

    from workers.dflash_format import is_dflash_dir, load_dflash, save_dflash
    drafter = load_dflash(dir, target_config)            # `load_drafter` calls this for DFlash dirs
    save_dflash(drafter, target_config, out, mask_token_id)   # ours -> the published layout
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from torch import nn

from workers.drafter import (
    MAX_BLOCK_SIZE,
    BlockDiffusionDrafter,
    DrafterConfig,
    DrafterPairingError,
    _field,
    target_rope_theta,
)

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"

# DFlash weight name (per layer: after "layers.{i}.") -> ours
_TOP_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "ctx_norm.weight", "norm.weight": "norm.weight"}
_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight",
    "post_attention_layernorm.weight": "post_norm.weight",
    **{f"self_attn.{p}.weight": f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")

# config.json fields read below (each checked), and fields that do not change the network
_CHECKED = {
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "block_size", "num_target_layers",
    "target_hidden_size", "dflash_config", "target_layer_ids", "mask_token_id", "hidden_act",
    "attention_bias", "mlp_bias", "layer_types", "use_sliding_window", "sliding_window", "max_window_layers",
    "draft_vocab_size",
}
_INERT = {
    "_name_or_path", "auto_map", "transformers_version", "torch_dtype", "dtype", "attention_dropout",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "max_position_embeddings",
    "tie_word_embeddings", "use_cache", "pretraining_tp", "chunk_size_feed_forward", "id2label",
    "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type",
    "return_dict",
}
# fields that name an unimplemented feature unless they hold the neutral value
_NEUTRAL = {
    "logit_scale": 1.0, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "input_embedding_scale": 1.0, "quantization_config": None, "has_embed_tokens": False, "has_lm_head": False,
    "eagle_config": None,
}
_DFLASH_KNOWN = {"mask_token_id", "target_layer_ids", "block_size", "num_target_layers", "mask_token"}
_DFLASH_NEUTRAL = {
    "use_aux_hidden_state": True, "causal": False, "use_swa": False, "attention_sink_bias": False,
    "output_multiplier": 1.0, "final_logit_softcapping": None, "conv_kernel_size": 0, "conv_group_size": 0,
    "selector_rank": 0, "selector_top_k": 0, "projector_type": None, "sample_from_anchor": True,
    "attention_value_scale": None,
}


class DFlashFormatError(ValueError):
    """The DFlash checkpoint uses a field or weight this drafter does not implement."""


def _neutral(value, neutral) -> bool:
    if neutral is None or neutral is False or neutral == 0:
        return not value
    return value is None or value == neutral


def read_config(path: str | Path) -> dict | None:
    """config.json of `path` if it is a DFlash checkpoint (architectures name DFlash), else None."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return None
    data = json.loads(cfg_file.read_text())
    archs = data.get("architectures") or []
    return data if any("DFlash" in str(a) for a in archs) else None


def is_dflash_dir(path: str | Path) -> bool:
    return read_config(path) is not None


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps when a checkpoint names none: one per draft layer, spread evenly from
    layer 1 to layer n − 3 (the middle layer for a one-layer drafter)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _check_attention_layers(data: dict, n_layers: int) -> None:
    """Every layer must be full (non-sliding) attention, by Qwen3Config's rule: explicit
    `layer_types`, else sliding from `max_window_layers` on when `use_sliding_window` is set."""
    types = data.get("layer_types")
    if types is not None:
        other = sorted({t for t in types if t != "full_attention"})
        if other or len(types) != n_layers:
            raise DFlashFormatError(f"layer_types {types}: only full_attention layers (one per layer) are implemented")
        return
    if data.get("use_sliding_window") and data.get("sliding_window") is not None:
        if n_layers > int(data.get("max_window_layers", 28)):
            raise DFlashFormatError("use_sliding_window: sliding-window draft layers are not implemented")


def _rope(data: dict) -> float:
    params = data.get("rope_parameters") or {}
    scaling = data.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise DFlashFormatError("rope_parameters / rope_scaling must be objects")
    extra = set(params) - {"rope_theta", "rope_type", "partial_rotary_factor"}
    if extra:
        raise DFlashFormatError(f"rope_parameters {sorted(extra)}: only plain RoPE (rope_type default) is implemented")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default" or (scaling and set(scaling) - {"rope_type", "type"}):
        raise DFlashFormatError(f"rope_scaling / rope_type {rope_type!r}: only plain RoPE (default) is implemented")
    partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise DFlashFormatError(f"partial_rotary_factor {partial}: only full-width RoPE is implemented")
    if params.get("rope_theta") is None and data.get("rope_theta") is None:
        raise DFlashFormatError("rope_theta: the checkpoint names no RoPE base")
    return target_rope_theta(data)


def parse_config(data: dict, target_config) -> tuple[DrafterConfig, int | None]:
    """DFlash config.json -> (our DrafterConfig, mask_token_id). Raises `DFlashFormatError` naming
    an unimplemented field, `DrafterPairingError` when the target does not match."""
    archs = data.get("architectures") or []
    if list(archs) != [ARCHITECTURE]:
        raise DFlashFormatError(f"architectures {archs}: only {ARCHITECTURE!r} is implemented "
                                "(DFlash2 and others are not)")
    dflash = data.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise DFlashFormatError("dflash_config must be an object")
    for key, value in dflash.items():
        if key in _DFLASH_NEUTRAL:
            if not _neutral(value, _DFLASH_NEUTRAL[key]):
                raise DFlashFormatError(f"dflash_config.{key} = {value!r} is not implemented")
        elif key == "swa_window_size" and not dflash.get("use_swa"):
            continue
        elif key not in _DFLASH_KNOWN:
            raise DFlashFormatError(f"dflash_config.{key}: unknown DFlash field (not implemented)")
    try:
        from transformers import PretrainedConfig

        base = set(PretrainedConfig().to_dict())
    except ImportError:  # pragma: no cover - transformers is a dependency
        base = set()
    for key, value in data.items():
        if key in _NEUTRAL:
            if not _neutral(value, _NEUTRAL[key]):
                raise DFlashFormatError(f"{key} = {value!r} is not implemented")
        elif key not in _CHECKED and key not in _INERT and key not in base:
            raise DFlashFormatError(f"{key}: unknown config field (not implemented)")
    if data.get("hidden_act", "silu") not in ("silu", "swish"):
        raise DFlashFormatError(f"hidden_act {data['hidden_act']!r}: only silu (SwiGLU) is implemented")
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            raise DFlashFormatError(f"{key}: biases are not implemented")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(data.get(key), int):
            raise DFlashFormatError(f"{key}: missing or not an integer")
    n_draft = data["num_hidden_layers"]
    _check_attention_layers(data, n_draft)
    rope_theta = _rope(data)

    hidden, heads = data["hidden_size"], data["num_attention_heads"]
    t_hidden, t_vocab = _field(target_config, "hidden_size"), _field(target_config, "vocab_size")
    t_layers = _field(target_config, "num_hidden_layers")
    n_target = dflash.get("num_target_layers", data.get("num_target_layers"))
    vocab = data.get("vocab_size", t_vocab)
    for name, mine, theirs in (("hidden_size", hidden, t_hidden), ("vocab_size", vocab, t_vocab),
                               ("target_hidden_size", data.get("target_hidden_size", hidden), t_hidden),
                               ("num_target_layers", n_target if n_target is not None else t_layers, t_layers)):
        if mine != theirs:
            raise DrafterPairingError(f"DFlash drafter {name} = {mine} but the target has {theirs}")
    ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
    ids = build_target_layer_ids(t_layers, n_draft) if ids is None else [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < t_layers]
    if bad or not ids:
        raise DrafterPairingError(f"DFlash target_layer_ids {ids} do not fit a target with {t_layers} layers")
    block = dflash.get("block_size", data.get("block_size"))
    if not isinstance(block, int) or not 2 <= block <= MAX_BLOCK_SIZE + 1:
        raise DFlashFormatError(f"block_size {block!r}: DFlash counts the anchor, so 2..{MAX_BLOCK_SIZE + 1} "
                                f"(1..{MAX_BLOCK_SIZE} drafted tokens) is implemented")
    draft_vocab = data.get("draft_vocab_size")
    reduced = {}
    if draft_vocab not in (None, t_vocab):
        if not supports_draft_vocab():
            raise DFlashFormatError(f"draft_vocab_size = {draft_vocab} (a reduced draft vocabulary, d2t) "
                                    "is not implemented")
        if not isinstance(draft_vocab, int) or not 0 < draft_vocab < t_vocab:
            raise DFlashFormatError(f"draft_vocab_size {draft_vocab!r} must lie in 1..vocab_size ({t_vocab})")
        reduced = {"draft_vocab_size": draft_vocab}
    mask_id = dflash.get("mask_token_id", data.get("mask_token_id"))
    if mask_id is not None and (type(mask_id) is not int or not 0 <= mask_id < t_vocab):
        raise DFlashFormatError(f"mask_token_id {mask_id!r} is not a token id of the target's vocabulary ({t_vocab})")
    cfg = DrafterConfig(
        hidden_size=hidden, vocab_size=t_vocab, target_layer_ids=ids, target_hidden_size=t_hidden,
        num_layers=n_draft, num_heads=heads, num_kv_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim") or hidden // heads, intermediate_size=data["intermediate_size"],
        block_size=block - 1, rope_theta=rope_theta, rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)), **reduced,
    )
    return cfg, mask_id


def supports_draft_vocab() -> bool:
    """Whether our drafter has a reduced draft vocabulary (`DrafterConfig.draft_vocab_size`,
    `draft_ids`), onto which DFlash's `d2t` maps."""
    return any(f.name == "draft_vocab_size" for f in dataclasses.fields(DrafterConfig))


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file()
             else sorted(path.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"DFlash drafter directory {path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def map_weights(state: dict[str, torch.Tensor], num_layers: int) -> tuple[dict[str, torch.Tensor], dict]:
    """DFlash weight names -> ours, and the reduced-vocabulary maps (`d2t`, `t2d`) apart. Raises
    `DFlashFormatError` naming weights that have no place."""
    out, vocab_maps, unknown = {}, {}, []
    for name, tensor in state.items():
        key = name[len("model."):] if name.startswith("model.") else name
        m = _LAYER_RE.fullmatch(key)
        if key in ("d2t", "t2d") and supports_draft_vocab():
            vocab_maps[key] = tensor
        elif key in _TOP_NAMES:
            out[_TOP_NAMES[key]] = tensor
        elif m and int(m.group(1)) < num_layers and m.group(2) in _LAYER_NAMES:
            out[f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"] = tensor
        else:
            unknown.append(name)
    if unknown:
        why = ""
        if any(n.split(".")[-1] in ("d2t", "t2d") for n in unknown):
            why = " (d2t / t2d: a reduced draft vocabulary is not implemented)"
        elif any("embed_tokens" in n or "lm_head" in n for n in unknown):
            why = " (an embedding or LM head of the drafter's own: ours shares the target's)"
        raise DFlashFormatError(f"DFlash weights not implemented{why}: {sorted(unknown)[:8]}")
    return out, vocab_maps


def _draft_ids(cfg: DrafterConfig, vocab_maps: dict) -> torch.Tensor | None:
    """DFlash's d2t (EAGLE-3's convention: target id = draft id + d2t[draft id]) -> our `draft_ids`."""
    n = getattr(cfg, "draft_vocab_size", 0)
    d2t = vocab_maps.get("d2t")
    if not n:
        if d2t is not None:
            raise DFlashFormatError("d2t: the checkpoint maps a reduced vocabulary but its draft_vocab_size "
                                    "is the whole one")
        return None
    if d2t is None or d2t.numel() != n:
        raise DFlashFormatError(f"d2t: draft_vocab_size = {n} needs a d2t of {n} entries, got "
                                f"{None if d2t is None else d2t.numel()}")
    ids = torch.arange(n) + d2t.reshape(-1).long()
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(ids.unique()) != n:
        raise DFlashFormatError(f"d2t does not map {n} draft ids to distinct target ids in 0..{cfg.vocab_size - 1}")
    t2d = vocab_maps.get("t2d")
    marked = None if t2d is None else t2d.reshape(-1).nonzero().flatten()
    if t2d is not None and (t2d.numel() != cfg.vocab_size or not torch.equal(marked, ids.sort().values)):
        raise DFlashFormatError("t2d does not mark the target ids of d2t")
    return ids


def _dflash_names(num_layers: int) -> dict[str, str]:
    """Our weight name -> DFlash's."""
    names = {ours: theirs for theirs, ours in _TOP_NAMES.items()}
    names.update({f"layers.{i}.{ours}": f"layers.{i}.{theirs}" for i in range(num_layers)
                  for theirs, ours in _LAYER_NAMES.items()})
    return names


def _read_mask_embedding(path: Path, mask_id: int | None, hidden: int) -> torch.Tensor | None:
    f = path / MASK_EMBEDDING_FILE
    if not f.is_file():
        return None
    data = torch.load(str(f), map_location="cpu", weights_only=True)
    if isinstance(data, dict):
        if data.get("mask_token_id", mask_id) != mask_id:
            raise DFlashFormatError(f"{MASK_EMBEDDING_FILE}: mask_token_id {data.get('mask_token_id')} != "
                                    f"dflash_config.mask_token_id {mask_id}")
        data = data["embedding"]
    vec = data.reshape(-1)
    if vec.numel() != hidden:
        raise DFlashFormatError(f"{MASK_EMBEDDING_FILE}: {vec.numel()} values, expected hidden_size {hidden}")
    return vec


class DFlashDrafter(BlockDiffusionDrafter):
    """A drafter loaded from a DFlash checkpoint. Unless the checkpoint shipped `mask_embedding.pt`,
    its mask vector is the bound target's embedding of `mask_token_id`, filled in by `bind`."""

    def __init__(self, config: DrafterConfig, mask_token_id: int | None, mask_from_target: bool):
        super().__init__(config)
        self.mask_token_id = mask_token_id
        self.mask_from_target = mask_from_target
        self.mask_ready = not mask_from_target
        self.source_dtype = torch.float32  # dtype of the checkpoint's weights (set by load_dflash)

    def fill_mask(self, embed_tokens: nn.Module) -> None:
        """mask_embedding = embed_tokens(mask_token_id), in this drafter's dtype."""
        weight = embed_tokens.weight
        ids = torch.tensor([self.mask_token_id], device=weight.device)
        with torch.no_grad():
            self.mask_embedding.copy_(embed_tokens(ids)[0].to(self.mask_embedding))
        self.mask_ready = True

    def bind(self, embed_tokens: nn.Module, lm_head: nn.Module) -> "DFlashDrafter":
        super().bind(embed_tokens, lm_head)
        if self.mask_from_target:
            self.fill_mask(embed_tokens)
        return self

    def save_pretrained(self, out_dir, dtype=None) -> None:
        """Our format (the mask vector included): needs the mask filled (`bind` or `fill_mask`)."""
        if not self.mask_ready:
            raise RuntimeError("the mask embedding comes from the target: bind() or fill_mask() before saving")
        super().save_pretrained(out_dir, dtype)


def load_dflash(path: str | Path, target_config, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a DFlash checkpoint directory for `target_config` (HF config or dict); see the module
    docstring. Call `bind(target_embed, target_lm_head)` before drafting, as for any drafter."""
    path = Path(path)
    data = read_config(path)
    if data is None:
        raise DFlashFormatError(f"{path}: config.json does not name a DFlash architecture")
    cfg, mask_id = parse_config(data, target_config)
    mask = _read_mask_embedding(path, mask_id, cfg.hidden_size)
    if mask is None and mask_id is None:
        raise DFlashFormatError("mask_token_id: dflash_config names no mask token and there is no mask_embedding.pt")
    drafter = DFlashDrafter(cfg, mask_id, mask_from_target=mask is None)
    state, vocab_maps = map_weights(_read_weights(path), cfg.num_layers)
    drafter.source_dtype = state["fc.weight"].dtype
    draft_ids = _draft_ids(cfg, vocab_maps)
    if draft_ids is not None:
        state["draft_ids"] = draft_ids
    if mask is not None:
        state["mask_embedding"] = mask
    missing = sorted(set(drafter.state_dict()) - set(state) - {"mask_embedding"})
    if missing:
        theirs = _dflash_names(cfg.num_layers)
        missing = [theirs.get(n, n) for n in missing]
        raise DFlashFormatError(f"DFlash weights missing for: {missing[:8]}")
    try:
        drafter.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise DFlashFormatError(f"DFlash weights do not fit the config: {exc}") from exc
    return drafter.to(device=device, dtype=dtype) if dtype else drafter.to(device)


def save_dflash(drafter: BlockDiffusionDrafter, target_config, out_dir: str | Path, mask_token_id: int,
                mask_embedding_file: bool = True, dtype: torch.dtype | None = None) -> Path:
    """Write `drafter` in the published DFlash layout (config.json + model.safetensors, and
    `mask_embedding.pt` holding our mask vector unless `mask_embedding_file` is False; then the
    target's embedding row of `mask_token_id` is the mask, and a bound drafter must already use it).
    Pick a `mask_token_id` that never occurs in text (engines that swap embeddings by id would
    also swap a real occurrence)."""
    from safetensors.torch import save_file

    cfg = drafter.config
    if not 0 <= mask_token_id < cfg.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary ({cfg.vocab_size})")
    if not mask_embedding_file and drafter.embed_tokens is not None:
        emb = drafter.embed_tokens(torch.tensor([mask_token_id], device=drafter.mask_embedding.device))[0]
        if not torch.equal(emb.to(drafter.mask_embedding), drafter.mask_embedding.detach()):
            raise ValueError("the drafter's mask embedding is not the target's row of mask_token_id: "
                             "keep mask_embedding_file=True")
    inverse = _dflash_names(cfg.num_layers)
    state = {}
    draft_ids = getattr(drafter, "draft_ids", None)
    if draft_ids is not None:  # EAGLE-3 / DFlash convention: target id = draft id + d2t[draft id]
        ids = draft_ids.detach().cpu().long()
        state["d2t"] = ids - torch.arange(len(ids))
        state["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    for name, tensor in drafter.state_dict().items():
        if name in ("mask_embedding", "draft_ids"):
            continue
        if name not in inverse:
            raise ValueError(f"{name}: no DFlash name (save an unprepared drafter)")
        state[inverse[name]] = (tensor.to(dtype) if dtype else tensor).detach().contiguous().cpu()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if mask_embedding_file:
        vec = drafter.mask_embedding.detach().to(dtype or drafter.mask_embedding.dtype).cpu().clone()
        torch.save({"embedding": vec, "mask_token_id": mask_token_id}, str(out / MASK_EMBEDDING_FILE))
    n_target = _field(target_config, "num_hidden_layers")
    weight_dtype = state["fc.weight"].dtype
    config = {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "block_size": cfg.block_size + 1, "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "max_position_embeddings": int(_field(target_config, "max_position_embeddings", 32768)),
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
        "layer_types": ["full_attention"] * cfg.num_layers, "tie_word_embeddings": False, "use_cache": True,
        "torch_dtype": str(weight_dtype).removeprefix("torch."),
    }
    if draft_ids is not None:
        config["draft_vocab_size"] = len(draft_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def read_target_embedding(target_dir: str | Path) -> torch.Tensor:
    """The input embedding matrix [V, H] of a Hugging Face causal-LM directory, read alone (not the
    whole model) from its safetensors."""
    from safetensors import safe_open

    path = Path(target_dir)
    index = path / "model.safetensors.index.json"
    names = ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight")
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        hits = [(n, path / weight_map[n]) for n in names if n in weight_map]
    else:
        hits = [(n, path / "model.safetensors") for n in names]
    for name, f in hits:
        if f.is_file():
            with safe_open(str(f), framework="pt") as sf:
                if name in sf.keys():
                    return sf.get_tensor(name)
    raise FileNotFoundError(f"no input embedding ({' / '.join(names)}) in the safetensors of {path}")
