"""Evaluate a drafter for a chat target through the engine, on held-out chat prompts.

    python -m workers.training.chat_eval --target DIR --drafter DIR --prompts 24 --out eval.json

For each diffusion step count s and temperature, every prompt is answered with static knobs
(s steps, draft length K = the drafter's block, exact acceptance) and the engine's own counters
give **τ** (tokens per target forward pass, bonus token included) and the **acceptance per
position** (the share of drafted tokens at position j accepted when all before it were). The
prompts are the held-out split of `workers.training.chat_prompts`, rendered with the target's chat
template; decoding stops at end-of-turn.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def run_prompts(engine, prompts: list[list[int]], max_tokens: int, steps: int, temperature: float, seed: int = 0,
                stop_ids: tuple[int, ...] = ()) -> dict:
    """Decode all prompts (batched by the engine) and aggregate τ and acceptance per position."""
    from workers.request import DecodeKnobs, SamplingParams

    knobs = DecodeKnobs(steps=steps, draft_len=engine.block if steps else 0)
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", p, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i,
                                                       stop_token_ids=stop_ids), knobs)
    finals, t0 = {}, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.stats
    wall = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in finals.values())
    passes = sum(s["target_passes"] for s in finals.values())
    apos = [s["accept_per_position"] for s in finals.values() if s["accept_per_position"]]
    width = max((len(a) for a in apos), default=0)
    per_pos = [round(sum(a[j] for a in apos if len(a) > j) / max(1, sum(len(a) > j for a in apos)), 4)
               for j in range(width)]
    return {"steps": steps, "temperature": temperature, "prompts": len(prompts), "tokens": tokens,
            "target_passes": passes, "tau": round(tokens / max(passes, 1), 3),
            "accept_per_position": per_pos, "tokens_per_s": round(tokens / wall, 1)}


def evaluate(target: Path, drafter: Path, count: int, max_tokens: int, steps: list[int], temperatures: list[float],
             dtype: str = "bfloat16", batch: int = 8, seed: int = 0) -> dict:
    from transformers import AutoTokenizer

    from workers.chat import stop_ids
    from workers.engine import Engine, EngineConfig
    from workers.training.chat_prompts import make_prompts
    from workers.training.harvest import encode_chats

    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = encode_chats(tok, make_prompts("heldout", count * 2, seed=seed), 512)[:count]
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype=dtype, max_batch=batch, max_len=1024))
    stop = stop_ids(tok, chat=True)
    results = [run_prompts(engine, prompts, max_tokens, s, t, seed, stop) for t in temperatures for s in steps]
    return {"target": str(target), "drafter": str(drafter), "dtype": dtype, "batch": batch,
            "max_tokens": max_tokens, "block_size": engine.block, "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = evaluate(args.target, args.drafter, args.prompts, args.max_tokens, args.steps, args.temperatures,
                      args.dtype, args.batch)
    for r in report["results"]:
        print(f"s={r['steps']} T={r['temperature']}: tau {r['tau']:.2f}, accept/pos {r['accept_per_position'][:6]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
