"""How many diffusion drafts the target accepts when the drafter samples at a scaled temperature.

Serves sampled requests (temperature ``--temperature``, lossless) of each workload kind with
static diffusion drafting (one denoising step, ``--draft-len`` drafted tokens on every row every
step) at each ``--scales`` value of `EngineConfig.draft_temperature_scale`, on one engine, the
same prompts and seeds for each scale, and reports τ (tokens per target pass) per kind and scale.
τ is a count: the machine's speed does not move it, so the scales compare exactly (up to the
draws, which share their random streams across scales: a row's uniforms come from its seed).

Rejection sampling is exact for any draft distribution q a token was drawn from, so every scale
decodes from the target's own distribution; what changes is how often the drafter's guesses are
the target's. Example (stop 55):

    python scripts/draft_temperature.py --scales 1,0.75,0.5,0.25 --out results/draft-temperature-55/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("chat", "code", "edit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--scales", default="1,0.5")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--requests", type=int, default=8, help="requests per kind")
    p.add_argument("--load", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--compile", default="aot", choices=("off", "aot"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from adapt.bench import write_json
    from adapt.bench.live import KnobsBaseline, run_live
    from adapt.bench.policies import chat_prompt_limit, workload_engine, workload_prompts
    from adapt.replay import RequestSpec, Scenario
    from adapt.targets import RequestTargets

    torch.set_num_threads(2)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    scales = [float(s) for s in args.scales.split(",")]
    engine, _ = workload_engine(args.pair, "chat", args.load, args.max_tokens + 8, compile=args.compile)
    if engine.drafting is None:
        raise SystemExit(f"pair {args.pair}: no drafter")
    spec = RequestSpec(RequestTargets(), temperature=args.temperature, max_tokens=args.max_tokens)
    scenario = Scenario("sampled", args.load, [spec] * args.requests)
    policy = KnobsBaseline(f"static-{args.draft_len}", source="diffusion", steps=1, draft_len=args.draft_len)
    rows = []
    for kind in kinds:
        prompts = workload_prompts(engine, kind, args.requests, chat_prompt_limit(64), 0)
        base = None
        for scale in scales:
            engine.drafting.temperature_scale = scale
            m = run_live(engine, policy, scenario, prompts, seed=1)
            row = {"kind": kind, "scale": scale, "tau": round(m["tau"], 4), "tokens": m["tokens"],
                   "goodput_tok_s": round(m["goodput_tok_s"], 2)}
            base = row["tau"] if base is None else base
            row["tau_ratio"] = round(row["tau"] / base, 4)
            print(json.dumps(row), flush=True)
            rows.append(row)
    engine.drafting.temperature_scale = 1.0
    out = {"pair": args.pair, "temperature": args.temperature, "draft_len": args.draft_len,
           "requests_per_kind": args.requests, "max_tokens": args.max_tokens, "rows": rows}
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
