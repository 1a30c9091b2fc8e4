"""Fit the acceptance of suffix drafts from traces: per-token acceptance by match length.

A suffix draft (workers/suffix.py) of match length m is accepted token by token until the first
rejection. The law fitted has two parameters per bucket of match lengths: the first drafted
token is accepted with probability ``c₁(m)`` and each later one, given the ones before it were,
with ``c(m)`` (a geometric law cut at the draft length k when the two are equal). Copies *run
on*: once the first token of a copy is right, the next ones are more likely right too (measured
on SmolLM2's mixed workload, stop 19: 0.42 → 0.49 at match 2, 0.67 → 0.81 at match 4). Their
maximum-likelihood estimates from records with `accepted` = a of k are

    c₁(m) = #[a ≥ 1] / #records
    c(m)  = Σ_{a ≥ 1, k ≥ 2} (a − 1) / (Σ_{a ≥ 1, k ≥ 2} (a − 1) + #[1 ≤ a < k])

(later tokens accepted over later tokens accepted plus later rejections). The estimates are made
non-decreasing in m (a longer match never predicts less; `monotone`); buckets with too few
records fall back to the built-in ``m / (m + 3)``, clipped between their fitted neighbours,
and too few later tokens to the bucket's pooled estimate ``Σ a / (Σ a + #[a < k])``. The table
goes into the adaptive policy's settings (``suffix_accept``; policies/adaptive.py) and the fit
report.
"""

from __future__ import annotations

import numpy as np

from adapt.trace_data import TraceTable

EDGES = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # lower match-length edges of the buckets
MIN_RECORDS = 20                         # fewer records in a bucket: the built-in prior


def fit_suffix_accept(table: TraceTable, edges=EDGES, min_records: int = MIN_RECORDS) -> tuple[dict | None, dict]:
    """(settings table ``{"match": [...], "first": [c₁ ...], "accept": [c ...]}`` or None when the
    traces hold no suffix drafts, report {records, buckets: [{match, records, first, accept,
    pooled, fitted}]})."""
    rows = (table.steps == -1) & (table.draft_len > 0)
    if not rows.any():
        return None, {"records": 0}
    m, a, k = table.suffix_match[rows], table.accepted[rows], table.draft_len[rows]
    bucket = np.searchsorted(np.asarray(edges), m, side="right") - 1
    first, accept, report = [], [], {"records": int(rows.sum()), "buckets": []}
    for i, lo in enumerate(edges):
        sel = bucket == i
        n = int(sel.sum())
        prior = lo / (lo + 3.0)
        c1 = c = pooled = prior
        if n >= min_records:
            acc, rej = float(a[sel].sum()), float((a[sel] < k[sel]).sum())
            pooled = acc / max(acc + rej, 1.0)
            c1 = float((a[sel] >= 1).mean())
            on = sel & (a >= 1) & (k >= 2)  # the later tokens: given the first was accepted
            later_acc, later_rej = float((a[on] - 1).sum()), float((a[on] < k[on]).sum())
            c = later_acc / (later_acc + later_rej) if later_acc + later_rej >= min_records else pooled
        first.append(c1)
        accept.append(c)
        report["buckets"].append({"match": lo, "records": n, "first": round(c1, 4), "accept": round(c, 4),
                                  "pooled": round(pooled, 4), "fitted": n >= min_records})
    fitted = [b["fitted"] for b in report["buckets"]]
    first, accept = monotone(first, fitted), monotone(accept, fitted)
    return {"match": list(edges), "first": [round(c, 4) for c in first], "accept": [round(c, 4) for c in accept]}, report


def monotone(values: list[float], fitted: list[bool]) -> list[float]:
    """`values` per bucket made non-decreasing in the match length, clipped to [0, 0.999]: the
    fitted buckets by a running maximum over fitted buckets only, and each bucket without enough
    records keeps its prior clipped between its fitted neighbours' values (so a prior never lifts
    a fitted bucket above it)."""
    out = np.asarray(values, dtype=float).clip(0.0, 0.999)
    mask = np.asarray(fitted, dtype=bool)
    if mask.any():
        out[mask] = np.maximum.accumulate(out[mask])
        idx = np.flatnonzero(mask)
        for i in np.flatnonzero(~mask):
            below, above = idx[idx < i], idx[idx > i]
            lo = out[below[-1]] if below.size else 0.0
            hi = out[above[0]] if above.size else 0.999
            out[i] = min(max(out[i], lo), hi)
    else:
        out = np.maximum.accumulate(out)
    return out.tolist()


def collect_suffix_traces(target, prompts: list[list[int]], max_tokens: int, batch: int = 8,
                          dtype: str = "auto") -> list[dict]:
    """Trace records of static suffix drafting (every row drafts its full suffix draft, greedy) on
    `prompts` (token ids), through the real engine without a drafter."""
    from workers.engine import Engine, EngineConfig
    from workers.request import DecodeKnobs, SamplingParams
    from workers.traces import ListTraceSink

    sink = ListTraceSink()
    longest = max(map(len, prompts))
    engine = Engine(EngineConfig(target=str(target), drafter=None, dtype=dtype, max_batch=batch,
                                 max_len=longest + max_tokens + 32), trace_sink=sink)
    knobs = DecodeKnobs(draft_len=engine.width, source="suffix")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        while pending and engine.free_slots > len(engine.waiting):
            i, ids = pending.pop(0)
            engine.add_request(f"fit-{i}", ids, params, knobs)
        engine.step()
    return sink.records


def main(argv=None) -> int:
    """Collect suffix-draft traces on training-split prompts of a pair and write the fitted table
    into its policy file (settings.suffix_accept; a new version of the file)."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("--pair", default="smollm2")
    p.add_argument("--policy-file", type=Path, required=True, help="the policy file to update")
    p.add_argument("--workloads", default="chat,code,edit")
    p.add_argument("--count", type=int, default=24, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--traces", type=Path, default=None, help="also write the traces here (JSON Lines)")
    args = p.parse_args(argv)
    import torch

    from adapt.bench.workloads import make_workload
    from adapt.policy_file import load, save
    from workers.chat import chat_prompt_ids
    from workers.pairs import get_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = get_pair(args.pair)
    pair.prepare()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair.target))
    prompts = [chat_prompt_ids(tok, w["messages"]) for name in args.workloads.split(",")
               for w in make_workload(name, args.count, seed=1, split="train")]
    records = collect_suffix_traces(pair.target, prompts, args.max_tokens)
    if args.traces:
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        args.traces.write_text("".join(json.dumps(r) + "\n" for r in records))
    table, report = fit_suffix_accept(TraceTable.from_records(records))
    if table is None:
        raise SystemExit("no suffix drafts in the collected traces")
    policy = load(args.policy_file)
    policy.settings = dict(policy.settings, suffix_accept=table)
    policy.version, policy.created = "", 0.0  # a new version
    policy.report = dict(policy.report, suffix=dict(report, workloads=args.workloads, count=args.count,
                                                     max_tokens=args.max_tokens, split="train"))
    version = save(policy, args.policy_file)
    print(json.dumps({"suffix_accept": table, "records": report["records"], "version": version}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
