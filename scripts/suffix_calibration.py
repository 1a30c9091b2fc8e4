"""How well suffix acceptance tables predict what suffix drafts win, per temperature class.

Each suffix draft of the traces is priced by a table (`policies.adaptive.suffix_slot_accept`) at
the length it was verified with, and the prediction is compared with the tokens it won:
``won / predicted`` per class (greedy, sampled), per match-length bucket and per quintile of the
prediction. Two sources of traces, on the A/B's own mixed prompts (`adapt.bench.policies`):

- ``static``: static suffix drafting (every draft at full length), batch 8, at each
  ``--temperatures`` (`adapt.suffix_fit.collect_suffix_traces`);
- ``live``: the live A/B at one load (`--load`), the adaptive policy and static suffix drafting
  run one after the other through the engine (`adapt.bench.live.run_live`), so the drafts are
  the ones each chose.

Example (stop 25, docs/benchmarks.md)::

    python scripts/suffix_calibration.py static --tables results/policies-smollm2-25/suffix-accept-stop23.json \
        models/smollm2/policy.json --out results/policies-smollm2-25/calibration-static.json
    python scripts/suffix_calibration.py live --load 1 --tables models/smollm2/policy.json \
        --out results/policies-smollm2-25/calibration-live-1.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

BUCKETS = ((2, 3), (3, 4), (4, 6), (6, 12), (12, 10**6))


def read_table(path: str) -> dict:
    """A suffix acceptance table from a policy file (its settings' ``suffix_accept``) or a bare table."""
    from policies.adaptive import check_suffix_accept

    data = json.loads(Path(path).read_text())
    return check_suffix_accept(data["settings"].get("suffix_accept") if "settings" in data else data)


def compare(records: list[dict], table: dict) -> dict:
    """Per-draft predictions of `table` against what the drafts won, summarised."""
    import torch

    from adapt.suffix_fit import suffix_rows
    from adapt.trace_data import TraceTable
    from policies.adaptive import suffix_draft_accept

    t = TraceTable.from_records(records)
    rows = suffix_rows(t)
    if rows.size == 0:
        return {"drafts": 0}
    k = t.draft_len[rows]
    sampled = t.temperature[rows] > 0
    pred = suffix_draft_accept(table, torch.as_tensor(t.suffix_match[rows]),                          # [R]
                               torch.as_tensor(t.confidence[rows][:, :int(k.max())]).float(), torch.as_tensor(k),
                               torch.as_tensor(sampled)).sum(1).numpy()
    won = t.accepted[rows].astype(np.float64)                                                           # [R]
    match = t.suffix_match[rows]

    def summary(sel) -> dict:
        n = int(sel.sum())
        if n == 0:
            return {"drafts": 0}
        return {"drafts": n, "length": round(float(k[sel].mean()), 2), "predicted": round(float(pred[sel].mean()), 3),
                "won": round(float(won[sel].mean()), 3), "ratio": round(float(won[sel].sum() / max(pred[sel].sum(), 1e-9)), 3)}

    edges = np.quantile(pred, [0.2, 0.4, 0.6, 0.8])
    quintile = np.searchsorted(edges, pred, side="right")
    return {**summary(np.ones_like(sampled)), "greedy": summary(~sampled), "sampled": summary(sampled),
            "match": {f"{lo}-{hi - 1}" if hi < 10**6 else f"{lo}+": summary((match >= lo) & (match < hi))
                      for lo, hi in BUCKETS},
            "quintiles": [summary(quintile == q) for q in range(5)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("static", "live"))
    p.add_argument("--tables", nargs="+", required=True, help="policy files or bare suffix_accept tables (JSON)")
    p.add_argument("--pair", default="smollm2")
    p.add_argument("--prompts", type=int, default=48, help="static: prompts of the mix")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0.8,0", help="static: collect at each")
    p.add_argument("--load", type=int, default=1, help="live: concurrent requests")
    p.add_argument("--policy-file", default="models/smollm2/policy.json", help="live: the adaptive policy's file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from adapt.bench.policies import workload_engine

    torch.set_num_threads(args.threads)
    tables = {path: read_table(path) for path in args.tables}
    longest = round(args.max_tokens * 1.5) + 2
    engine, prompts = workload_engine(args.pair, "mixed", 8 if args.mode == "static" else args.load, longest)
    runs: dict[str, list[dict]] = {}
    if args.mode == "static":
        from adapt.suffix_fit import collect_suffix_traces, parse_temperatures
        from workers.pairs import get_pair

        target = get_pair(args.pair).target
        del engine
        for temp in parse_temperatures(args.temperatures):
            runs[f"static T={temp:g}"] = collect_suffix_traces(target, prompts[:args.prompts], args.max_tokens,
                                                               temperature=temp, seed=7)
    else:
        from adapt.bench.live import run_live
        from adapt.bench.policies import make_policy
        from adapt.bench.evaluation import evaluation_mix, profiled_policy_file
        from adapt.replay import Scenario
        from workers.traces import ListTraceSink

        pf = profiled_policy_file(args.policy_file, engine)
        mix = evaluation_mix(pf.cost, engine.block, 24, max_tokens=args.max_tokens)
        for name in ("adaptive", "suffix"):
            sink = ListTraceSink()
            policy = make_policy(name, pf, steps_grid=tuple(pf.settings.get("steps_grid", (1,))), width=engine.block)
            m = run_live(engine, policy, Scenario("mix", args.load, mix), prompts, trace_sink=sink)
            runs[f"live {name}@{args.load}"] = sink.records
            print(f"{name}: goodput {m['goodput_tok_s']:.1f} tok/s", flush=True)
    report = {run: {path: compare(records, table) for path, table in tables.items()} for run, records in runs.items()}
    for run, by_table in report.items():
        for path, r in by_table.items():
            line = f"{run} | {path}: drafts {r['drafts']}"
            if r["drafts"]:
                line += (f", won/predicted {r['ratio']} (greedy {r['greedy'].get('ratio')}, "
                         f"sampled {r['sampled'].get('ratio')})")
            print(line, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mode": args.mode, "load": args.load if args.mode == "live" else None,
                               "max_tokens": args.max_tokens, "report": report}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
