"""A per-step log of the adaptive policy's choices and what each step took, live, beside `ar`.

One interleaved round (adapt/bench/interleave.py) per ``--rounds`` of `ar` and the adaptive policy
on the mixed workload at ``--load`` requests (the `adapt bench ab` scenario: ``--requests``
requests, at least 2 x load, 64 ± 50 % tokens, SLA targets from the start-up profile or ``--sla-ms``). For every
step the adaptive policy decides it records the batch size, the rows drafting by diffusion and by
suffix copy, their weights and lateness against the batch's, how many rows are behind their
target, λ, and the step's outcome: wall ms, positions verified, accepted drafts, the cost
table's prediction and the decision's ms (EMA), the longest row's context, and for the rows drafting by
diffusion the extra tokens the plan expected of them and what they won. The summary prints tokens per ms of plain and
drafting steps by batch size: where drafting steps earn fewer tokens per ms than plain ones, the
policy drafts where it should not. Settings of the adaptive policy: ``--set key=value``. With
``--baseline suffix`` static suffix drafting runs beside it instead of `ar`, and the same summary
is printed for its steps.
Each adaptive step also records how many rows were offered a suffix draft and their lengths
(``suffix_offered``, ``suffix_lengths``), each baseline step its batch size and drafting rows
(``baseline_steps``): per state (how many rows could copy) the two policies' tokens per ms side by
side. Warm-up runs are not logged. ``--instances``: round r serves its own instance of the
scenario (`adapt.bench.interleave.scenario_instance`). ``--pair demo --compile off`` runs it on
the tiny demo pair (its test does).

How it sees the steps, without patching either policy: the adaptive policy is wrapped
(`LoggedAdaptive`, a `wrapped_decisions.DelegatingDecisions`), which reads the policy's weights,
lateness and λ of each step it decides right after `before_draft` and the cost table's
prediction right before `observe` learns from the step; the baseline's steps come from an
observer on its engine (`BaselineSteps`, `Engine.observers`).

    python -m adapt.bench.instruments.step_log --load 32 --rounds 1 --sla-ms 39.2 --out /tmp/steps-32.json

(It showed, at 32 requests, drafting steps earning 0.21 tokens/ms against 0.35 for plain steps,
which `sla_reach` answers.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from adapt.bench.instruments.wrapped_decisions import DelegatingDecisions
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE, SUFFIX_CODE

ROOT = Path(__file__).resolve().parents[3]  # the repository


class LoggedAdaptive(DelegatingDecisions):
    """The adaptive policy's decisions, unchanged, each decided step logged into ``log``: right
    after `before_draft` the rows drafting by diffusion and by suffix copy (the policy's answer,
    before the engine applies pins), the rows offered a suffix draft, the weights and lateness
    of the step's context and λ (``threshold``); right before `observe`, the step's outcome and
    the cost table's prediction for it (before `observe` moves the table). Held steps (the
    policy's cadence holds a plain decision: no weights computed) are not logged."""

    def __init__(self, inner, log: list[dict]):
        super().__init__(inner)
        self.log = log

    def before_draft(self, rows):
        p = self.inner
        held = p.cadence.held_steps
        intent = p.before_draft(rows)
        if p.cadence.held_steps == held and len(rows.request_ids):  # a decided step
            ctx = p._ctx(rows, rows.temperature.device)  # the step's context, as the policy cached it
            w, late, source = p.weights(ctx).cpu(), ctx["lateness"].cpu(), intent.source.cpu()
            drafting = source != NONE_CODE
            diffusing = source == DIFFUSION_CODE
            plan = p._plan  # the plan's expected extra tokens of each diffusion row (after the online ratio)
            planned = None  # none: no diffusion row, a plan of other rows, or rows drafting unplanned (inf)
            if bool(diffusing.any()) and plan is not None and plan.key == tuple(rows.request_ids):
                total = float(plan.extra[diffusing].sum())
                planned = total if math.isfinite(total) else None
            n = rows.suffix_len
            self.log.append({"B": len(rows.request_ids), "diffusion_rows": int(diffusing.sum()),
                             "context": int(rows.position.max()), "diffusing": diffusing.tolist(),
                             "diffusion_predicted": planned,
                             "suffix_rows": int((source == SUFFIX_CODE).sum()),
                             "suffix_offered": None if n is None else int((n > 0).sum()),
                             "suffix_lengths": None if n is None else n.tolist(),
                             "weight_drafting": float(w[drafting].mean()) if drafting.any() else None,
                             "weight_all": float(w.mean()), "lateness_all": float(late.mean()),
                             "lateness_drafting": float(late[drafting].mean()) if drafting.any() else None,
                             "rows_behind": int((late > 1).sum()), "lambda": float(p.threshold), "t": time.perf_counter()})
        return intent

    def observe(self, record) -> None:
        from policies.base import rows_per_pass

        if self.log and "ms" not in self.log[-1]:  # the outcome of the latest decided step (held steps skipped)
            outcome, p = record.outcome, self.inner
            predicted = float(p.cost.step_ms_at(float(outcome.num_tokens), rows_per_pass(record.intent.steps)))
            entry = self.log[-1]
            if entry["diffusion_predicted"] is not None:  # what the diffusion rows won
                entry["diffusion_won"] = sum(a for a, d in zip(outcome.accepted.tolist(), entry["diffusing"]) if d)
            entry.update({"ms": 1e3 * outcome.step_time, "positions": int(outcome.num_tokens),
                                 "accepted": int(outcome.accepted.sum()), "verified": int(outcome.verified.sum()),
                                 "predicted_ms": predicted, "decision_ms": p.cadence.decide_ms})
        return self.inner.observe(record)


