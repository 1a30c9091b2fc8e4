"""The ceiling of choosing the draft source per step, measured against static suffix drafting.

One interleaved run (adapt/bench/interleave.py) of ``suffix`` (static suffix drafting: a suffix
draft wherever the suffix drafter has one, else a plain step) and ``adaptive`` (the policy file's)
on a workload at one request at a time, both traced (workers/traces.py). The **oracle** keeps
every step on which static suffix drafting copied, and replaces each of its plain steps by
diffusion drafting at the rate, in tokens per ms, that the adaptive policy's diffusion steps
reached on requests of the same kind (chat / code / edit) and temperature class (greedy or
sampled). Per kind and overall it reports the decode rates of the three (tokens over the summed
step times: prefills left out) and the oracle's and the adaptive policy's decode-time gain over
static suffix drafting. The oracle is a bound for a policy that picks between copying and
diffusion drafting at today's step costs (it assumes a copy step is never worth replacing and
that diffusion drafting pays on every other step at its measured rate); where it sits below a
goal, a better choice alone cannot reach the goal, and cheaper diffusion steps (or better
drafts) must come first.

    python -m adapt.bench.instruments.source_ceiling --pair smollm2 --workload mixed --requests 24 --compile aot \\
        --out runs/ceiling-mixed.json --traces /tmp/ceiling-traces

It also reports **what-ifs** of the adaptive policy's decode-time gain (`what_if`): its
diffusion steps each 1, 2 or 3 ms cheaper, or winning 10–50 % more accepted drafts in the same
time, everything else as measured. They say what a cheaper drafter or target step, or a better
drafter, must bring for a goal (on SmolLM2's mixed workload, 1 ms off every diffusion step was
worth +4 points).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

KINDS = ("chat", "code", "edit")  # the mixed workload's rotation (adapt/bench/workloads.py)


def kind_of(request_id: str, workload: str) -> str:
    """A request's kind: its index in the mix (the id's last field) on the mixed workload's rotation."""
    return KINDS[int(request_id.rsplit("-", 1)[1]) % 3] if workload == "mixed" else workload


def by_source(records: list[dict], workload: str) -> dict:
    """{(kind, greedy): {source: [steps, tokens, ms]}} over one run's trace records."""
    out = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0.0]))
    for r in records:
        cell = out[(kind_of(r["request_id"], workload), r["temperature"] <= 0)][r["source"]]
        cell[0] += 1
        cell[1] += r["accepted"] + 1
        cell[2] += r["step_ms"]
    return out


def ceiling(static: dict, adaptive: dict) -> dict:
    """Per (kind, class) and overall: decode rates (tokens / s) of static suffix drafting, the
    oracle and the adaptive policy, and the oracle's and adaptive's gains in decode time."""
    rows, total = [], collections.Counter()
    for key in sorted(static):
        s, a = static[key], adaptive.get(key, {})
        diff = a.get("diffusion", [0, 0, 0.0])
        tokens = s["suffix"][1] + s["none"][1]
        t_static = s["suffix"][2] + s["none"][2]
        # the plain steps' tokens at the diffusion rate (without diffusion steps: as they were)
        t_plain = s["none"][1] * diff[2] / diff[1] if diff[1] else s["none"][2]
        t_oracle = s["suffix"][2] + min(t_plain, s["none"][2])
        a_tok = sum(c[1] for c in a.values())
        a_ms = sum(c[2] for c in a.values())
        rows.append({"kind": key[0], "greedy": key[1], "tokens": tokens,
                     "static_tok_s": round(1e3 * tokens / t_static, 1),
                     "oracle_tok_s": round(1e3 * tokens / t_oracle, 1),
                     "adaptive_tok_s": round(1e3 * a_tok / a_ms, 1) if a_ms else None,
                     "diffusion_tok_s": round(1e3 * diff[1] / diff[2], 1) if diff[2] else None,
                     "plain_tok_s": round(1e3 * s["none"][1] / s["none"][2], 1) if s["none"][2] else None})
        total.update({"tokens": tokens, "static_ms": t_static, "oracle_ms": t_oracle,
                      "adaptive_tokens": a_tok, "adaptive_ms": a_ms})
    static_rate = total["tokens"] / total["static_ms"]
    return {"rows": rows,
            "oracle_gain": round(total["static_ms"] / total["oracle_ms"], 3),
            "adaptive_gain": round(total["adaptive_tokens"] / total["adaptive_ms"] / static_rate, 3)}


