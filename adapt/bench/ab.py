"""`adapt bench ab`: an A/B of adaptive-policy settings, live through the engine, in one run.

Runs `ar`, `suffix` (``--static`` adds or replaces static configurations, e.g. ``static-4``:
diffusion drafts of 4 tokens every step) and the adaptive policy with each `--variant` of its settings (and the
policy file's own settings as `adaptive`) on one pair and workload, at each load, every round in
a rotated order; a row is its median-goodput round. The project keeps a heuristic of the policy
only where such an A/B shows it helps beyond the noise. Example (does holding decisions pay?):

    adapt bench ab --pair smollm2 --workload mixed --loads 1,2,8 --rounds 3 --interleave --compile aot \
        --policy-file models/smollm2/policy.json --variant nohold:hold_max=0 --out runs/ab/hold.json

It writes the rows as JSON (``--out``) and a plot beside it (same name, ``.png``: goodput per policy
and load, a dot per round, SLA attainment over each bar).

Round r serves its own instance of the scenario (the prompt list rotated by r times the requests,
seed r for sampled requests: `adapt.bench.interleave.scenario_instance`), so that rounds sample
the scenario as well as the machine's noise; ``--no-instances`` serves the same one every round.

``--admission all,sla`` runs every policy under each engine admission mode (workers/admission.py;
rows named ``NAME+sla``). Every adaptive row (and variant) also gets its **paired ratio**: in each
round, its goodput over the best static row's (``ar``, ``suffix``) of the same round and
admission mode, whose runs were minutes apart; ``paired_ratio`` is their median. The machine's
speed drifts between rounds (one policy's rounds differed by up to 20 %), and a ratio within a
round cancels most of that drift, where a ratio of per-policy medians does not.

``--interleave`` runs each round's rows side by side instead (adapt/bench/interleave.py): one
engine per policy, the runs taking turns one engine step at a time, each timed by a clock that
runs only during its own turns, so that every row of a round meets the same drift. There a
variant may also change its own engine: keys ``engine.FIELD`` set that `EngineConfig` field of
its engine (e.g. ``--variant pad:engine.aot_pad=true``: the adaptive policy on an engine that pads
few-token calls, beside the same policy on the default engine), and its policy plans with a
start-up profile of that engine (`profile_engine`), as a worker of that config would. Keys
``profile.ARG`` give that variant's policy its own start-up profile of its engine, taken with
`profile_engine` argument ARG (e.g. ``--variant fine:profile.token_grid=@grid.json``, a JSON list).
``--static-variant NAME:base=STATIC,engine.FIELD=value`` runs a static configuration on an engine of
its own config and counts it among the static configurations every paired ratio takes the best of
(e.g. ``suffix-pad:base=suffix,engine.aot_pad=true``: static suffix drafting with padded few-token
calls).

Goodput, SLA attainment, mean TTFT, the median round's requests (``per_request``), decision ms
per step, held share (adaptive), the two SLA targets (``sla_ms``: tight and loose, ``--sla-ms``), draft sources and (adaptive) the suffix calibration (mean
predicted against measured step ms of its suffix choices, per kind, `plan` or `wide`, and batch
bucket) and suffix acceptance (drafts taken, the online ratio; `AdaptivePolicy.stats`) are
written as JSON, one row per (load, policy), with every round's goodput, SLA attainment, draft
sources and suffix statistics under ``rounds``; (adaptive) also the plan's diffusion recalibration
(``diffusion_accept``: drafts, the ratio per temperature class and step count) and what each kind
of step took beyond the cost tables (``step_residual``, per batch bucket).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from adapt.bench.policies import BASELINES  # the static configurations a run may compare with
from adapt.bench.settings_text import parse_variant


STATIC = ("ar", "suffix")  # the default static configurations every adaptive row is compared with
ROUND_KEYS = ("goodput_tok_s", "sla_attainment", "source_share", "suffix_accept", "suffix_calibration",
              "diffusion_accept", "step_residual")  # kept per round


def _static_len(name: str) -> int | None:
    """K of a ``static-K`` name (diffusion drafts of K tokens, one step), else None."""
    head, _, k = name.partition("-")
    return int(k) if head == "static" and k.isdigit() and int(k) >= 1 else None


def paired_ratios(runs: dict[str, list[dict]], name: str, baselines=STATIC) -> list[float]:
    """Per round, ``name``'s goodput over the best static policy's (of ``baselines``) in the same
    round and admission mode (``runs``: policy name -> its runs, in round order)."""
    mode = name.partition("+")[2]
    static = [s if not mode else f"{s}+{mode}" for s in baselines]
    return [r["goodput_tok_s"] / max(max(runs[s][i]["goodput_tok_s"] for s in static if s in runs), 1e-9)
            for i, r in enumerate(runs[name])]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ab", help="A/B of adaptive-policy settings against static configurations, live (JSON + plot)",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(run=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    p.add_argument("--workload", default="mixed")
    p.add_argument("--policy-file", required=True)
    p.add_argument("--loads", default="1,4,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="requests ask for max_tokens * (1 +- spread) tokens, evenly spread (adapt.replay.make_mix)")
    p.add_argument("--static", default=",".join(STATIC),
                   help="the static configurations to run and compare with, comma-separated, of "
                        + ", ".join(BASELINES) + ", or static-K (static: diffusion drafts of 16 tokens, one step; static-K: K tokens)")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:key=value,... (adaptive settings; keys engine.FIELD set that run's own engine's "
                        "EngineConfig field instead, e.g. engine.aot_pad=true; needs --interleave)")
    p.add_argument("--static-variant", action="append", default=[],
                   help="NAME:base=STATIC,engine.FIELD=value,... a static configuration (of --static's names) on an "
                        "engine of its own config, compared with as a static configuration too, e.g. "
                        "suffix-pad:base=suffix,engine.aot_pad=true; needs --interleave")
    p.add_argument("--admission", default="all",
                   help="engine admission modes, comma-separated (workers/admission.py); every policy runs under "
                        "each, named NAME+MODE for modes other than 'all'")
    p.add_argument("--admission-max-wait-ms", type=float, default=1000.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sla-ms", type=float, default=None,
                   help="the tight per-token latency target in ms (the loose one is 4x); default: one profiled "
                        "step of K + 1 tokens at batch 1 on this run's engine, which moves with the machine's load "
                        "at start-up, so give a fixed value to compare SLA attainment across runs")
    p.add_argument("--interleave", action="store_true",
                   help="one engine per policy, all runs of a round taking turns step by step, each timed by "
                        "its own clock (adapt/bench/interleave.py): the machine's drift is shared by every row")
    p.add_argument("--compile", default="off", choices=("off", "aot"),
                   help="the engines' decode steps: eager, or the compiled package (workers/aot.py; built first "
                        "when missing)")
    p.add_argument("--aot-pad", default="off", choices=("on", "off"),
                   help="with --compile aot: pad few-token decode calls where measured faster (EngineConfig.aot_pad, "
                        "default off as the engine's)")
    p.add_argument("--instances", action=argparse.BooleanOptionalAction, default=True,
                   help="round r serves its own instance of the scenario: the prompt list rotated by r times the "
                        "requests per round, seed r for the sampled requests' generators "
                        "(adapt.bench.interleave.scenario_instance; --no-instances: every "
                        "round the same instance, so rounds replicate the machine's noise and not the scenario's)")
    p.add_argument("--out", required=True, help="the JSON rows to write (the plot goes beside it, .png)")


def main(argv=None) -> int:
    """`python -m adapt.bench.ab ARGS`: the same as `adapt bench ab ARGS`."""
    p = argparse.ArgumentParser(prog="adapt bench ab", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def _usage_error(message: str) -> None:
    """Exit 2 with ``message``, as argparse does for a bad option."""
    print(f"adapt bench ab: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run(args) -> int:
    baselines = [x.strip() for x in args.static.split(",") if x.strip()]
    if not baselines or any(_static_len(b) is None and b not in BASELINES for b in baselines):
        _usage_error(f"--static: names of {', '.join(BASELINES)} or static-K (K drafted tokens), got {args.static!r}")
    if args.sla_ms is not None and not args.sla_ms > 0:
        _usage_error(f"--sla-ms must be positive, got {args.sla_ms}")
    try:
        variants = dict(parse_variant(v) for v in args.variant)
        static_variants = dict(parse_variant(v, text_keys=("base",)) for v in args.static_variant)
    except ValueError as e:
        _usage_error(str(e))
    for n, st in static_variants.items():
        bad = [k for k in st if k != "base" and not k.startswith("engine.")]
        if st.get("base") not in BASELINES and _static_len(str(st.get("base"))) is None or bad:
            _usage_error(f"--static-variant {n}: base=STATIC (of {', '.join(BASELINES)} or static-K) and engine.FIELD "
                    f"keys only, got {st}")
    if static_variants and not args.interleave:
        _usage_error("--static-variant needs --interleave (a run of its own engine)")
    # engine.FIELD keys: that variant's own engine's config (with --interleave, where each run has one);
    # profile.ARG keys: that variant plans with its own profile of its engine (`profile_engine` ARG)
    engine_settings = {n: {k.partition(".")[2]: v for k, v in st.items() if k.startswith("engine.")}
                       for n, st in variants.items()}
    profile_settings = {n: {k.partition(".")[2]: v for k, v in st.items() if k.startswith("profile.")}
                        for n, st in variants.items()}
    variants = {n: {k: v for k, v in st.items() if not k.startswith(("engine.", "profile."))} for n, st in variants.items()}
    engine_settings.update({n: {k.partition(".")[2]: v for k, v in st.items() if k.startswith("engine.")}
                            for n, st in static_variants.items()})
    baselines += list(static_variants)
    if any(engine_settings.values()) and not args.interleave:
        _usage_error("--variant with engine.FIELD settings needs --interleave (a run of its own engine)")

    import torch

    from adapt.bench.interleave import engine_copies, rotated_engines, run_round, scenario_instance
    from adapt.bench.policies import make_policy, workload_engine
    from adapt.controller import build_policy, profile_engine
    from adapt.cost_model import CostModel
    from adapt.bench.evaluation import evaluation_mix, profiled_policy_file, tight_tpot_ms
    from adapt.replay import Scenario

    torch.set_num_threads(args.threads)
    loads = [int(x) for x in args.loads.split(",")]
    longest = round(args.max_tokens * (1.0 + args.length_spread)) + 1
    engine, prompts = workload_engine(args.pair, args.workload, max(loads), longest, compile=args.compile,
                                      aot_pad=args.aot_pad == "on")
    pf = profiled_policy_file(args.policy_file, engine)
    K = engine.block
    t1 = args.sla_ms if args.sla_ms is not None else tight_tpot_ms(pf.cost, K)
    grid = tuple(pf.settings.get("steps_grid", (1,)))

    def make(name):
        name = static_variants.get(name, {}).get("base", name)  # a static variant runs its base's policy
        k = _static_len(name)
        if k is not None:
            return build_policy("static", pf, draft_len=k)
        if name in variants:
            own = {"cost": CostModel.from_dict(own_cost[name].to_dict())} if name in own_cost else {}
            # a variant may set its own grid; one with its own engine plans with that engine's profile
            return build_policy("adaptive", pf, **{"steps_grid": grid, **variants[name], **own})
        return make_policy(name, pf, steps_grid=grid, width=K)

    modes = [m.strip() for m in args.admission.split(",") if m.strip()]
    base = [*baselines, "adaptive", *variants]
    names = [n if m == "all" else f"{n}+{m}" for m in modes for n in base]
    rows = []
    engine.config.admission_max_wait_ms = args.admission_max_wait_ms
    # interleaved: an engine per policy (each with its own model copy); else one engine, runs in turn
    # (variants with engine.FIELD settings get an engine of that config instead, below)
    shared = [n for n in names if not engine_settings.get(n.partition("+")[0])]
    engines = dict(zip(shared, engine_copies(engine, len(shared)) if args.interleave else [engine] * len(shared)))
    own_cost = {}  # variant -> the start-up profile of its own engine (as a worker profiles its own)
    for n in names:
        own = engine_settings.get(n.partition("+")[0])
        if own:
            from workers.engine import Engine

            engines[n] = Engine(dataclasses.replace(engine.config, **own))
        profile = profile_settings.get(n.partition("+")[0])
        if (own or profile) and n.partition("+")[0] in variants:  # a static variant plans nothing
            own_cost[n.partition("+")[0]] = profile_engine(engines[n], **(profile or {}))

    def with_stats(policy, m):
        st = policy.stats() if hasattr(policy, "stats") else {}
        m.update({key: st.get(key) for key in ("held_share", "suffix_calibration", "suffix_accept", "diffusion_accept",
                                                 "step_residual")})
        return m

    for c in loads:
        mix = evaluation_mix(pf.cost, K, max(24, 2 * c), max_tokens=args.max_tokens, length_spread=args.length_spread,
                             tight_ms=t1)
        runs = {n: [] for n in names}
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            served, seed = scenario_instance(prompts, rnd, len(mix), vary=args.instances)
            on = rotated_engines(engines, shared, rnd) if args.interleave else engines
            # one after another, each policy under its own admission mode on the shared engine; or all side by side
            for group in ([order] if args.interleave else [[n] for n in order]):
                made = []
                for n in group:
                    name, _, mode = n.partition("+")
                    made.append(make(name))
                    on[n].admission = mode or "all"
                measured = run_round([on[n] for n in group], made, Scenario("warm", min(c, 4), mix[:4]),
                                     Scenario("mix", c, mix), served, interleave=args.interleave, seed=seed)
                for n, policy, m in zip(group, made, measured):
                    runs[n].append(with_stats(policy, m))
        for n in names:
            ordered = sorted(runs[n], key=lambda m: m["goodput_tok_s"])
            m = ordered[len(ordered) // 2]
            rows.append({"pair": args.pair, "workload": args.workload, "load": c, "policy": n, "compile": args.compile,
                         "length_spread": args.length_spread, "sla_ms": [round(t1, 1), round(4 * t1, 1)],
                         "instances": args.instances,
                         "admission": n.partition("+")[2] or "all",
                         "settings": variants.get(n, {}), "engine": engine_settings.get(n.partition("+")[0], {}),
                         "goodput_tok_s": round(m["goodput_tok_s"], 1),
                         "goodput_rounds": [round(r["goodput_tok_s"], 1) for r in runs[n]],
                         "sla_attainment": round(statistics.mean(r["sla_attainment"] for r in runs[n]), 3),
                         "decision_ms_per_step": round(m.get("decision_ms_per_step", float("nan")), 3),
                         "held_share": m["held_share"], "source_share": m.get("source_share"),
                         "prefill_stall_share": round(statistics.mean(r["prefill_stall_share"] for r in runs[n]), 3),
                         "sla_without_stalls": round(statistics.mean(r["sla_attainment_without_stalls"]
                                                                     for r in runs[n]), 3),
                         "ttft_ms_mean": round(statistics.mean(r["ttft_ms_mean"] for r in runs[n]), 1),
                         "per_request": m["per_request"],
                         "suffix_calibration": m["suffix_calibration"], "suffix_accept": m["suffix_accept"],
                         "diffusion_accept": m.get("diffusion_accept"),
                         # every round's own (a slow round's choices differ from the median one's)
                         "rounds": [{key: r.get(key) for key in ROUND_KEYS} for r in runs[n]]})
            if n.partition("+")[0] not in baselines:
                ratios = paired_ratios(runs, n, baselines)
                rows[-1].update(paired_ratio_rounds=[round(x, 3) for x in ratios],
                                paired_ratio=round(statistics.median(ratios), 3))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(rows: list[dict], png: Path) -> None:
    """Goodput per policy and load: a bar at each policy's median round, a dot per round, the SLA
    attainment over each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted({r["load"] for r in rows})
    names = list(dict.fromkeys(r["policy"] for r in rows))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(loads) * len(names) ** 0.5), 4))
    for i, name in enumerate(names):
        for j, load in enumerate(loads):
            row = next((r for r in rows if r["policy"] == name and r["load"] == load), None)
            if row is None:
                continue
            x = j + (i - (len(names) - 1) / 2) * width
            ax.bar(x, row["goodput_tok_s"], width, color=f"C{i % 10}", label=name if j == 0 else None)
            ax.plot([x] * len(row["goodput_rounds"]), row["goodput_rounds"], "k.", ms=4)
            ax.text(x, row["goodput_tok_s"], f"{row['sla_attainment']:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(loads)), [str(c) for c in loads])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("goodput (tok/s); SLA attainment above bars")
    ax.set_title(f"{rows[0]['pair']}, {rows[0]['workload']}: {png.stem}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
