"""Fit the acceptance of suffix drafts from traces: per-token acceptance by match length.

A suffix draft (workers/suffix.py) of match length m is accepted token by token until the first
rejection. The law fitted has two parameters per bucket of match lengths: the first drafted
token is accepted with probability ``c₁(m)`` and each later one, given the ones before it were,
with ``c(m)`` (a geometric law cut at the draft length k when the two are equal). Copies *run
on*: once the first token of a copy is right, the next ones are more likely right too (measured
on SmolLM2's mixed workload: 0.42 → 0.49 at match 2, 0.67 → 0.81 at match 4). Their
maximum-likelihood estimates from records with `accepted` = a of k are

    c₁(m) = #[a ≥ 1] / #records
    c(m)  = Σ_{a ≥ 1, k ≥ 2} (a − 1) / (Σ_{a ≥ 1, k ≥ 2} (a − 1) + #[1 ≤ a < k])

(later tokens accepted over later tokens accepted plus later rejections). The estimates are made
non-decreasing in m (a longer match never predicts less; `monotone`); buckets with too few
records fall back to the built-in ``m / (m + 3)``, clipped between their fitted neighbours,
and too few later tokens to the bucket's pooled estimate ``Σ a / (Σ a + #[a < k])``. The table
goes into the adaptive policy's settings (``suffix_accept``; policies/adaptive/suffix_table.py) and the fit
report.

**Vote shares.** Each drafted token carries the share of the draft's candidates that voted for it
(workers/suffix.py; the trace's ``confidence`` of a suffix record). A contested token is a much
worse bet than a unanimous one at the same match length (SmolLM2, static suffix drafting on
chat, code and edit prompts: a first token at match 2 was accepted 0.10 of
the time below a half share, 0.21 below 0.99 and 0.58 at 1.0). The law is therefore per *slot*: slot j is accepted, given the slots before it
were, with probability ``min(1, c(m) · s(v_j))`` (``c₁`` for the first), where ``s`` is a scale
per bucket of vote shares (``VOTE_EDGES``), 1 for unanimous tokens and non-decreasing in the
share. c and s are fitted together by alternating ratio estimates (each the accepted slots over
the slots' predicted acceptance with the other held fixed; with every share in one bucket this is
the estimate above). The report compares the per-slot log-loss with and without the scale.

**Temperature classes.** Greedy rows (T = 0) and sampled rows (T > 0) get a table each: a sampled
row accepts a copied token with the target's probability of it, not whenever it is the argmax,
so the same copy wins less (SmolLM2, 48 mixed prompts: the greedy-fitted table predicted
1.05x what greedy drafts won and 1.15x what sampled ones at T = 0.8 won; `fit_suffix_accept`).
"""

from __future__ import annotations

import numpy as np

from adapt.trace_data import TraceTable

EDGES = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # lower match-length edges of the buckets
MIN_RECORDS = 20                         # fewer records in a bucket: the built-in prior


VOTE_EDGES = (0.0, 0.5, 0.99)         # lower vote-share edges of the scale's buckets
ROUNDS = 4                               # alternations of the c and s estimates


def suffix_rows(table: TraceTable) -> np.ndarray:
    """[R] indices of the records that verified a suffix draft."""
    return np.flatnonzero((table.steps == -1) & (table.draft_len > 0))


def suffix_slots(table: TraceTable) -> dict[str, np.ndarray] | None:
    """Every slot a suffix draft's verification reached (the accepted ones and the first
    rejection), flattened [S]: match length, whether it is the draft's first, its vote share,
    whether it was accepted and whether its row sampled (T > 0). None when the traces hold no
    suffix drafts."""
    rows = suffix_rows(table)
    if rows.size == 0:
        return None
    a, k = table.accepted[rows], table.draft_len[rows]
    reached = np.minimum(a + 1, k)                                     # [R] slots verified up to the first rejection
    rec = np.repeat(rows, reached)                                     # [S]
    j = np.arange(int(reached.sum())) - np.repeat(np.cumsum(reached) - reached, reached)  # [S] slot index
    vote = table.confidence[rec, j]                                   # [S] (draft_len <= K_MAX: checked on reading)
    return {"match": table.suffix_match[rec], "first": j == 0, "vote": vote.astype(np.float64),
            "accepted": j < table.accepted[rec], "sampled": table.temperature[rec] > 0}


