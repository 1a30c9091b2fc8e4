"""Harvest drafter training data: the target's own answers *and* its hidden states, in one pass.

A drafter reads the hidden states of a few target layers (its **context features**) and learns to
predict the target's next tokens. For a large target, recomputing those features at every training
step costs more than the drafter itself, so this module runs the target once, as the engine does
(`workers.target_model.TargetModel`, bf16 by default, a KV cache, per-row positions), and keeps
what the drafter needs: the tokens of prompt + answer and the captured layers' outputs at every
position. Training (`workers.training.feature_drafter`) then never runs the target.

Answers are greedy for most rows and sampled at temperature 1 for a `sample_frac` share (the
exponential race, one generator per run). Generation does not stop at end-of-turn (rows are
batched); the position after the first end-of-turn token is recorded as the row's `end`, and
training anchors only before it.

Shard layout (safetensors, one file per `shard_rows` rows, so a killed run resumes at its last
shard): `tokens` [N, T] int32 (left-padded with 0), `features` [N, T, n * H] bf16 (zeros at
padding), `pad` [N] (padding columns), `answer` [N] (first answer column), `end` [N] (one past the
last useful column), `temperature` [N] float32, and with `top_k` > 0 the target's **soft labels**:
`soft_ids` [N, T, k] int32 and `soft_logp` [N, T, k] float16, the k most likely next tokens of the
target (at temperature 1) for the token in each answer column, and their log-probabilities (zeros
outside the answer). Training can distil from them instead of from the one token drawn.

    python -m workers.training.harvest --target DIR --layers 7 14 22 29 --rows 1536 --out runs/harvest
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from workers.training.chat_prompts import make_prompts


def encode_chats(tokenizer, conversations: list[list[dict]], max_prompt: int) -> list[list[int]]:
    """Chat-templated prompt ids; conversations longer than `max_prompt` tokens are dropped."""
    from workers.chat import chat_prompt_ids

    prompts = (chat_prompt_ids(tokenizer, messages) for messages in conversations)
    return [ids for ids in prompts if len(ids) <= max_prompt]


@torch.no_grad()
def generate_with_features(target, prompts: list[list[int]], answer_len: int, seq_len: int, layers: tuple[int, ...],
                           temperature: torch.Tensor, stop_ids: tuple[int, ...], gen: torch.Generator,
                           top_k: int = 0) -> dict:
    """Answer a batch of prompts (each ≤ seq_len − answer_len tokens) with the target.

    temperature [B] (0 = greedy). Returns the shard fields for these B rows (module docstring); the
    soft labels only when top_k > 0."""
    B = len(prompts)
    dev = target.model.embed_tokens.weight.device
    lens = torch.tensor([len(p) for p in prompts])
    P = int(lens.max())
    cache = target.new_cache(B, P + answer_len + 1)
    ids = torch.zeros(B, P, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
    zeros = torch.zeros(B, dtype=torch.long, device=dev)
    logits, hidden = target(ids.to(dev), zeros, cache, 0, P, capture=layers,
                            logits_index=(lens - 1)[:, None].to(dev))          # [B, 1, V], [B, P, W]
    W = hidden.shape[-1]
    answer = torch.zeros(B, answer_len, dtype=torch.long)
    feats = torch.zeros(B, answer_len, W, dtype=hidden.dtype)
    prompt_feats = hidden.cpu()
    soft_ids = torch.zeros(B, answer_len, max(top_k, 1), dtype=torch.int32)
    soft_logp = torch.zeros(B, answer_len, max(top_k, 1), dtype=torch.float16)
    start = lens.clone().to(dev)
    temp = temperature.to(dev)
    sampled = (temp > 0).nonzero().flatten()
    for i in range(answer_len + 1):
        step_logits = logits[:, -1].float()                                  # [B, V]
        nxt = step_logits.argmax(-1)
        if len(sampled):
            probs = torch.softmax(step_logits[sampled] / temp[sampled, None], -1)
            noise = torch.empty(probs.shape).exponential_(1, generator=gen).to(dev)
            nxt[sampled] = (probs / noise).argmax(-1)
        if i == answer_len:
            break
        answer[:, i] = nxt.cpu()
        if top_k:
            best = torch.log_softmax(step_logits, -1).topk(top_k, -1)               # [B, k]
            soft_ids[:, i] = best.indices.int().cpu()
            soft_logp[:, i] = best.values.half().cpu()
        logits, hidden = target(nxt[:, None], start, cache, 0, int(start.max()) + 1, capture=layers)
        feats[:, i] = hidden[:, 0].cpu()                                     # features of answer token i
        start = start + 1
    pad = seq_len - (lens + answer_len)
    tokens = torch.zeros(B, seq_len, dtype=torch.int32)
    features = torch.zeros(B, seq_len, W, dtype=torch.bfloat16)
    stop = torch.zeros(B, answer_len, dtype=torch.bool)
    for s in stop_ids:
        stop |= answer == s
    first_stop = torch.where(stop.any(1), stop.int().argmax(1), torch.full((B,), answer_len - 1))
    for r in range(B):
        a, L = int(pad[r]), int(lens[r])
        tokens[r, a : a + L] = torch.tensor(prompts[r], dtype=torch.int32)
        tokens[r, a + L :] = answer[r].int()
        features[r, a : a + L] = prompt_feats[r, :L].to(torch.bfloat16)
        features[r, a + L :] = feats[r].to(torch.bfloat16)
    shard = {"tokens": tokens, "features": features, "pad": pad, "answer": pad + lens,
             "end": pad + lens + first_stop + 1, "temperature": temperature.float()}
    if top_k:
        shard["soft_ids"] = torch.zeros(B, seq_len, top_k, dtype=torch.int32)
        shard["soft_logp"] = torch.zeros(B, seq_len, top_k, dtype=torch.float16)
        for r in range(B):
            a = int(pad[r] + lens[r])
            shard["soft_ids"][r, a:] = soft_ids[r]
            shard["soft_logp"][r, a:] = soft_logp[r]
    return shard


def harvest(args) -> dict:
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from workers.target_model import DTYPES, load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    max_prompt = args.seq_len - args.answer_len
    # draw more conversations than needed: some are longer than max_prompt
    convs = make_prompts(args.split, int(args.rows * 1.6) + 64, seed=args.seed)
    prompts = encode_chats(tokenizer, convs, max_prompt)[: args.rows]
    if len(prompts) < args.rows:
        raise ValueError(f"only {len(prompts)} prompts fit in {max_prompt} tokens, asked for {args.rows}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    gen = torch.Generator().manual_seed(args.seed)
    temps = (torch.rand(len(prompts), generator=gen) < args.sample_frac).float()
    target = load_target(args.target, DTYPES[args.dtype], "cpu")
    layers = tuple(args.layers)
    stop_ids = tuple({tokenizer.eos_token_id, *(args.stop_ids or [])} - {None})
    meta = {"target": str(args.target), "layers": list(layers), "seq_len": args.seq_len, "answer_len": args.answer_len,
            "rows": len(prompts), "sample_frac": args.sample_frac, "dtype": args.dtype, "seed": args.seed,
            "split": args.split, "stop_ids": list(stop_ids), "top_k": args.top_k, "shards": []}
    t0 = time.time()
    shard_rows = args.shard_rows
    for s, lo in enumerate(tqdm(range(0, len(order), shard_rows), desc="harvest", unit="shard")):
        path = out / f"shard_{s:03d}.safetensors"
        meta["shards"].append(path.name)
        if path.exists():
            continue
        idx = order[lo : lo + shard_rows]
        parts = [generate_with_features(target, [prompts[i] for i in idx[b : b + args.batch]], args.answer_len,
                                        args.seq_len, layers, temps[idx[b : b + args.batch]], stop_ids, gen,
                                        args.top_k)
                 for b in range(0, len(idx), args.batch)]
        shard = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
        save_file(shard, str(path))
    meta["seconds"] = round(time.time() - t0, 1)
    (out / "harvest.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_shards(directories) -> dict[str, torch.Tensor]:
    """All shards of one or more harvest directories, concatenated (features stay bf16).

    Several directories (e.g. harvests with different seeds) must share layers and seq_len; the
    returned `meta` is the first one's, with `rows` summed and `sources` listing every directory.
    Soft labels are kept only when every directory has them with the same k."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    dirs = [Path(directories)] if isinstance(directories, (str, Path)) else [Path(d) for d in directories]
    metas = [json.loads((d / "harvest.json").read_text()) for d in dirs]
    for d, m in zip(dirs[1:], metas[1:]):
        for key in ("layers", "seq_len"):
            if m[key] != metas[0][key]:
                raise ValueError(f"harvest {d}: {key} = {m[key]} but {dirs[0]} has {metas[0][key]}")
    top_ks = {m.get("top_k", 0) for m in metas}
    soft = len(top_ks) == 1 and top_ks != {0}
    # shards are copied one at a time into preallocated tensors, so the peak memory is the
    # data plus one shard (a plain torch.cat of every shard would hold the data twice)
    paths = [d / name for d, m in zip(dirs, metas) for name in m["shards"]]
    rows = 0  # every shard's row count, read from its header
    for path in paths:
        with safe_open(str(path), "pt") as f:
            rows += f.get_slice("tokens").get_shape()[0]
    data: dict[str, torch.Tensor] = {}
    at = 0
    for path in paths:
        part = load_file(str(path))
        n = len(part["tokens"])
        for k, v in part.items():
            if k.startswith("soft_") and not soft:
                continue
            if k not in data:
                data[k] = torch.empty((rows, *v.shape[1:]), dtype=v.dtype)
            data[k][at : at + n] = v
        at += n
        del part
    meta = dict(metas[0])
    meta["rows"] = len(data["tokens"])
    meta["sources"] = [str(d) for d in dirs]
    meta["top_k"] = metas[0].get("top_k", 0) if soft else 0
    data["meta"] = meta
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--layers", type=int, nargs="+", required=True, help="target layers to capture (drafter context)")
    p.add_argument("--rows", type=int, default=1536)
    p.add_argument("--seq-len", type=int, default=384)
    p.add_argument("--answer-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--shard-rows", type=int, default=256)
    p.add_argument("--sample-frac", type=float, default=0.25)
    p.add_argument("--split", default="train", choices=["train", "heldout"])
    p.add_argument("--stop-ids", type=int, nargs="*", default=None, help="end-of-turn ids besides the tokenizer's eos")
    p.add_argument("--top-k", type=int, default=0,
                   help="keep the target's k most likely next tokens per answer column (soft labels)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    harvest(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
