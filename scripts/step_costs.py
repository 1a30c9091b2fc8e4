"""What a drafting step costs at each batch size, measured live, against the profiled cost model.

Serves one workload with fixed knobs (`ar`: never draft; `suffix`: static suffix drafting) at each
load, keeps the trace of every engine step, and groups the steps by batch size `B`, drafting rows
`m` and verified positions. For each group it prints the median measured step time and what the
engine's profiled cost model (`adapt.controller.profile_engine`) predicts for it: the residual of
drafting steps over plain steps of the same `B` is the drafting path's fixed cost that the verify
table (indexed by positions only) does not see. Example (stop 18):

    python scripts/step_costs.py --pair smollm2 --workload chat --loads 1,4,8,16 --out results/step-costs/chat.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--workload", default="chat")
    p.add_argument("--loads", default="1,4,8,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=0, help="requests per load (default 2 x load, at least 8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    from adapt.bench.live import run_live
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.controller import profile_engine
    from adapt.replay import Scenario, make_mix
    from workers.traces import ListTraceSink

    torch.set_num_threads(args.threads)
    loads = [int(x) for x in args.loads.split(",")]
    engine, prompts = workload_engine(args.pair, args.workload, max(loads), args.max_tokens)
    cost = profile_engine(engine)
    K = engine.block
    groups: dict[tuple, list[float]] = defaultdict(list)
    for c in loads:
        mix = make_mix(args.requests or max(8, 2 * c), 1e6, 1e6, max_tokens=args.max_tokens)
        for name in ("ar", "suffix"):
            policy = make_policy(name, None, width=K)
            run_live(engine, policy, Scenario("warm", min(c, 4), mix[:4]), prompts)  # not recorded
            sink = ListTraceSink()
            run_live(engine, policy, Scenario("costs", c, mix), prompts, trace_sink=sink)
            steps: dict[int, list[dict]] = defaultdict(list)
            for r in sink.records:
                steps[r["step"]].append(r)
            for recs in steps.values():
                B = len(recs)
                drafting = [r for r in recs if r["draft_len"] > 0]
                k_max = max((r["draft_len"] for r in drafting), default=0)
                positions = int(recs[0]["num_tokens"])
                groups[(B, len(drafting), k_max, positions)].append(float(recs[0]["step_ms"]))
    rows = []
    for (B, m, k_max, positions), ms in sorted(groups.items()):
        predicted = float(cost.step_ms_at(float(positions)))
        rows.append({"batch": B, "drafting_rows": m, "k_max": k_max, "positions": positions, "steps": len(ms),
                     "step_ms": round(statistics.median(ms), 2), "predicted_ms": round(predicted, 2)})
    # per (B, drafting or not): the median residual over every step of that kind
    summary = []
    for B in sorted({r["batch"] for r in rows}):
        for kind in ("plain", "drafting"):
            sel = [r for r in rows if r["batch"] == B and (r["drafting_rows"] > 0) == (kind == "drafting")]
            resid = [r["step_ms"] - r["predicted_ms"] for r in sel for _ in range(r["steps"])]
            if resid:
                summary.append({"batch": B, "kind": kind, "steps": len(resid),
                                "median_residual_ms": round(statistics.median(resid), 2)})
                print(json.dumps(summary[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"pair": args.pair, "workload": args.workload, "cost": cost.to_dict(),
                               "summary": summary, "groups": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