def fit_suffix_accept(table: TraceTable, edges=EDGES, min_records: int = MIN_RECORDS,
                      vote_edges=VOTE_EDGES) -> tuple[dict | None, dict]:
    """(settings table or None when the traces hold no suffix drafts, report).

    The table is ``{"match": [...], "first": [c₁ ...], "accept": [c ...], "vote": [...],
    "vote_scale": [s ...]}`` for greedy rows, fitted on the greedy records (on all of them when
    the traces hold no greedy ones), and, when the traces hold sampled records too, the same
    for sampled rows (T > 0) under ``"sampled"``. Classes differ: a greedy row accepts a
    deterministic draft token whenever it is the target's argmax, a sampled row with the
    target's probability of it (REFERENCE.md, deterministic drafts), so the same copy wins less
    at T > 0. The sampled table's buckets without enough records fall back to the greedy
    table's values (not the built-in prior). Report: {records, slots, buckets: [{match,
    records, first, accept, pooled, fitted}], votes: [{vote, slots, observed, scale, fitted}],
    log_loss, log_loss_without_vote} of the greedy table, and the sampled table's under
    ``"sampled"``."""
    slots = suffix_slots(table)
    if slots is None:
        return None, {"records": 0}
    sampled = slots.pop("sampled")
    has_greedy = bool((~sampled).any())
    greedy = ~sampled if has_greedy else np.ones_like(sampled)
    out, report = _fit_slots({k: v[greedy] for k, v in slots.items()}, edges, min_records, vote_edges, None)
    if has_greedy and bool(sampled.any()):
        prior = (np.asarray(out["first"]), np.asarray(out["accept"]))
        out["sampled"], report["sampled"] = _fit_slots({k: v[sampled] for k, v in slots.items()}, edges,
                                                       min_records, vote_edges, prior)
    return out, report


def _fit_slots(slots: dict[str, np.ndarray], edges, min_records: int, vote_edges,
               prior: tuple[np.ndarray, np.ndarray] | None) -> tuple[dict, dict]:
    """The table and report of `fit_suffix_accept` for one class's slots; ``prior``: (c₁, c)
    per bucket for buckets without enough records (None: the built-in ``m / (m + 3)``)."""
    acc = slots["accepted"].astype(np.float64)
    first = slots["first"]
    bucket = np.searchsorted(np.asarray(edges), slots["match"], side="right") - 1       # [S]
    vb = np.searchsorted(np.asarray(vote_edges), slots["vote"], side="right") - 1       # [S]
    records = np.bincount(bucket[first], minlength=len(edges))                          # [E] drafts per bucket
    later_n = np.bincount(bucket[~first], minlength=len(edges))
    vote_n = np.bincount(vb, minlength=len(vote_edges))
    fitted = records >= min_records
    if prior is None:
        built_in = np.array([lo / (lo + 3.0) for lo in edges])
        prior = (built_in, built_in)
    prior1, prior_c = prior
    scale = np.ones(len(vote_edges))
    for _ in range(ROUNDS):
        w = scale[vb]                                                                   # [S]
        pooled = _ratio(acc, w, bucket, len(edges), prior_c)
        c1 = np.where(fitted, _ratio(acc[first], w[first], bucket[first], len(edges), prior1), prior1)
        c = _ratio(acc[~first], w[~first], bucket[~first], len(edges), prior_c)
        c = np.where(fitted & (later_n >= min_records), c, np.where(fitted, pooled, prior_c))
        c1, c = np.asarray(monotone(c1, fitted)), np.asarray(monotone(c, fitted))
        base = np.where(first, c1[bucket], c[bucket])                                   # [S] without the scale
        scale = vote_scale(_ratio(acc, base, vb, len(vote_edges), np.ones(len(vote_edges))), vote_n >= min_records)
    pooled = _ratio(acc, np.ones_like(acc), bucket, len(edges), prior_c)
    pred = np.minimum(base * scale[vb], 1.0)
    report = {"records": int(records.sum()), "slots": int(acc.size), "buckets": [], "votes": [],
              "log_loss": round(_log_loss(acc, pred), 4), "log_loss_without_vote": round(_log_loss(acc, base), 4)}
    for i, lo in enumerate(edges):
        report["buckets"].append({"match": lo, "records": int(records[i]), "first": round(float(c1[i]), 4),
                                  "accept": round(float(c[i]), 4), "pooled": round(float(pooled[i]), 4),
                                  "fitted": bool(fitted[i])})
    for i, lo in enumerate(vote_edges):
        sel = vb == i
        report["votes"].append({"vote": lo, "slots": int(sel.sum()),
                                "observed": round(float(acc[sel].mean()), 4) if sel.any() else None,
                                "scale": round(float(scale[i]), 4), "fitted": bool(vote_n[i] >= min_records)})
    out = {"match": list(edges), "first": [round(float(x), 4) for x in c1], "accept": [round(float(x), 4) for x in c],
           "vote": [float(v) for v in vote_edges], "vote_scale": [round(float(x), 4) for x in scale]}
    return out, report


