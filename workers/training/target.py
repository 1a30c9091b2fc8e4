"""Train the demo target from scratch: a small Llama on the Python standard library's source.

    python -m workers.training.target --out models/demo/target --steps 3000

Produces a standard Hugging Face directory (config.json, model.safetensors, tokenizer files)
that plain `transformers.AutoModelForCausalLM` / `AutoTokenizer` load. Seeded; bf16 autocast.
Checkpoints every `--save-every` steps to `OUT/checkpoint/` and resumes from there (`--resume`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from workers.training.corpus import read_texts, stdlib_files

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE over the training split, saved as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
    )
    fast.model_max_length = 1024
    fast.save_pretrained(out_dir)
    return fast


def encode_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    """All files joined by end-of-text into one flat int32 stream `[num_tokens]`."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def build_model(vocab_size: int, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.context * 2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, context: int, max_windows: int = 64) -> dict:
    """Held-out perplexity and top-1 accuracy over non-overlapping windows."""
    model.eval()
    n = min(max_windows, (len(stream) - 1) // context)
    windows = stream[: n * context + 1]
    x = windows[:-1].view(n, context).long()
    y = windows[1:].view(n, context).long()
    nll, correct, count = 0.0, 0, 0
    for i in range(0, n, 8):
        logits = model(input_ids=x[i : i + 8]).logits.float()
        nll += torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), y[i : i + 8].flatten(), reduction="sum"
        ).item()
        correct += (logits.argmax(-1) == y[i : i + 8]).sum().item()
        count += y[i : i + 8].numel()
    model.train()
    return {"perplexity": math.exp(nll / count), "top1": correct / count, "tokens": count}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N training files (tests)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    train_files = stdlib_files("train")
    if args.max_files:
        train_files = train_files[: args.max_files]
    train_texts = read_texts(train_files)
    heldout_texts = read_texts(stdlib_files("heldout"))

    from transformers import AutoTokenizer

    if args.resume and (args.out / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(args.out)
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab, args.out)
    train_stream = encode_corpus(tokenizer, train_texts)
    heldout_stream = encode_corpus(tokenizer, heldout_texts)
    print(f"train tokens {len(train_stream):,}  held-out tokens {len(heldout_stream):,}", flush=True)

    model = build_model(len(tokenizer), args)
    print(f"parameters {sum(p.numel() for p in model.parameters()):,}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))),
    )
    gen = torch.Generator().manual_seed(args.seed)
    start_step = 0
    ckpt = args.out / "checkpoint" / "state.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        start_step = state["step"]
        print(f"resumed at step {start_step}", flush=True)

    model.train()
    span = args.context + 1
    t0 = time.time()
    for step in range(start_step, args.steps):
        starts = torch.randint(0, len(train_stream) - span, (args.batch,), generator=gen)
        batch = torch.stack([train_stream[s : s + span] for s in starts.tolist()]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0:
            rate = (step + 1 - start_step) * args.batch * args.context / (time.time() - t0)
            print(f"step {step} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e} tok/s {rate:,.0f}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            ckpt.parent.mkdir(exist_ok=True)
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                 "gen": gen.get_state(), "step": step + 1},
                ckpt,
            )

    metrics = evaluate(model, heldout_stream, args.context)
    print(json.dumps(metrics), flush=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    (args.out / "train_metrics.json").write_text(json.dumps({"heldout": metrics, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))


if __name__ == "__main__":
    main()
