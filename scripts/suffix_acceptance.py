"""Realised suffix-draft acceptance per match-length bucket, against the policy file's table.

Serves one workload live with static suffix drafting (`suffix`) at one load, and from the trace
computes, per match-length bucket of `adapt/suffix_fit.py`, the maximum-likelihood per-token
acceptance `c = Σ accepted / (Σ accepted + Σ rejections)` of the suffix drafts verified, next to
the `suffix_accept` table the adaptive policy plans with (`table`: each later token's;
`table_first`: the first token's), and the two halves of that estimate: `c_first` (the first
drafted token's acceptance) and `c_later` (each later token's, given the ones before it were
accepted). Example (stop 18):

    python scripts/suffix_acceptance.py --pair smollm2 --workload chat --load 4 --requests 16
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--workload", default="chat")
    p.add_argument("--load", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--policy-file", default=None, help="default: the pair's shipped policy.json")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    from adapt.bench.live import run_live
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.replay import Scenario, make_mix
    from workers.traces import ListTraceSink

    torch.set_num_threads(args.threads)
    engine, prompts = workload_engine(args.pair, args.workload, args.load, args.max_tokens)
    sink = ListTraceSink()
    run_live(engine, make_policy("suffix", None, width=engine.block),
             Scenario("suffix", args.load, make_mix(args.requests, 1e6, 1e6, max_tokens=args.max_tokens)),
             prompts, trace_sink=sink)
    root = Path(__file__).resolve().parents[1]
    policy_file = Path(args.policy_file) if args.policy_file else root / "models" / args.pair / "policy.json"
    table = json.loads(policy_file.read_text())["settings"]["suffix_accept"]
    edges = table["match"]
    # bucket -> [accepted, rejections, drafts, first token accepted, accepted after the first,
    #            rejections after the first, drafted tokens]
    counts = defaultdict(lambda: [0] * 7)
    for r in sink.records:
        if r.get("source") != "suffix" or r["draft_len"] <= 0:
            continue
        bucket = max([e for e in edges if e <= (r.get("suffix_match") or 0)] or [edges[0]])
        a, k, c = r["accepted"], r["draft_len"], counts[bucket]
        c[0] += a
        c[1] += int(a < k)
        c[2] += 1
        c[3] += int(a >= 1)
        if a >= 1 and k >= 2:  # the later positions, given the first was accepted
            c[4] += a - 1
            c[5] += int(a < k)
        c[6] += k
    rows = []
    for b in sorted(counts):
        a, rej, n, first, later, rej_later, drafted = counts[b]
        rows.append({"match_from": b, "drafts": n, "accepted": a, "rejections": rej,
                     "c": round(a / max(a + rej, 1), 3), "table": table["accept"][edges.index(b)],
                     "table_first": (table.get("first") or table["accept"])[edges.index(b)],
                     # a geometric law has c_first = c_later; copies that run on have c_later > c_first
                     "c_first": round(first / max(n, 1), 3), "c_later": round(later / max(later + rej_later, 1), 3),
                     "mean_draft_len": round(drafted / max(n, 1), 2)})
        print(json.dumps(rows[-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
