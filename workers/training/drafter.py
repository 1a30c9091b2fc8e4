"""Train a block-diffusion drafter for a frozen target (Llama, Qwen2, Qwen3 HF directories).

    python -m workers.training.drafter --target models/demo/target --out models/demo/drafter --regenerate
    adapt train-drafter --target DIR --data PATH... --out DIR        (same options)

One training step, in the spirit of DFlash / DSpark:
1. A batch of sequences [B, T]: windows of the data, or (`--regenerate`) prompt windows followed
   by the target's own greedy / sampled continuation (generated once, cached in OUT/checkpoint).
2. One frozen target forward gives the context features (hidden states of `target_layer_ids`)
   and the target's next-token distribution p at every position.
3. `anchors` random anchor positions per sequence; all their blocks `[anchor, MASK × K]` are
   packed into one drafter forward: block tokens attend to context positions before their anchor
   and non-causally to their own block only.
4. **Random masking ratio**: half of the blocks are fully masked (one-pass drafting, s = 1);
   the rest reveal some block positions as known tokens (a random prefix, as left-to-right
   denoising commits them, or a random subset, as most-confident-first does), so later
   denoising steps learn to use committed tokens. Loss only on masked positions.
5. Loss = Σ_k w_k · [CE(drafter, target's argmax) + λ · TV(drafter, p)] with
   w_k = exp(−(k − 1)/γ): early block positions matter most, since a rejection ends the block.

The target's embedding and LM head are shared (frozen, never copied into the drafter's file).
Checkpoints every `--save-every` steps (OUT/checkpoint/state.pt, `--resume`), tqdm progress, and at
the end an evaluation on held-out text by exact speculative decoding (τ for s = 1, 2, 4; greedy
and temperature 1) written to OUT/eval.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from workers.drafter import context_features, init_drafter
from workers.training.drafter_options import add_arguments
from workers.training.regenerate import random_windows, regenerate, resolve_data, token_stream


SUPPORTED_TARGETS = ("llama", "qwen2", "qwen3")


def load_target(path: Path, device: str = "cpu"):
    """The frozen target (eval mode, no gradients) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"--target: {path} is not a Hugging Face model directory (no config.json)")
    model_type = AutoConfig.from_pretrained(path).model_type
    if model_type not in SUPPORTED_TARGETS:
        raise ValueError(f"--target: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TARGETS)})")

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target, AutoTokenizer.from_pretrained(path)


def optimizer_and_start(drafter, lr: float, steps: int, resume_from: Path | None, gen: torch.Generator,
                        fused: bool = False):
    """AdamW (β 0.9 / 0.95, weight decay 0.01) with linear warm-up over 5 % of `steps` and cosine
    decay to 5 % of `lr`, and the step to start from: 0, or the checkpoint's when `resume_from`
    exists (model, optimiser, schedule and `gen` restored). A resumed run with another `steps`
    follows the new schedule from there."""
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01, fused=fused)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    start = 0
    if resume_from is not None and resume_from.exists():
        state = torch.load(resume_from, weights_only=True)
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        start = state["step"]
        print(f"resumed at step {start}", flush=True)
    return opt, sched, start


def update_and_log(drafter, opt, sched, loss: torch.Tensor, stats: dict, step: int, steps: int, bar, log) -> None:
    """One optimiser update (gradients clipped to norm 1), the progress bar, and every 10th step's
    stats as a JSON line of `log`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    opt.step()
    sched.step()
    stats = {"step": step + 1, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in stats.items()}}
    bar.set_postfix(loss=stats["loss"], lead=stats["lead_s1"])
    if step % 10 == 0 or step + 1 == steps:
        log.write(json.dumps(stats) + "\n")
        log.flush()


def position_weights(K: int, gamma: float) -> torch.Tensor:
    """w_k = exp(−(k − 1)/γ) for block positions k = 1..K, normalised to mean 1: [K]."""
    w = torch.exp(-torch.arange(K, dtype=torch.float32) / gamma)
    return w * K / w.sum()


def sample_anchors(B: int, T: int, n: int, lo: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct anchor positions per row in [lo, T − 1 − K]: [B, n] int64, sorted."""
    hi = T - 1 - K
    if hi < lo:
        raise ValueError(f"--seq-len {T} too short for block size {K} after {lo} prompt tokens")
    n = min(n, hi - lo + 1)
    return (torch.rand(B, hi - lo + 1, generator=gen).topk(n, dim=-1).indices + lo).sort(-1).values