class BaselineSteps:
    """An engine observer (`Engine.observers`) logging each decode step into ``log``: batch size,
    wall ms, positions verified, accepted drafts, verified drafts, rows that drafted."""

    def __init__(self, log: list[dict]):
        self.log = log

    def on_step(self, record) -> None:
        o = record.outcome
        self.log.append({"B": len(record.rows.request_ids), "ms": 1e3 * o.step_time, "positions": int(o.num_tokens),
                         "accepted": int(o.accepted.sum()), "verified": int(o.verified.sum()),
                         "drafting_rows": int((o.verified > 0).sum())})

    def on_prefill(self, seconds: float, rows: int) -> None:
        return None


def summary(steps: list[dict]) -> list[str]:
    """Lines: per batch-size band, plain and drafting steps' count, ms, tokens and tokens per ms."""
    lines = []
    for lo, hi in ((1, 8), (8, 16), (16, 28), (28, 10**6)):
        band = [s for s in steps if lo <= s["B"] < hi and "ms" in s]
        for name, group in (("plain", [s for s in band if s["verified"] == 0]),
                            ("drafting", [s for s in band if s["verified"] > 0])):
            if group:
                ms = sum(s["ms"] for s in group)
                tokens = sum(s["B"] + s["accepted"] for s in group)
                lines.append(f"rows {lo}-{min(hi - 1, 999)} {name:8s}: {len(group):4d} steps, "
                             f"{ms / len(group):6.1f} ms, {tokens / len(group):5.1f} tokens, "
                             f"{tokens / ms:.3f} tokens/ms, {statistics.mean(s['positions'] for s in group):6.1f} positions")
    return lines


