"""A per-step log of the adaptive policy's choices and what each step took, live, beside `ar`.

One interleaved round (adapt/bench/interleave.py) per ``--rounds`` of `ar` and the adaptive policy
on the mixed workload at ``--load`` requests (the `adapt bench ab` scenario: 2 x load
requests, 64 ± 50 % tokens, SLA targets from the start-up profile or ``--sla-ms``). For every
step the adaptive policy decides it records the batch size, the rows drafting by diffusion and by
suffix copy, their weights and lateness against the batch's, how many rows are behind their
target, λ, and the step's outcome: wall ms, positions verified, accepted drafts, the cost
table's prediction and the decision's ms (EMA). The summary prints tokens per ms of plain and
drafting steps by batch size: where drafting steps earn fewer tokens per ms than plain ones, the
policy drafts where it should not. Settings of the adaptive policy: ``--set key=value``. With
``--baseline suffix`` static suffix drafting runs beside it instead of `ar`, and the same summary
is printed for its steps.
Each adaptive step also records how many rows were offered a suffix draft and their lengths
(``suffix_offered``, ``suffix_lengths``), each baseline step its batch size and drafting rows
(``baseline_steps``): per state (how many rows could copy) the two policies' tokens per ms side by
side. Warm-up runs are not logged. ``--instances``: round r serves its own instance of the
scenario (`adapt.bench.interleave.scenario_instance`).

    python -m adapt.bench.instruments.step_log --load 32 --rounds 1 --sla-ms 39.2 --out /tmp/steps-32.json

(It showed, at 32 requests, drafting steps earning 0.21 tokens/ms against 0.35 for plain steps,
which `sla_reach` answers.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workload", default="mixed")
    p.add_argument("--baseline", default="ar", choices=("ar", "suffix"), help="the static policy beside it")
    p.add_argument("--sla-ms", type=float, default=None, help="the tight TPOT target (the loose one is 4x)")
    p.add_argument("--set", action="append", default=[], help="an adaptive setting, key=JSON value")
    p.add_argument("--policy-file", default=str(Path(__file__).resolve().parents[3] / "models/smollm2/policy.json"))
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

    import policies.adaptive as adaptive
    from adapt.bench.interleave import engine_copies, run_interleaved, scenario_instance
    from adapt.bench.live import run_live
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.bench.evaluation import evaluation_mix, profiled_policy_file, tight_tpot_ms
    from adapt.controller import build_policy
    from adapt.replay import Scenario
    from policies.base import rows_per_pass

    torch.set_num_threads(2)
    engine, prompts = workload_engine("smollm2", args.workload, args.load, 97, compile="aot")
    pf = profiled_policy_file(args.policy_file, engine)
    K = engine.block
    t1 = args.sla_ms or tight_tpot_ms(pf.cost, K)
    mix = evaluation_mix(pf.cost, K, max(24, 2 * args.load), tight_ms=t1)
    log: list[dict] = []

    class Logged(adaptive.AdaptivePolicy):
        def _steps(self, rows, ctx):
            steps = super()._steps(rows, ctx)
            w, late, s = self.weights(ctx).cpu(), ctx["lateness"].cpu(), steps.cpu()
            drafting = s != 0
            n = getattr(rows, "suffix_len", None)
            log.append({"B": len(rows.request_ids), "diffusion_rows": int((s > 0).sum()), "suffix_rows": int((s < 0).sum()),
                        "suffix_offered": None if n is None else int((n > 0).sum()),
                        "suffix_lengths": None if n is None else n.tolist(),
                        "weight_drafting": float(w[drafting].mean()) if drafting.any() else None,
                        "weight_all": float(w.mean()), "lateness_all": float(late.mean()),
                        "lateness_drafting": float(late[drafting].mean()) if drafting.any() else None,
                        "rows_behind": int((late > 1).sum()), "lambda": float(self.threshold), "t": time.perf_counter()})
            return steps

        def observe(self, rows, outcome):
            if log and "ms" not in log[-1]:  # the outcome of the latest decided step (held steps skipped)
                predicted = (float(self.cost.step_ms_at(float(outcome.num_tokens), rows_per_pass(self.last_steps)))
                             if self.last_steps is not None else None)
                log[-1].update({"ms": 1e3 * outcome.step_time, "positions": int(outcome.num_tokens),
                                "accepted": int(outcome.accepted.sum()), "verified": int(outcome.verified.sum()),
                                "predicted_ms": predicted, "decision_ms": self.cadence.decide_ms})
            return super().observe(rows, outcome)

    from adapt.bench.live import KnobsBaseline

    class LoggedBaseline(KnobsBaseline):
        """The baseline, its steps' outcomes logged in `base_log` (B, positions, accepted, ms)."""

        def observe(self, rows, outcome):
            base_log.append({"B": len(rows.request_ids), "ms": 1e3 * outcome.step_time,
                             "positions": int(outcome.num_tokens), "accepted": int(outcome.accepted.sum()),
                             "verified": int(outcome.verified.sum()), "drafting_rows": int((outcome.verified > 0).sum())})

    base_log: list[dict] = []
    engines = engine_copies(engine, 2)
    rounds = []
    for r in range(args.rounds):
        kwargs = {"steps_grid": tuple(pf.settings.get("steps_grid", (1,))), **settings}
        policy = build_policy("adaptive", pf, **kwargs)
        policy.__class__ = Logged  # the same policy, its steps and outcomes logged
        base = make_policy(args.baseline, pf, steps_grid=(1,), width=K)
        base.__class__ = LoggedBaseline
        pair = [base, policy] if r % 2 == 0 else [policy, base]
        served, seed = scenario_instance(prompts, r, len(mix), vary=args.instances)
        for e, pol in zip(engines, pair):  # warm-up runs, their steps not logged
            run_live(e, pol, Scenario("warm", min(args.load, 4), mix[:4]), served, seed=seed)
        start, base_start = len(log), len(base_log)
        measured = run_interleaved(engines, pair, Scenario("mix", args.load, mix), served, seed=seed)
        m_base, m_ad = measured if r % 2 == 0 else measured[::-1]
        steps = log[start:]
        rounds.append({args.baseline: {k: m_base[k] for k in ("goodput_tok_s", "sla_attainment")},
                       "baseline_summary": summary(base_log[base_start:]),
                       "adaptive": {k: m_ad.get(k) for k in ("goodput_tok_s", "sla_attainment", "source_share")},
                       "summary": summary(steps), "steps": steps, "baseline_steps": base_log[base_start:]})
        print(f"round {r}: {args.baseline} {m_base['goodput_tok_s']:.1f} tok/s, SLA {m_base['sla_attainment']:.3f}; adaptive "
              f"{m_ad['goodput_tok_s']:.1f} tok/s, SLA {m_ad['sla_attainment']:.3f}", flush=True)
        for line in rounds[-1]["summary"]:
            print("  adaptive " + line, flush=True)
        for line in rounds[-1]["baseline_summary"]:
            print(f"  {args.baseline} " + line, flush=True)
    Path(args.out).write_text(json.dumps({"load": args.load, "sla_ms": [t1, 4 * t1], "settings": settings,
                                          "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