def _ratio(acc: np.ndarray, pred: np.ndarray, bucket: np.ndarray, n: int, default: np.ndarray) -> np.ndarray:
    """[n] accepted slots over predicted acceptance per bucket (the ratio estimate); `default`
    where a bucket has no slots."""
    num = np.bincount(bucket, weights=acc, minlength=n)
    den = np.bincount(bucket, weights=pred, minlength=n)
    return np.where(den > 0, num / np.maximum(den, 1e-12), default)


def vote_scale(raw: np.ndarray, fitted: np.ndarray) -> np.ndarray:
    """Scales per vote bucket made non-decreasing in the share and 1 at the top: each bucket
    without enough slots takes the nearest fitted bucket above it (1 above the last), a running
    maximum orders them, and all are divided by the top bucket's."""
    out = np.ones_like(raw)
    nxt = 1.0
    for i in range(len(raw) - 1, -1, -1):
        nxt = raw[i] if fitted[i] else nxt
        out[i] = nxt
    out = np.maximum.accumulate(np.clip(out, 1e-3, None))
    return np.minimum(out / out[-1], 1.0)


def _log_loss(acc: np.ndarray, pred: np.ndarray) -> float:
    p = np.clip(pred, 1e-4, 1 - 1e-4)
    return float(-(acc * np.log(p) + (1 - acc) * np.log(1 - p)).mean())


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
                          dtype: str = "auto", temperature: float = 0.0, seed: int = 0) -> list[dict]:
    """Trace records of static suffix drafting (every row drafts its full suffix draft) on
    `prompts` (token ids) at `temperature` (0: greedy), through the real engine without a
    drafter."""
    from workers.engine import Engine, EngineConfig
    from workers.request import DecodeKnobs, SamplingParams
    from workers.traces import ListTraceSink

    sink = ListTraceSink()
    longest = max(map(len, prompts))
    engine = Engine(EngineConfig(target=str(target), drafter=None, dtype=dtype, max_batch=batch,
                                 max_len=longest + max_tokens + 32), trace_sink=sink)
    knobs = DecodeKnobs(draft_len=engine.width, source="suffix")
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        while pending and engine.free_slots > len(engine.waiting):
            i, ids = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
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
    p.add_argument("--temperatures", default="0,0.8",
                   help="collect at each of these temperatures (0: greedy); greedy and sampled rows get their own tables")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--traces", type=Path, default=None, help="also write the traces here (JSON Lines)")
    p.add_argument("--from-traces", type=Path, default=None,
                   help="fit from these traces (JSON Lines, e.g. an earlier --traces) instead of collecting new ones")
    args = p.parse_args(argv)
    if args.from_traces is not None:
        return _write_table(TraceTable.read(args.from_traces), args, source=str(args.from_traces))
    import torch

    from adapt.bench.workloads import make_workload
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
    records = [r for t in parse_temperatures(args.temperatures)
               for r in collect_suffix_traces(pair.target, prompts, args.max_tokens, temperature=t)]
    if args.traces:
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        args.traces.write_text("".join(json.dumps(r) + "\n" for r in records))
    return _write_table(TraceTable.from_records(records), args, source="collected")


def parse_temperatures(text: str) -> list[float]:
    """``"0,0.8"`` → [0.0, 0.8]; a clear error for anything else."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(t < 0 for t in out):
        raise SystemExit(f"--temperatures: expected comma-separated numbers >= 0, got {text!r}")
    return out


def _write_table(table: TraceTable, args, source: str) -> int:
    """Fit the table on `table`'s suffix records and write it into ``args.policy_file``."""
    import json

    from adapt.policy_file import load, save

    fitted, report = fit_suffix_accept(table)
    if fitted is None:
        raise SystemExit(f"no suffix drafts in the traces ({source})")
    policy = load(args.policy_file)
    policy.settings = dict(policy.settings, suffix_accept=fitted)
    policy.version, policy.created = "", 0.0  # a new version
    policy.report = dict(policy.report, suffix=dict(report, workloads=args.workloads, count=args.count,
                                                     max_tokens=args.max_tokens, temperatures=args.temperatures,
                                                     split="train", traces=source))
    version = save(policy, args.policy_file)
    summary = {"suffix_accept": fitted, "records": report["records"], "log_loss": report["log_loss"],
               "log_loss_without_vote": report["log_loss_without_vote"], "version": version}
    if "sampled" in report:
        summary["sampled"] = {k: report["sampled"][k] for k in ("records", "log_loss", "log_loss_without_vote")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