def diffusion_calibration(steps: list[dict], long_context: int = 1024) -> list[str]:
    """Lines: per context (the longest row's, under and from ``long_context`` positions), the
    adaptive policy's diffusion drafts (rows x steps), the extra tokens its plan expected of them
    and what they won, per draft. Where they win less than the plan expects, the plan drafts where
    it should not (on SmolLM2's ~1,800-token documents: 0.71 expected, 0.34 won)."""
    lines = []
    for name, inside in (("short", lambda s: s["context"] < long_context), ("long", lambda s: s["context"] >= long_context)):
        group = [s for s in steps if s.get("diffusion_won") is not None and inside(s)]
        if group:
            drafts = sum(s["diffusion_rows"] for s in group)
            lines.append(f"{name} contexts: {drafts} diffusion drafts, expected "
                         f"{sum(s['diffusion_predicted'] for s in group) / drafts:.2f} extra tokens each, "
                         f"won {sum(s['diffusion_won'] for s in group) / drafts:.2f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--compile", default="aot", choices=("off", "aot"))
    p.add_argument("--load", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--requests", type=int, default=24, help="requests per round (at least 2 x load)")
    p.add_argument("--workload", default="mixed")
    p.add_argument("--baseline", default="ar", choices=("ar", "suffix"), help="the static policy beside it")
    p.add_argument("--sla-ms", type=float, default=None, help="the tight TPOT target (the loose one is 4x)")
    p.add_argument("--set", action="append", default=[], help="an adaptive setting, key=JSON value")
    p.add_argument("--policy-file", default=None, help="default: the pair's models/<pair>/policy.json")
    p.add_argument("--instances", action="store_true",
                   help="round r serves its own instance of the scenario (adapt.bench.interleave.scenario_instance)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from adapt.bench.settings_text import parse_settings

    try:
        settings = parse_settings(args.set)
    except ValueError as e:
        p.error(str(e))

    import torch

    from adapt.bench.interleave import engine_copies, run_interleaved, scenario_instance
    from adapt.bench.live import run_live
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.bench.evaluation import evaluation_mix, profiled_policy_file, tight_tpot_ms
    from adapt.controller import build_policy
    from adapt.replay import Scenario

    torch.set_num_threads(2)
    engine, prompts = workload_engine(args.pair, args.workload, args.load, 97, compile=args.compile)
    pf = profiled_policy_file(args.policy_file or ROOT / "models" / args.pair / "policy.json", engine)
    K = engine.block
    t1 = args.sla_ms or tight_tpot_ms(pf.cost, K)
    mix = evaluation_mix(pf.cost, K, max(args.requests, 2 * args.load), tight_ms=t1)
    log: list[dict] = []
    base_log: list[dict] = []
    engines = engine_copies(engine, 2)
    rounds = []
    for r in range(args.rounds):
        kwargs = {"steps_grid": tuple(pf.settings.get("steps_grid", (1,))), **settings}
        policy = LoggedAdaptive(build_policy("adaptive", pf, **kwargs), log)
        base = make_policy(args.baseline, pf, steps_grid=(1,), width=K)
        pair = [base, policy] if r % 2 == 0 else [policy, base]
        served, seed = scenario_instance(prompts, r, len(mix), vary=args.instances)
        for e, pol in zip(engines, pair):  # warm-up runs, their steps not logged
            run_live(e, pol, Scenario("warm", min(args.load, 4), mix[:4]), served, seed=seed)
        start, base_start = len(log), len(base_log)
        base_engine, watch = engines[pair.index(base)], BaselineSteps(base_log)
        base_engine.observers.append(watch)
        try:
            measured = run_interleaved(engines, pair, Scenario("mix", args.load, mix), served, seed=seed)
        finally:
            base_engine.observers.remove(watch)
        m_base, m_ad = measured if r % 2 == 0 else measured[::-1]
        steps = log[start:]
        rounds.append({args.baseline: {k: m_base[k] for k in ("goodput_tok_s", "sla_attainment")},
                       "baseline_summary": summary(base_log[base_start:]),
                       "adaptive": {k: m_ad.get(k) for k in ("goodput_tok_s", "sla_attainment", "source_share")},
                       "summary": summary(steps), "diffusion_calibration": diffusion_calibration(steps), "steps": steps, "baseline_steps": base_log[base_start:]})
        print(f"round {r}: {args.baseline} {m_base['goodput_tok_s']:.1f} tok/s, SLA {m_base['sla_attainment']:.3f}; adaptive "
              f"{m_ad['goodput_tok_s']:.1f} tok/s, SLA {m_ad['sla_attainment']:.3f}", flush=True)
        for line in rounds[-1]["summary"] + rounds[-1]["diffusion_calibration"]:
            print("  adaptive " + line, flush=True)
        for line in rounds[-1]["baseline_summary"]:
            print(f"  {args.baseline} " + line, flush=True)
    Path(args.out).write_text(json.dumps({"load": args.load, "sla_ms": [t1, 4 * t1], "settings": settings,
                                          "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
