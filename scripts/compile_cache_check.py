"""Can an engine's compiled decode programs come from torch's on-disk caches in a new process?

Builds one engine with compiled decode steps (`EngineConfig(compile="on")`, workers/compiled.py),
warms it up (`Engine.warm_up`: every call pattern compiles), then times autoregressive decoding at
batch 1, and prints the warm-up seconds, tokens/s and torch's cache counters (inductor's FX graph
cache: hit / miss / bypass; AOT autograd's cache). `--mode eager` is the reference;
`--mode prepack` is the engine as shipped (freezing, inductor packs the weights for oneDNN);
`--mode noprepack` turns inductor's weight packing off (`cpp.weight_prepack=False`). Run a mode
twice, one process each: the second reads what the first left in the cache directory (torch's
default, or `TORCHINDUCTOR_CACHE_DIR`). Stop 39 (results/compile-cache-39/runs.jsonl):

    python scripts/compile_cache_check.py --mode prepack
    python scripts/compile_cache_check.py --mode noprepack; python scripts/compile_cache_check.py --mode noprepack
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", default="prepack", choices=("eager", "prepack", "noprepack"))
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch
    from torch._dynamo.utils import counters

    import workers.compiled as compiled
    from workers.engine import Engine, EngineConfig
    from workers.pairs import get_pair
    from workers.request import DecodeKnobs, SamplingParams

    torch.set_num_threads(args.threads)
    if args.mode == "noprepack":
        compiled.INDUCTOR_OPTIONS = {**compiled.INDUCTOR_OPTIONS, "cpp.weight_prepack": False}
    spec = get_pair(args.pair)
    spec.prepare()
    t0 = time.time()
    engine = Engine(EngineConfig(target=str(spec.target), drafter=str(spec.drafter), dtype=args.dtype,
                                 max_batch=args.max_batch, max_len=512, compile=args.mode != "eager"))
    engine.warm_up()
    warm_s = time.time() - t0

    def tokens_per_s(n: int) -> float:
        engine.add_request("r", list(range(5, 45)), SamplingParams(max_tokens=n, ignore_eos=True),
                           DecodeKnobs(draft_len=0))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return n / (time.perf_counter() - t)

    tokens_per_s(8)
    rates = [round(tokens_per_s(args.tokens), 1) for _ in range(3)]
    print(json.dumps({"mode": args.mode, "pair": args.pair, "max_batch": args.max_batch, "warm_s": round(warm_s, 1),
                      "tok_s": rates, "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
                      "aot_autograd": dict(counters["aot_autograd"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
