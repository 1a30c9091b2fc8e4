"""Train a block-diffusion drafter from harvested features (no target forward while training).

    python -m workers.training.feature_drafter --target DIR --data runs/harvest --out DIR --steps 1200

The data are the target's own chat answers with the hidden states of the drafter's context layers
at every position (`workers.training.harvest`). One step:
1. `batch` rows; `anchors` anchor positions per row inside the answer (before its end-of-turn).
2. The drafter's context K/V come from the stored features (`context_kv`); every block
   `[anchor, MASK × K]` attends to the context before its anchor and non-causally to itself.
3. Some blocks reveal a random prefix or subset of their tokens (as later denoising steps see
   them, `workers.training.drafter.sample_known`); the loss is on masked positions only.
4. Loss = Σ_k w_k · CE(drafter, the target's token at that position), over the reduced **draft
   vocabulary** (FR-Spec / EAGLE-3 style: the `draft_vocab` most frequent answer tokens; labels
   outside it are skipped, since the drafter can never propose them), w_k = exp(−(k − 1)/γ).
   With `--soft-weight α` and a harvest that kept the target's top-k next tokens (`--top-k`), the
   loss is `(1 − α) · CE(hard) + α · CE(soft)`, where the soft label is the target's own
   distribution restricted to its top k tokens inside the draft vocabulary, renormalised
   (distillation: for sampled answers it replaces one drawn token by the law it was drawn from).

The target's embedding and LM-head rows are shared, never trained or saved. Checkpoints every
`--save-every` steps (OUT/checkpoint/state.pt), `--resume` continues, tqdm progress.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from workers.drafter import init_drafter, load_drafter
from workers.training.drafter import optimizer_and_start, position_weights, sample_known, update_and_log
from workers.training.harvest import load_shards


def draft_vocabulary(tokens: torch.Tensor, answer: torch.Tensor, end: torch.Tensor, size: int,
                     always: tuple[int, ...] = ()) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (plus `always`), sorted: [size] int64, and the share
    of answer tokens they cover."""
    cols = torch.arange(tokens.shape[1])
    inside = (cols >= answer[:, None]) & (cols < end[:, None])          # [N, T]
    counts = torch.bincount(tokens[inside].long(), minlength=int(tokens.max()) + 1).float()
    for t in always:
        counts[t] = counts.max() + 1
    ids = counts.topk(min(size, len(counts))).indices.sort().values
    return ids, float(torch.isin(tokens[inside].long(), ids).float().mean())


def coverage_of(data: dict, ids: torch.Tensor) -> float:
    """Share of answer tokens inside the draft vocabulary `ids`."""
    cols = torch.arange(data["tokens"].shape[1])
    inside = (cols >= data["answer"][:, None]) & (cols < data["end"][:, None])
    return float(torch.isin(data["tokens"][inside].long(), ids).float().mean())


def target_parts(target_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[object, nn.Embedding, nn.Linear]:
    """The target's config, input embedding and (tied or own) LM head, frozen; nothing else loaded."""
    from safetensors import safe_open
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(target_dir))
    with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight").to(dtype)
        head = emb if getattr(hf, "tie_word_embeddings", False) or "lm_head.weight" not in f.keys() \
            else f.get_tensor("lm_head.weight").to(dtype)
    embed = nn.Embedding.from_pretrained(emb, freeze=True)
    lm_head = nn.Linear(emb.shape[1], head.shape[0], bias=False)
    lm_head.weight = nn.Parameter(head, requires_grad=False)
    return hf, embed, lm_head


def sample_batch(data: dict, rows: torch.Tensor, n: int, K: int, gen: torch.Generator):
    """Anchors [B, n] (sorted, inside each row's answer) for `rows` [B]."""
    lo = data["answer"][rows]                                           # first answer column
    hi = torch.minimum(data["end"][rows] - 2, torch.full_like(lo, data["tokens"].shape[1] - 1 - K))
    span = (hi - lo + 1).clamp(min=1)
    offs = (torch.rand(len(rows), n, generator=gen) * span[:, None]).long()
    return (lo[:, None] + offs).sort(-1).values