def sample_known(B: int, n: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Which block positions 1..K are given as known tokens: [B, n, K] bool. Half the blocks none;
    a quarter a random prefix; a quarter a random subset, each at a random ratio."""
    mode = torch.rand(B, n, 1, generator=gen)
    ratio = torch.rand(B, n, 1, generator=gen)
    idx = torch.arange(K)
    prefix = idx < (ratio * K).floor()                         # [B, n, K]
    subset = torch.rand(B, n, K, generator=gen) < ratio
    return torch.where(mode < 0.5, torch.zeros_like(prefix), torch.where(mode < 0.75, prefix, subset))


def loss_terms(logits: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position loss terms of the drafter against the target.

    logits, target_logits: [B, n, K, V] (any float dtype). Returns the cross-entropy to the
    target's greedy token, TV(q, p) = ½ Σ |q − p| and that greedy token, each [B, n, K]."""
    p_target = torch.softmax(target_logits.float(), -1)
    labels = target_logits.argmax(-1)
    logq = torch.log_softmax(logits.float(), -1)
    ce = -logq.gather(-1, labels[..., None]).squeeze(-1)
    tv = 0.5 * (logq.exp() - p_target).abs().sum(-1)
    return ce, tv, labels


_compiled_loss_terms = None


def fused_loss_terms(logits: torch.Tensor, target_logits: torch.Tensor):
    """`loss_terms` compiled: its forward and backward fuse into a few passes over the [B, n, K, V]
    tensors (about 3x faster on CPU than eager, where these vocabulary-wide element-wise ops take
    most of a training step). Shapes are fixed within a run, so it compiles once."""
    global _compiled_loss_terms
    if _compiled_loss_terms is None:
        _compiled_loss_terms = torch.compile(loss_terms, fullgraph=True, dynamic=False)
    return _compiled_loss_terms(logits, target_logits)


def drafter_loss(drafter, target, seqs: torch.Tensor, anchors: torch.Tensor, known: torch.Tensor,
                 weights: torch.Tensor, tv_weight: float, autocast: bool, compile: bool = False) -> tuple[torch.Tensor, dict]:
    """One packed forward over all anchors: seqs [B, T], anchors [B, n], known [B, n, K]."""
    B, T = seqs.shape
    n, K = anchors.shape[1], known.shape[2]
    dev = seqs.device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            out = target(input_ids=seqs, output_hidden_states=True)
            feats = context_features(out.hidden_states, drafter.config.target_layer_ids)  # [B, T, n*H]
        offs = torch.arange(K + 1, device=dev)
        pos_blk = anchors[..., None] + offs                     # [B, n, K + 1] absolute positions
        label_pos = pos_blk[..., 1:] - 1                        # the target predicts x_{a+j} at a+j-1
        rows = torch.arange(B, device=dev)[:, None]
        t_logits = out.logits[rows, label_pos.reshape(B, -1)].view(B, n, K, -1)  # [B, n, K, V]
        tokens = seqs.gather(1, pos_blk.reshape(B, -1)).view(B, n, K + 1)     # anchor + true tokens
        masked = torch.cat((torch.zeros(B, n, 1, dtype=torch.bool, device=dev), ~known), -1)
        Q = n * (K + 1)
        ctx_mask = (torch.arange(T, device=dev)[None, None] < anchors.repeat_interleave(K + 1, 1)[..., None])  # [B, Q, T]
        block_id = torch.arange(n, device=dev).repeat_interleave(K + 1)
        block_mask = (block_id[:, None] == block_id[None]).expand(B, Q, Q)
        ctx_kv = drafter.context_kv(feats, torch.arange(T, device=dev).expand(B, T))
        embeds = drafter.embed_block(tokens.view(B, Q), masked.view(B, Q))
        hidden = drafter.forward_block(embeds, pos_blk.view(B, Q), ctx_kv, ctx_mask, block_mask)
        logits = drafter.logits(hidden.view(B, n, K + 1, -1)[:, :, 1:])     # [B, n, K, V]
    ce, tv, labels = (fused_loss_terms if compile else loss_terms)(logits, t_logits)  # [B, n, K] each
    w = weights.to(dev) * (~known).float()                                   # loss on masked positions only
    loss = ((ce + tv_weight * tv) * w).sum() / w.sum().clamp(min=1)
    with torch.no_grad():
        full = ~known.any(-1)                                                 # fully masked blocks (s = 1)
        hit = (logits.argmax(-1) == labels) & full[..., None]
        lead = hit.long().cumprod(-1).sum(-1).float()
        stats = {"ce": float((ce * w).sum() / w.sum()), "tv": float((tv * w).sum() / w.sum()),
                 "top1_pos1": float(hit[..., 0].sum() / full.sum().clamp(min=1)),
                 "lead_s1": float(lead.sum() / full.sum().clamp(min=1))}
    return loss, stats


def build_pool(args, target, tokenizer, gen: torch.Generator, ckpt_dir: Path) -> tuple[torch.Tensor, int]:
    """Training sequences [N, seq_len] and the first position anchors may take."""
    files = resolve_data(args.data, "train")
    if args.max_files:
        files = files[: args.max_files]
    stream = token_stream(tokenizer, files)
    print(f"data: {len(files)} files, {len(stream):,} tokens", flush=True)
    if not args.regenerate:
        return stream, 1
    pool_file = ckpt_dir / "regenerated.safetensors"
    from safetensors.torch import load_file, save_file

    if pool_file.exists():
        pool = load_file(str(pool_file))["tokens"]
        if pool.shape == (args.num_sequences, args.seq_len):
            print(f"regenerated pool: reusing {pool_file}", flush=True)
            return pool, args.prompt_len - 1
    t0 = time.time()
    pool = regenerate(target, stream, args.num_sequences, args.prompt_len, args.seq_len, args.sample_frac,
                      gen, batch=args.regen_batch, progress=not args.no_progress)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": pool.contiguous()}, str(pool_file))
    print(f"regenerated {pool.numel():,} tokens in {time.time() - t0:.0f}s", flush=True)
    return pool, args.prompt_len - 1


def eval_prompts(args, tokenizer, gen: torch.Generator) -> list[list[int]]:
    stream = token_stream(tokenizer, resolve_data(args.eval_data, "heldout"))
    return random_windows(stream, args.eval_prompts, args.eval_prompt_len, gen).tolist()


def train(args) -> dict:
    from tqdm import tqdm

    for name in ("steps", "batch", "anchors", "seq_len", "num_sequences", "regen_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0.0 <= args.sample_frac <= 1.0:
        raise ValueError(f"--sample-frac must be in [0, 1], got {args.sample_frac}")
    if args.regenerate and not 1 <= args.prompt_len < args.seq_len - args.block_size:
        raise ValueError(f"--prompt-len must be in [1, seq_len - block_size), got {args.prompt_len}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    # separate streams: a cached regenerated pool then gives the same run as a fresh one
    regen_gen = torch.Generator().manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    target, tokenizer = load_target(args.target)
    ckpt_dir = args.out / "checkpoint"
    ckpt = ckpt_dir / "state.pt"
    autocast = not args.fp32
    emb, head = target.get_input_embeddings(), target.get_output_embeddings()
    drafter = init_drafter(target.config, emb, head, seed=args.seed, num_layers=args.layers,
                           block_size=args.block_size, target_layer_ids=args.layer_ids,
                           intermediate_size=args.intermediate)
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()):,} parameters, "
          f"layers {drafter.config.num_layers}, target layers {drafter.config.target_layer_ids}", flush=True)
    pool, lo = build_pool(args, target, tokenizer, regen_gen, ckpt_dir)
    opt, sched, start = optimizer_and_start(drafter, args.lr, args.steps, ckpt if args.resume else None, gen)
    weights = position_weights(args.block_size, args.gamma)
    log = (args.out / "train_log.jsonl").open("a")
    drafter.train()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train-drafter", disable=args.no_progress)
    for step in bar:
        if pool.dim() == 2:
            seqs = pool[torch.randint(0, len(pool), (args.batch,), generator=gen)]
        else:
            seqs = random_windows(pool, args.batch, args.seq_len, gen)
        anchors = sample_anchors(args.batch, seqs.shape[1], args.anchors, lo, args.block_size, gen)
        known = sample_known(args.batch, anchors.shape[1], args.block_size, gen)
        loss, stats = drafter_loss(drafter, target, seqs, anchors, known, weights, args.tv_weight, autocast,
                                   compile=not args.no_compile)
        update_and_log(drafter, opt, sched, loss, stats, step, args.steps, bar, log)
        stopping = args.stop_after and step + 1 - start >= args.stop_after
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stopping:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "gen": gen.get_state(), "step": step + 1}, ckpt)
        if stopping and step + 1 < args.steps:
            print(f"stopped after step {step + 1} (--stop-after); continue with --resume", flush=True)
            return {"stopped_at": step + 1}
    drafter.eval()
    drafter.save_pretrained(args.out)
    report = {"drafter": drafter.config.to_dict(), "args": {k: str(v) for k, v in vars(args).items() if k != "run"}}
    if args.eval_prompts:
        from workers.training.spec_eval import evaluate_drafter, format_result

        prompts = eval_prompts(args, tokenizer, torch.Generator().manual_seed(args.seed + 1))
        t0 = time.time()
        report["eval"] = evaluate_drafter(target, drafter, prompts, args.eval_tokens, seed=args.seed,
                                          autocast=autocast, progress=not args.no_progress,
                                          pad_id=tokenizer.pad_token_id or 0)
        report["eval_setup"] = {"prompts": len(prompts), "prompt_len": args.eval_prompt_len,
                                "new_tokens": args.eval_tokens, "block_size": args.block_size,
                                "dtype": "bf16-autocast" if autocast else "fp32", "seconds": round(time.time() - t0, 1)}
        for r in report["eval"]:
            print(format_result(r), flush=True)
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