def what_if(static: list[dict], adaptive: list[dict], faster_ms=(1.0, 2.0, 3.0),
            more_accepted=(0.1, 0.2, 0.3, 0.5)) -> dict:
    """The adaptive policy's decode-time gain over static suffix drafting (tokens over summed step
    times, both runs' trace records) as measured and with its diffusion steps changed: each
    ``faster_ms`` cheaper (floored at 0.1 ms), or winning ``more_accepted`` more accepted drafts
    (a share of what they won) in the same time."""
    rate = lambda tokens, ms: tokens / ms if ms > 0 else 0.0
    s_rate = rate(sum(r["accepted"] + 1 for r in static), sum(r["step_ms"] for r in static))
    tokens = sum(r["accepted"] + 1 for r in adaptive)
    diffusion = [r for r in adaptive if r["source"] == "diffusion"]
    ms = sum(r["step_ms"] for r in adaptive)
    won = sum(r["accepted"] for r in diffusion)
    gain = lambda t, m: round(rate(t, m) / s_rate, 3) if s_rate else None
    saved = lambda d: sum(r["step_ms"] - max(r["step_ms"] - d, 0.1) for r in diffusion)
    return {"diffusion_steps": len(diffusion), "diffusion_ms": round(sum(r["step_ms"] for r in diffusion), 1),
            "decode_ms": round(ms, 1), "gain": gain(tokens, ms),
            "diffusion_faster_ms": {str(d): gain(tokens, ms - saved(d)) for d in faster_ms},
            "diffusion_more_accepted": {str(x): gain(tokens + x * won, ms) for x in more_accepted}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--workload", default="mixed")
    p.add_argument("--policy-file", default=str(Path(__file__).resolve().parents[3] / "models/smollm2/policy.json"))
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--length-spread", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", default="off", choices=("off", "aot"))
    p.add_argument("--out", required=True)
    p.add_argument("--traces", default=None, help="a folder to keep both runs' trace records in "
                   "(suffix.jsonl, adaptive.jsonl)")
    args = p.parse_args(argv)

    import torch

    from adapt.bench.interleave import engine_copies, run_interleaved
    from adapt.bench.live import run_live
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.bench.evaluation import evaluation_mix, profiled_policy_file
    from adapt.replay import Scenario
    from workers.traces import ListTraceSink

    torch.set_num_threads(args.threads)
    longest = round(args.max_tokens * (1.0 + args.length_spread)) + 1
    engine, prompts = workload_engine(args.pair, args.workload, 1, longest, compile=args.compile)
    pf = profiled_policy_file(args.policy_file, engine)
    K = engine.block
    mix = evaluation_mix(pf.cost, K, max(args.requests, 4), max_tokens=args.max_tokens, length_spread=args.length_spread)
    grid = tuple(pf.settings.get("steps_grid", (1,)))
    engines = engine_copies(engine, 2)
    policies = [make_policy(n, pf, steps_grid=grid, width=K) for n in ("suffix", "adaptive")]
    for e, pol in zip(engines, policies):
        run_live(e, pol, Scenario("warm", 1, mix[:4]), prompts)
    sinks = [ListTraceSink(), ListTraceSink()]
    measured = run_interleaved(engines, policies, Scenario("mix", 1, mix[: args.requests]), prompts, trace_sinks=sinks)
    if args.traces:
        folder = Path(args.traces)
        folder.mkdir(parents=True, exist_ok=True)
        for name, sink in zip(("suffix", "adaptive"), sinks):
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sink.records))
    result = ceiling(by_source(sinks[0].records, args.workload), by_source(sinks[1].records, args.workload))
    result["what_if"] = what_if(sinks[0].records, sinks[1].records)
    result.update(pair=args.pair, workload=args.workload, requests=args.requests, compile=args.compile,
                  goodput_tok_s={"suffix": round(measured[0]["goodput_tok_s"], 1),
                                 "adaptive": round(measured[1]["goodput_tok_s"], 1)},
                  source_share={"suffix": measured[0].get("source_share"), "adaptive": measured[1].get("source_share")})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
