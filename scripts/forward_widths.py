"""What one target forward and one drafter pass cost per width, on the engine the benchmarks use.

The cost model's verify table is indexed by the tokens a target forward takes, and a start-up
profile times it at a grid of token counts (`adapt.cost_model.PROFILE_TOKEN_GRID`); between grid
points the table interpolates linearly. This script times, at one row after a prompt of
``--context`` tokens: the target forward over 1 .. ``--max-tokens`` tokens (as a decode step
verifies an anchor and its drafts) and the drafter's denoising pass over ``[anchor, MASK x span]``
for each span (`DrafterContext.block_pass`, the compiled package where it takes the shape). The
widths take turns in sweeps, in a new shuffled order each sweep, as the start-up profile times
its grid (`adapt.cost_model.sweep_medians`: a drift of the machine meets every width alike, and
so does the slower call right after the other model's; before stop 55 the order was fixed, and
the first forward of each sweep read slower than the next: 21.3 ms for one token against 18.5
ms for two in stop 55's first run, monotone once shuffled), and each keeps its median. Example (stop 55):

    python scripts/forward_widths.py --compile aot --out results/forward-widths-55/smollm2-aot.json

``--contexts 64,448,960`` also times the target forward over 1 .. ``--max-tokens`` tokens after
each of those prompt lengths, in the same sweeps (``target_forward_ms_by_context``): what a wide
verify costs as the cache grows (stop 57: its extra over one token is attention, ~0.4 ms for
five more tokens over 64 cached ones and ~4.5 ms over 960; the engine is sized for the longest).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--compile", default="aot", choices=("off", "aot"))
    p.add_argument("--context", type=int, default=400, help="prompt tokens before the timed positions")
    p.add_argument("--max-tokens", type=int, default=17, help="the widest target forward timed")
    p.add_argument("--contexts", default="", help="comma-separated prompt lengths to time the target "
                   "forward after as well (e.g. 64,448,960)")
    p.add_argument("--sweeps", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        contexts = sorted({int(c) for c in args.contexts.split(",") if c.strip()})
    except ValueError:
        p.error(f"--contexts: comma-separated integers, got {args.contexts!r}")
    if any(c < 1 for c in contexts):
        p.error("--contexts: prompt lengths must be >= 1")

    import torch

    from adapt.bench import write_json
    from adapt.bench.policies import chat_prompt_limit, workload_engine
    from adapt.cost_model import sweep_medians

    torch.set_num_threads(args.threads)
    # room for the longest context (workload_engine sizes the cache for its prompts plus this)
    extra = max(args.max_tokens + 8, max(contexts, default=0) + args.max_tokens + 24 - chat_prompt_limit(64))
    engine, _ = workload_engine(args.pair, "mixed", 1, extra, compile=args.compile)
    dr, K = engine.drafter, engine.block
    longest = engine.max_len - args.max_tokens - K - 2
    context = min(args.context, longest)
    contexts = sorted({min(c, longest) for c in contexts})

    def forward(t: int, at: int = context) -> None:
        ids = torch.zeros(1, t, dtype=torch.long)
        engine.target_forward(ids, torch.full((1,), at), engine.tcache, 0, at + t, start_value=at)

    def draft(span: int) -> None:
        W = context + span + 1
        tokens = torch.zeros(1, span + 1, dtype=torch.long)
        masked = torch.ones(1, span + 1, dtype=torch.bool)
        masked[:, 0] = False
        rope = dr.rope(context + torch.arange(span + 1)[None], dr.mask_embedding.dtype, bound=engine.dcache.max_len)
        one_pass = engine.drafting.block_pass(engine.dcache.views(0, 1, W), None, rope, 1, span + 1, W)
        torch.softmax(one_pass(tokens, masked).float(), -1)

    points = [("forward", t) for t in range(1, args.max_tokens + 1)]
    if dr is not None:
        points += [("draft", s) for s in range(1, K + 1)]
    points += [("at", c, t) for c in contexts for t in range(1, args.max_tokens + 1)]
    run = {"forward": forward, "draft": draft, "at": lambda c, t: forward(t, c)}
    with torch.inference_mode():  # a new order every sweep, as the start-up profile times its grid
        ms = sweep_medians([functools.partial(run[kind], *n) for kind, *n in points], args.sweeps)
    median = dict(zip(points, ms.tolist()))
    result = {"pair": args.pair, "compile": args.compile, "context": context, "sweeps": args.sweeps,
              "target_forward_ms": {t: round(median[("forward", t)], 3) for t in range(1, args.max_tokens + 1)},
              "drafter_pass_ms": {s: round(median[("draft", s)], 3)
                                  for s in range(1, K + 1)} if dr is not None else {}}
    if contexts:
        result["target_forward_ms_by_context"] = {c: {t: round(median[("at", c, t)], 3)
                                                      for t in range(1, args.max_tokens + 1)} for c in contexts}
    print(json.dumps(result))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