def soft_cross_entropy(logq: torch.Tensor, soft_ids: torch.Tensor, soft_logp: torch.Tensor,
                       t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """−Σ_i p̃_i · log q(i) against the target's top-k law restricted to the draft vocabulary.

    logq [..., Vd] the drafter's log-probabilities; soft_ids [..., k] target token ids and
    soft_logp [..., k] their target log-probabilities. Returns (loss [...], usable [...]: some of
    the top k lies inside the draft vocabulary)."""
    d = t2d[soft_ids.long()]                                            # [..., k] draft ids (-1 = outside)
    inside = d >= 0
    p = soft_logp.float().exp() * inside                                # [..., k]
    mass = p.sum(-1, keepdim=True)
    p = p / mass.clamp_min(1e-9)
    lq = logq.gather(-1, d.clamp(min=0))                                # [..., k]
    return -(p * lq).sum(-1), mass.squeeze(-1) > 0


def feature_loss(drafter, data: dict, rows: torch.Tensor, anchors: torch.Tensor, known: torch.Tensor,
                 weights: torch.Tensor, t2d: torch.Tensor, autocast: bool,
                 soft_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """One packed drafter forward: rows [B], anchors [B, n], known [B, n, K]; with soft_weight > 0
    the data must carry soft labels (`soft_ids`, `soft_logp`)."""
    tokens = data["tokens"][rows].long()                                # [B, T]
    feats = data["features"][rows]                                      # [B, T, W] bf16
    B, T = tokens.shape
    n, K = anchors.shape[1], known.shape[2]
    pad, end = data["pad"][rows], data["end"][rows]
    offs = torch.arange(K + 1)
    pos_blk = anchors[..., None] + offs                                 # [B, n, K + 1]
    blk_tokens = tokens.gather(1, pos_blk.view(B, -1)).view(B, n, K + 1)
    labels = t2d[blk_tokens[..., 1:]]                                   # [B, n, K] draft ids (-1 = outside)
    valid = (labels >= 0) & (pos_blk[..., 1:] < end[:, None, None]) & ~known
    masked = torch.cat((torch.zeros(B, n, 1, dtype=torch.bool), ~known), -1)
    Q = n * (K + 1)
    cols = torch.arange(T)
    anchor_q = anchors.repeat_interleave(K + 1, 1)                      # [B, Q]
    ctx_mask = (cols[None, None] < anchor_q[..., None]) & (cols[None, None] >= pad[:, None, None])  # [B, Q, T]
    block_id = torch.arange(n).repeat_interleave(K + 1)
    block_mask = (block_id[:, None] == block_id[None]).expand(B, Q, Q)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ctx_kv = drafter.context_kv(feats, cols.expand(B, T))
        embeds = drafter.embed_block(blk_tokens.view(B, Q), masked.view(B, Q))
        hidden = drafter.forward_block(embeds, pos_blk.view(B, Q), ctx_kv, ctx_mask, block_mask)
        logits = drafter.draft_logits(hidden.view(B, n, K + 1, -1)[:, :, 1:])  # [B, n, K, Vd]
    logq = torch.log_softmax(logits.float(), -1)
    ce = -logq.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)   # [B, n, K]
    w = weights * valid.float()
    loss = (ce * w).sum() / w.sum().clamp(min=1)
    if soft_weight > 0:
        cols_blk = pos_blk[..., 1:].reshape(B, -1)                      # [B, n·K]
        k_top = data["soft_ids"].shape[-1]
        sid = data["soft_ids"][rows].gather(1, cols_blk[..., None].expand(-1, -1, k_top)).view(B, n, K, k_top)
        slp = data["soft_logp"][rows].gather(1, cols_blk[..., None].expand(-1, -1, k_top)).view(B, n, K, k_top)
        soft, usable = soft_cross_entropy(logq, sid, slp, t2d)          # [B, n, K]
        ws = weights * (usable & (pos_blk[..., 1:] < end[:, None, None]) & ~known).float()
        loss = (1.0 - soft_weight) * loss + soft_weight * (soft * ws).sum() / ws.sum().clamp(min=1)
    with torch.no_grad():
        full = ~known.any(-1)                                           # fully masked blocks (s = 1)
        in_range = pos_blk[..., 1:] < end[:, None, None]
        hit = ((logits.argmax(-1) == labels) | ~in_range) & full[..., None]
        lead = hit.long().cumprod(-1).sum(-1).float()
        stats = {"ce": float((ce * w).sum() / w.sum().clamp(min=1)),
                 "top1_pos1": float(hit[..., 0].sum() / full.sum().clamp(min=1)),
                 "lead_s1": float(lead.sum() / full.sum().clamp(min=1))}
    return loss, stats


def grow_drafter(drafter, num_layers: int, hf, embed, lm_head, seed: int = 0):
    """`drafter` with layers appended up to `num_layers`, each added layer's output projections
    (attention `o_proj`, MLP `down_proj`) zero, so that it starts as the identity on the residual
    stream: the grown drafter drafts exactly as `drafter` did, and training then uses the new
    capacity (a warm start of a deeper drafter). Its other parts are `drafter`'s."""
    import dataclasses

    cfg = drafter.config
    if num_layers <= cfg.num_layers:
        raise ValueError(f"--layers {num_layers}: a warm start can only add layers to the {cfg.num_layers} it has")
    big = init_drafter(hf, embed, lm_head, seed=seed, num_layers=num_layers,
                       draft_ids=drafter.draft_ids if cfg.draft_vocab_size else None, block_size=cfg.block_size,
                       target_layer_ids=cfg.target_layer_ids, intermediate_size=cfg.intermediate_size,
                       num_heads=cfg.num_heads)
    # the embedding signature is measured afresh from the target parts given here (a target
    # loaded in another dtype rounds it differently): compared within the pairing tolerance
    # (`BlockDiffusionDrafter.bind`), the rest of the config exactly
    if dataclasses.replace(big.config, num_layers=cfg.num_layers, embed_signature=cfg.embed_signature) != cfg:
        raise ValueError("grow_drafter: the grown drafter's config differs in more than its layer count")
    drafter.bind(embed, lm_head)  # raises DrafterPairingError where the target's embeddings are not the drafter's
    added = tuple(f"layers.{i}." for i in range(cfg.num_layers, num_layers))
    missing, unexpected = big.load_state_dict(drafter.state_dict(), strict=False)
    if unexpected or not all(k.startswith(added) for k in missing):
        raise ValueError(f"grow_drafter: unexpected {unexpected[:3]}, missing {missing[:3]}")
    with torch.no_grad():
        for layer in big.layers[cfg.num_layers:]:
            layer.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return big


def train(args) -> dict:
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    data = load_shards(args.data)
    meta = data.pop("meta")
    hf, embed, lm_head = target_parts(args.target)
    stop_ids = tuple(meta.get("stop_ids", []))
    ids, coverage = draft_vocabulary(data["tokens"], data["answer"], data["end"], args.draft_vocab or hf.vocab_size,
                                     stop_ids)
    t2d = torch.full((hf.vocab_size,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    print(f"data: {len(data['tokens'])} rows, draft vocabulary {len(ids)} covers {coverage:.1%} of answer tokens",
          flush=True)
    init = getattr(args, "init", None)
    if init is not None:  # warm start: the init drafter's shape and draft vocabulary win
        drafter = load_drafter(init, hf)
        drafter.bind(embed, lm_head)
        if drafter.config.target_layer_ids != list(meta["layers"]):
            raise ValueError(f"--init {init} reads target layers {drafter.config.target_layer_ids}, "
                             f"the harvest has {meta['layers']}")
        if drafter.config.draft_vocab_size:
            ids = drafter.draft_ids.clone()
            t2d.fill_(-1)
            t2d[ids] = torch.arange(len(ids))
            print(f"warm start from {init}: its draft vocabulary covers "
                  f"{coverage_of(data, ids):.1%} of these answer tokens", flush=True)
        if args.layers > drafter.config.num_layers:  # more capacity, the same function to start from
            drafter = grow_drafter(drafter, args.layers, hf, embed, lm_head, args.seed)
            print(f"grew the drafter to {args.layers} layers (added layers start as the identity)", flush=True)
    else:
        drafter = init_drafter(hf, embed, lm_head, seed=args.seed, num_layers=args.layers,
                               draft_ids=ids if len(ids) < hf.vocab_size else None,
                               block_size=args.block_size, target_layer_ids=meta["layers"],
                               intermediate_size=args.intermediate)
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()):,} parameters, layers {args.layers}, "
          f"target layers {meta['layers']}", flush=True)
    out = Path(args.out)
    ckpt = out / "checkpoint" / "state.pt"
    opt, sched, start = optimizer_and_start(drafter, args.lr, args.steps, ckpt if args.resume else None, gen,
                                            fused=True)
    weights = position_weights(args.block_size, args.gamma)
    soft_weight = float(getattr(args, "soft_weight", 0.0) or 0.0)
    if not 0.0 <= soft_weight <= 1.0:
        raise ValueError(f"--soft-weight: must be in [0, 1], got {soft_weight}")
    if soft_weight > 0 and "soft_ids" not in data:
        raise ValueError("--soft-weight needs harvests with soft labels (workers.training.harvest --top-k)")
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "train_log.jsonl").open("a")
    drafter.train()
    t0 = time.time()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train-drafter",
               disable=getattr(args, "no_progress", False))
    for step in bar:
        rows = torch.randint(0, len(data["tokens"]), (args.batch,), generator=gen)
        anchors = sample_batch(data, rows, args.anchors, args.block_size, gen)
        known = sample_known(args.batch, args.anchors, args.block_size, gen)
        loss, stats = feature_loss(drafter, data, rows, anchors, known, weights, t2d, not args.fp32, soft_weight)
        update_and_log(drafter, opt, sched, loss, stats, step, args.steps, bar, log)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "gen": gen.get_state(), "step": step + 1}, ckpt)
            drafter.eval()
            drafter.save_pretrained(out, dtype=torch.bfloat16)  # usable while training goes on
            drafter.train()
    report = {"drafter": drafter.config.to_dict(), "draft_vocab_coverage": round(coverage, 4),
              "train_seconds": round(time.time() - t0, 1), "data": meta,
              "args": {k: str(v) for k, v in vars(args).items()}}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="the target's HF directory (embedding, LM head, config)")
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="harvest directories (workers.training.harvest), concatenated")
    p.add_argument("--init", type=Path, default=None,
                   help="warm start from this drafter directory (its shape and draft vocabulary)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--anchors", type=int, default=8, help="blocks per row per step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--draft-vocab", type=int, default=8192, help="0 = the whole target vocabulary")
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--soft-weight", type=float, default=0.0,
                   help="share of the loss on the target's top-k soft labels (needs harvest --top-k)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
