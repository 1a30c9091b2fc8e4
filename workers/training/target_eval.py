"""Evaluate a target on the held-out stdlib files: perplexity, top-1, and repetition loops.

    python -m workers.training.target_eval --target models/demo/target --json

A greedy continuation "collapses into a repetition loop" when its last `LOOP_WINDOW` tokens are
periodic with some period p ≤ `MAX_PERIOD` (token i equals token i − p throughout the window).
A looping target flatters every speculation method, so the share of looping continuations is
reported next to the speculative-decoding numbers. So is the target's confidence in its own
greedy continuations (mean top-1 probability, entropy): what a drafter can hope to agree with.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from workers.training.corpus import read_texts, stdlib_files

LOOP_WINDOW = 48
MAX_PERIOD = 32


def heldout_prompts(tokenizer, num_prompts: int, prompt_len: int, seed: int = 0) -> torch.Tensor:
    """`[num_prompts, prompt_len]` windows cut at seeded offsets of the held-out files."""
    gen = torch.Generator().manual_seed(seed)
    streams = [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in read_texts(stdlib_files("heldout"))]
    streams = [s for s in streams if len(s) > prompt_len + 1]
    prompts = []
    for i in range(num_prompts):
        s = streams[i % len(streams)]
        start = int(torch.randint(0, len(s) - prompt_len, (1,), generator=gen))
        prompts.append(s[start : start + prompt_len])
    return torch.stack(prompts)


def is_loop(tokens: torch.Tensor) -> torch.Tensor:
    """tokens `[N, T]` → `[N]` bool: the last LOOP_WINDOW tokens repeat with a period ≤ MAX_PERIOD."""
    tail = tokens[:, -(LOOP_WINDOW + MAX_PERIOD) :]
    found = torch.zeros(tokens.shape[0], dtype=torch.bool)
    for p in range(1, MAX_PERIOD + 1):
        found |= (tail[:, -LOOP_WINDOW:] == tail[:, -LOOP_WINDOW - p : tail.shape[1] - p]).all(-1)
    return found


@torch.no_grad()
def evaluate_target(target_dir: str, num_prompts: int = 64, prompt_len: int = 64, new_tokens: int = 128,
                    context: int = 512) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    ids = []
    for text in read_texts(stdlib_files("heldout")):
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
    stream = torch.tensor(ids)
    n = min(64, (len(stream) - 1) // context)
    x = stream[: n * context].view(n, context)
    y = stream[1 : n * context + 1].view(n, context)
    nll, correct = 0.0, 0
    for i in range(0, n, 8):
        logits = model(input_ids=x[i : i + 8]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i : i + 8].flatten(), reduction="sum").item()
        correct += (logits.argmax(-1) == y[i : i + 8]).sum().item()
    prompts = heldout_prompts(tokenizer, num_prompts, prompt_len)
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    loops = is_loop(out[:, prompt_len:])
    confidence = own_confidence(model, out, prompt_len)
    return {
        "heldout_perplexity": math.exp(nll / y.numel()),
        "heldout_top1": correct / y.numel(),
        "heldout_tokens": y.numel(),
        "loop_share_128_greedy": loops.float().mean().item(),
        "loop_definition": f"last {LOOP_WINDOW} tokens periodic with period <= {MAX_PERIOD}",
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        **{f"own_greedy_{k}": v for k, v in confidence.items()},
        **{f"own_greedy_no_loop_{k}": v for k, v in own_confidence(model, out[~loops], prompt_len).items()},
    }


@torch.no_grad()
def own_confidence(model, sequences: torch.Tensor, prompt_len: int) -> dict:
    """How sure the target is of its own continuations, sequences `[N, P + T]` (prompt first):
    mean top-1 probability, share of positions above 0.9, and mean entropy (nats). A drafter
    can only agree with the target where the target's choice is predictable."""
    if len(sequences) == 0:
        return {"top1_prob": None, "top1_above_0_9": None, "entropy_nats": None, "rows": 0}
    logits = model(input_ids=sequences).logits[:, prompt_len - 1 : -1].float()  # [N, T, V]
    logp = torch.log_softmax(logits, -1)
    top1 = logp.max(-1).values.exp()                                            # [N, T]
    entropy = -(logp.exp() * logp).sum(-1)                                      # [N, T]
    return {"top1_prob": top1.mean().item(), "top1_above_0_9": (top1 > 0.9).float().mean().item(),
            "entropy_nats": entropy.mean().item(), "rows": len(sequences)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    result = evaluate_target(args.target, num_prompts=args.num_prompts)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
