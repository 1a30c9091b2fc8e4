"""Prefill cost, packed against padded, side by side in one run.

Prefills the first `--rows` prompts of a workload (as `adapt bench policies` makes them) in one
engine step, alternating an engine that packs its forwards (`EngineConfig.pack="on"`: each prompt
runs on its own tokens and attends over its own keys) with one that pads every prompt to the
longest, `--rounds` times; prints and writes the median seconds of each and their ratio.

    python scripts/prefill_cost.py --pair smollm2 --workload mixed --rows 16 --out results/prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--workload", default="mixed")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from adapt.bench.policies import chat_prompt_limit, workload_prompts
    from workers.engine import Engine, EngineConfig
    from workers.pairs import get_pair
    from workers.request import SamplingParams

    torch.set_num_threads(args.threads)
    spec = get_pair(args.pair)
    spec.prepare()
    limit = chat_prompt_limit(64)
    engines = {pack: Engine(EngineConfig(target=spec.target, drafter=spec.drafter, max_batch=args.rows,
                                         max_len=limit + 72, pack=pack)) for pack in ("on", "off")}
    prompts = workload_prompts(engines["on"], args.workload, args.rows, limit, 0)[: args.rows]

    def prefill(engine, tag: str) -> float:
        for i, ids in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", ids, SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()  # the prefill; max_tokens=1 finishes every request there
        return time.perf_counter() - t0

    seconds = {pack: [] for pack in engines}
    for pack, engine in engines.items():
        prefill(engine, "warm")
    for rnd in range(args.rounds):
        for pack, engine in engines.items():
            seconds[pack].append(prefill(engine, f"r{rnd}"))
    lens = [len(x) for x in prompts]
    row = {"pair": args.pair, "workload": args.workload, "rows": len(prompts), "prompt_tokens": sum(lens),
           "padded_tokens": len(lens) * max(lens), "packed_s": statistics.median(seconds["on"]),
           "padded_s": statistics.median(seconds["off"]), "rounds": seconds}
    row["padded_over_packed"] = row["padded_s"] / row["packed_s"]
    print(json.dumps(row))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
