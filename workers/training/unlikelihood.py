"""Fine-tune a target against repetition loops: sequence-level unlikelihood (Welleck et al., 2019,
"Neural text generation with unlikelihood training").

    python -m workers.training.unlikelihood --target models/demo/target --out runs/ul --updates 200

Small language models decoded greedily fall into loops (`target_eval.is_loop`). Training longer
does not cure it (docs/training.md), this does: updates alternate between
- **unlikelihood**: the model continues training-split prompts greedily; every token that belongs
  to a 4-gram already seen in its row is a negative, and the loss is `−log(1 − p(token))` over
  the negatives, pushing down exactly the repeats it produces;
- **likelihood**: an ordinary next-token step on training text, so the model stays a language
  model.
An experiment, not part of the demo build: at the strength tried so far it cuts loops but also
the target's confidence in its own text, which a drafter needs (docs/training.md has the numbers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from workers.training.corpus import read_texts, stdlib_files
from workers.training.regenerate import continue_greedy_or_sampled, random_windows
from workers.training.target import encode_corpus

NGRAM = 4


def repeated_ngram_mask(tokens: torch.Tensor, n: int = NGRAM) -> torch.Tensor:
    """tokens `[B, L]` → `[B, L]` bool: the token is part of an n-gram that occurred earlier in its row."""
    B, L = tokens.shape
    if L < n:
        return torch.zeros(B, L, dtype=torch.bool)
    grams = tokens.unfold(1, n, 1)                                    # [B, G, n], G = L − n + 1
    same = (grams[:, :, None, :] == grams[:, None, :, :]).all(-1)     # [B, G, G]
    idx = torch.arange(grams.shape[1])
    repeat = (same & (idx[None, :] < idx[:, None])).any(-1)           # [B, G]: seen at an earlier start
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i in range(n):                                                # mark all n tokens of a repeat
        mask[:, i : L - n + 1 + i] |= repeat
    return mask


def unlikelihood_loss(model, prompts: torch.Tensor, new_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, float]:
    """Continue prompts `[B, P]` greedily, then `−log(1 − p)` over the continuation's repeated
    n-gram tokens. Returns the loss and the share of continuation tokens that were negatives."""
    P = prompts.shape[1]
    model.eval()
    seq = continue_greedy_or_sampled(model, prompts, new_tokens, torch.zeros(len(prompts)), gen)  # [B, P + T]
    model.train()
    negative = repeated_ngram_mask(seq)[:, 1:]                        # [B, P + T − 1], aligned with predictions
    negative[:, : P - 1] = False                                      # the prompt is data, not the model's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=seq[:, :-1]).logits
    p = torch.softmax(logits.float(), -1).gather(-1, seq[:, 1:, None])[..., 0]  # [B, P + T − 1]
    loss = -(torch.log((1 - p).clamp(min=1e-5)) * negative).sum() / negative.sum().clamp(min=1)
    return loss, negative[:, P - 1 :].float().mean().item()


def likelihood_loss(model, stream: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    windows = random_windows(stream, batch, context + 1, gen)       # [batch, context + 1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="target directory (its checkpoint/state.pt is used when present)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--updates", type=int, default=200, help="optimiser updates, alternating unlikelihood and likelihood")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--ul-rows", type=int, default=32, help="prompts continued per unlikelihood update")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=8, help="windows per likelihood update")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N training files (tests)")
    p.add_argument("--eval-prompts", type=int, default=64, help="target_eval afterwards (0 = skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    ckpt = args.target / "checkpoint" / "state.pt"
    if ckpt.exists():                                                 # fp32 weights of the last training step
        model.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    files = stdlib_files("train")
    if args.max_files:
        files = files[: args.max_files]
    stream = encode_corpus(tokenizer, read_texts(files)).long()
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    log = []
    for step in range(args.updates):
        model.train()
        if step % 2 == 0:
            prompts = random_windows(stream, args.ul_rows, args.prompt_len, gen)
            loss, negatives = unlikelihood_loss(model, prompts, args.new_tokens, gen)
            entry = {"step": step, "unlikelihood": round(loss.item(), 4), "negative_share": round(negatives, 4)}
        else:
            loss = likelihood_loss(model, stream, args.batch, args.context, gen)
            entry = {"step": step, "likelihood": round(loss.item(), 4)}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append(entry)
        if step % 20 < 2:
            print(json.dumps(entry), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "log": log}
    if args.eval_prompts:
        from workers.training.target_eval import evaluate_target

        report["eval"] = evaluate_target(str(args.out), num_prompts=args.eval_prompts)
        print(json.dumps(report["eval"], indent=2), flush=True)
    (args.out / "unlikelihood.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
