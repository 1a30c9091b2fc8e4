"""`adapt bench policies`: every policy, live through the engine and by trace replay, across loads
and workloads, against the best static configuration.

    adapt bench policies --out results/policies/smollm2   # full: loads 1..64, default pair
    adapt bench policies --quick --out /tmp/pol            # < 10 min on 2 cores
    adapt bench policies --pair demo --quick --workloads chat,edit --out /tmp/pol-demo

Policies: the baselines `ar` (never drafts: every row at draft_len 0), `static` (s = 1, full
block), `batch-schedule`, `dspark` and `suffix` (every row drafts from the suffix drafter,
workers/suffix.py, up to the engine's width, where it has a draft), and `adaptive`. `ar` and
`suffix` are fixed knobs (`adapt.bench.live.KnobsBaseline`, the engine's `StaticDecisions`).
`suffix` runs **live only**: a suffix draft is copied from the real text, which traces do not hold,
so the trace replay cannot replay it.

Workloads (``--workload NAME`` or ``--workloads a,b``): `chat`, `code`, `edit`, `mixed`
(adapt/bench/workloads.py), each prompt rendered with the target's chat template
(`workers.chat.chat_prompt_ids`; a tokenizer without a template gets its plain
``role: content`` transcript, a target without a tokenizer random token ids, still labelled with
the workload). Without either flag the workload is `default`, the prompts of earlier versions:
held-out instruction prompts in the chat template (smollm2), held-out stdlib text (demo), random
token ids (tiny).

Steps, per workload:
1. **traces**: the `explore` policy (full block, random diffusion steps, random leniency) serves
   the evaluation mix at a few loads on the model pair, logging every row of every step; the
   `suffix` baseline serves it once more at the largest trace load (its records fit the adaptive
   policy's suffix acceptance, ``suffix_accept``);
2. **fit** (once, on the traces of every workload): `adapt policy fit`: calibrated acceptance
   predictor + step-cost model (written to OUT/policy.json, ECE in OUT/fit_report.json);
3. **replay** (`adapt.replay`): every policy but `suffix`, every concurrency, on the workload's
   `explore` records;
4. **live**: every policy, every concurrency of the live set, through the real engine, each run
   starting with an empty suffix-drafter memory (no policy copies another's outputs).

The mix (`adapt.replay.make_mix`): half greedy, half sampled (T = 0.8); sampled requests alternate
lossless and ``tvd=0.1``; one in three has a tight TPOT target (the cost model's batch-1 step
time with a full draft), the others a loose one (4×); request lengths are spread evenly over
``max_tokens · (1 ± 0.5)`` (``--length-spread``; with 0, equal lengths, autoregressive decoding
runs in lockstep cohorts that never wait for another request's prefill, which real traffic does
not allow). All policies share the fitted predictor and cost model. ``--admission sla`` runs the
engine with SLA-aware admission (workers/admission.py) for every policy alike; the live rows
report the share of decoding time spent waiting for other requests' prefills and the mean TTFT.
``--interleave`` runs each round's live rows side by side (adapt/bench/interleave.py: one engine
per policy, taking turns step by step, each timed by its own clock), so that the machine's drift
falls on every policy of a round alike.

Writes OUT/policies.json (a list of rows: policy, concurrency, goodput_tok_s, sla_attainment, tau,
tvd_spent_per_token, decision_ms_per_step, plus workload, mode = live | replay and extras; the
adaptive rows also carry best_static, best_static_goodput_tok_s, best_static_sla and
gain_vs_best_static), OUT/best_static.json (`compare`), OUT/policies.png and OUT/policies.md
(headline: adaptive against the best static configuration per workload, mode and load; then every
row).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

POLICIES = ("static", "batch-schedule", "dspark", "adaptive")      # from the registry (build_policy)
BASELINES = ("ar", "static", "batch-schedule", "dspark", "suffix")  # the non-adaptive ones: "static configurations"
BENCH_POLICIES = BASELINES + ("adaptive",)                         # every policy the bench runs
LIVE_ONLY = ("suffix",)  # suffix drafts copy the real text: no trace replay
DEFAULT_WORKLOAD = "default"
KEYS = ("policy", "concurrency", "goodput_tok_s", "sla_attainment", "tau", "tvd_spent_per_token",
        "decision_ms_per_step")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("policies", help="policies live and by replay across loads (JSON + plot)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quick", action="store_true", help="small run (< 10 min on 2 cores)")
    p.add_argument("--pair", default="auto", choices=("auto", "smollm2", "demo", "tiny"),
                   help="model pair: smollm2 (workers/pairs.py; needs models/smollm2/drafter), demo (models/demo), "
                        "tiny (random tiny pair, drafter trained briefly), auto (the first of these that is there)")
    p.add_argument("--target", default=None, help="target model directory (overrides --pair)")
    p.add_argument("--drafter", default=None, help="drafter directory (with --target)")
    p.add_argument("--traces", default=None,
                   help="reuse these traces instead of collecting new ones (a file, or an earlier run's OUT/traces: "
                        "its explore[-WORKLOAD].jsonl are replayed per workload)")
    p.add_argument("--policy-file", default=None, help="reuse this policy file instead of fitting")
    p.add_argument("--no-live", action="store_true", help="replay only")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--requests", type=int, default=None, help="override the replay request count per load")
    p.add_argument("--live-loads", default=None, help="override the live concurrencies, e.g. 1,4")
    p.add_argument("--replay-loads", default=None, help="override the replay concurrencies, e.g. 1,16")
    p.add_argument("--trace-requests", type=int, default=None, help="override the requests per trace load")
    p.add_argument("--max-tokens", type=int, default=None, help="override the tokens per request")
    p.add_argument("--cost", default="profile", choices=("profile", "traces"),
                   help="step-cost model: profile the engine here (default; as a worker does at start) "
                        "or the one fitted from the traces' timings")
    p.add_argument("--rounds", type=int, default=None,
                   help="live rounds per load (policies in rotated order each round; the median is kept)")
    p.add_argument("--workload", default=None, choices=WORKLOAD_CHOICES,
                   help="prompts of one workload (adapt/bench/workloads.py) in the target's chat template; "
                        "default: the pair's earlier prompts (labelled 'default')")
    p.add_argument("--workloads", default=None,
                   help="several workloads in one run, comma-separated, e.g. chat,edit (each: traces, replay, live)")
    p.add_argument("--length-spread", type=float, default=0.5,
                   help="requests ask for max_tokens * (1 +- spread) tokens, evenly spread (adapt.replay.make_mix; "
                        "0 = equal lengths, where autoregressive decoding runs in lockstep cohorts)")
    p.add_argument("--admission", default="all", choices=("all", "sla"),
                   help="the engine's admission of waiting requests (workers/admission.py)")
    p.add_argument("--interleave", action="store_true",
                   help="live rows of a round side by side: one engine per policy, taking turns step by step, "
                        "each timed by its own clock (adapt/bench/interleave.py)")
    p.add_argument("--instances", action="store_true",
                   help="live round r serves its own instance of the scenario: the prompts rotated by r times the "
                        "requests, seed + r for sampled requests (adapt.bench.interleave.scenario_instance); default: "
                        "every round the same instance")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


WORKLOAD_CHOICES = ("chat", "code", "edit", "mixed", DEFAULT_WORKLOAD)


def workload_list(args) -> list[str]:
    """The workloads of a run: --workloads a,b, else --workload, else ['default']."""
    if getattr(args, "workloads", None):
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    elif getattr(args, "workload", None):
        names = [args.workload]
    else:
        names = [DEFAULT_WORKLOAD]
    bad = [w for w in names if w not in WORKLOAD_CHOICES]
    if bad or not names:
        raise SystemExit(f"adapt bench policies: --workloads: expected names among {', '.join(WORKLOAD_CHOICES)}, "
                         f"got {args.workloads!r}")
    return list(dict.fromkeys(names))


def _pair(choice: str, out: Path, quick: bool):
    from workers.engine import DEMO_DRAFTER, DEMO_TARGET
    from workers.pairs import get_pair

    smol = get_pair("smollm2")
    if choice == "smollm2" or (choice == "auto" and smol.drafter is not None):
        if smol.drafter is None:
            raise SystemExit("adapt bench policies: the smollm2 pair has no drafter yet (models/smollm2/drafter); "
                             "use --pair demo")
        smol.prepare()
        return "smollm2", smol.target, smol.drafter
    demo_ok = (Path(DEMO_TARGET) / "config.json").is_file() and (Path(DEMO_DRAFTER) / "config.json").is_file()
    if choice == "demo" or (choice == "auto" and demo_ok):
        if not demo_ok:
            raise SystemExit("adapt bench policies: models/demo/{target,drafter} are not there yet (use --pair tiny)")
        return "demo", DEMO_TARGET, DEMO_DRAFTER
    import sys

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from tests.tiny_models import make_tiny_pair

    t, d = make_tiny_pair(out / "tiny", block_size=8, train_steps=40 if quick else 200)
    return "tiny", t, d


def chat_prompt_limit(length: int) -> int:
    """The longest chat prompt (tokens) kept for a run whose plain prompts have `length` tokens."""
    return 4 * length + 256


LONGDOC_PROMPT_LIMIT = 2304  # tokens: a longdoc prompt stays under ~2,300 (adapt/bench/workloads.py)


def prompt_limit(workload: str) -> int:
    """The longest prompt (tokens) an instrument's engine holds for ``workload``: the chat limit,
    or `LONGDOC_PROMPT_LIMIT` for the long-document workloads (cut to the chat limit, a document
    would be a short context)."""
    return LONGDOC_PROMPT_LIMIT if workload.startswith("longdoc") else chat_prompt_limit(64)


def workload_engine(pair: str, workload: str, max_batch: int, max_tokens: int, compile: str = "off",
                    aot_pad: bool = False):
    """(engine, prompts): an engine on the registered pair `pair` (prepared), sized for
    `max_batch` rows of `workload` prompts (at most `prompt_limit(workload)` tokens) plus
    `max_tokens` new tokens, and those prompts as token ids (`workload_prompts`). `compile`,
    `aot_pad`: the engine's (`EngineConfig.compile`, "aot" building its package first when
    missing; `EngineConfig.aot_pad`)."""
    from workers.engine import Engine, EngineConfig
    from workers.pairs import get_pair

    spec = get_pair(pair)
    spec.prepare()
    limit = prompt_limit(workload)
    engine = Engine(EngineConfig(target=spec.target, drafter=spec.drafter, device="auto", dtype="auto",
                                 max_batch=max_batch, max_len=limit + max_tokens + 8, compile=compile,
                                 aot_pad=aot_pad))
    return engine, workload_prompts(engine, workload, 64, limit, 0)


def workload_prompts(engine, workload: str, n: int, limit: int, seed: int) -> list[list[int]] | None:
    """`n` prompts of `workload` (adapt/bench/workloads.py) as token ids through the target's chat
    template (`workers.chat.chat_prompt_ids`: a plain transcript without a template); prompts
    longer than `limit` tokens are skipped, or, where too few remain, cut to their last `limit`
    tokens (`mixed`: always cut, to keep its chat / code / edit rotation). None when the target
    has no tokenizer."""
    from adapt.bench.workloads import make_workload
    from workers.chat import chat_prompt_ids
    from workers.request import EngineInputError

    try:
        tokenizer = engine.tokenizer
    except EngineInputError:
        return None
    rendered = [chat_prompt_ids(tokenizer, w["messages"]) for w in make_workload(workload, 2 * n + 8, seed=seed)]
    rendered = [[t for t in ids if 0 <= t < engine.vocab] for ids in rendered]
    fits = [ids for ids in rendered if 0 < len(ids) <= limit]
    if workload == "mixed":  # keep the chat / code / edit rotation
        fits = [ids if len(ids) <= limit else ids[-limit:] for ids in rendered if ids]
    if len(fits) < n:
        fits += [ids[-limit:] for ids in rendered if len(ids) > limit][: n - len(fits)]
    return fits[:n] if fits else None


def _prompts(kind: str, engine, n: int, length: int, seed: int, workload: str = DEFAULT_WORKLOAD) -> list[list[int]]:
    import torch

    if workload != DEFAULT_WORKLOAD:
        out = workload_prompts(engine, workload, n, chat_prompt_limit(length), seed)
        if out:
            return out
        g = torch.Generator().manual_seed(seed)  # no tokenizer: random ids, still labelled with the workload
        return torch.randint(2, engine.vocab, (n, length), generator=g).tolist()
    if kind == "smollm2":  # an instruct model: held-out instruction prompts in its chat template
        from workers.training.chat_prompts import make_prompts
        from workers.training.harvest import encode_chats

        out = encode_chats(engine.tokenizer, make_prompts("heldout", 2 * n + 8, seed=seed), chat_prompt_limit(length))
        if len(out) >= n:
            return out[:n]
    if kind == "demo":  # prompts from the held-out stdlib files
        from workers.training.corpus import read_texts, stdlib_files

        ids: list[int] = []
        for text in read_texts(stdlib_files("heldout")[:40]):
            ids += engine.tokenizer(text)["input_ids"]
            if len(ids) > n * length * 3:
                break
        step = max(length, len(ids) // max(n, 1))
        out = [ids[i: i + length] for i in range(0, len(ids) - length, step)][:n]
        if len(out) >= n:
            return out
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, engine.vocab, (n, length), generator=g).tolist()


def _settings(quick: bool) -> dict:
    if quick:
        return {"trace_loads": (1, 8), "trace_requests": 16, "replay_loads": (1, 4, 16, 64), "replay_requests": 96,
                "live_loads": (1, 4, 16), "live_requests": lambda c: max(16, 2 * c), "max_tokens": 32,
                "prompt_len": 48, "rounds": 5}
    return {"trace_loads": (1, 8, 32), "trace_requests": 48, "replay_loads": (1, 2, 4, 8, 16, 32, 64),
            "replay_requests": 256, "live_loads": (1, 4, 16, 64), "live_requests": lambda c: max(24, 2 * c),
            "max_tokens": 64, "prompt_len": 64, "rounds": 3}


def _src(r: dict) -> str:
    sh = r.get("source_share")
    if not isinstance(sh, dict):
        return "–"
    return f"{sh.get('none', 0):.2f} / {sh.get('diffusion', 0):.2f} / {sh.get('suffix', 0):.2f}"


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _table(rows: list[dict]) -> str:
    lines = ["| workload | mode | concurrency | policy | goodput tok/s | SLA | τ | TVD/token | decision ms/step | "
             "drafts none / diffusion / suffix | prefill stall share | TTFT ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = lambda r: (r.get("workload", DEFAULT_WORKLOAD), r["mode"], r["concurrency"], r["policy"])  # noqa: E731
    for r in sorted(rows, key=order):
        lines.append(f"| {r.get('workload', DEFAULT_WORKLOAD)} | {r['mode']} | {r['concurrency']} | {r['policy']} | "
                     f"{r['goodput_tok_s']:.1f} | {r['sla_attainment']:.2f} | {r['tau']:.2f} | "
                     f"{r['tvd_spent_per_token']:.4f} | {r['decision_ms_per_step']:.3f} | {_src(r)} | "
                     f"{_num(r.get('prefill_stall_share'), '.2f')} | {_num(r.get('ttft_ms_mean'), '.0f')} |")
    return "\n".join(lines)


def compare(rows: list[dict]) -> list[dict]:
    """Per (workload, mode, concurrency): adaptive against the **best static configuration**, the
    non-adaptive baseline (`BASELINES`, ar included; replay has no suffix) with the highest
    goodput there: its name, both goodputs, their ratio (``goodput_ratio`` = adaptive / best
    static; ``goodput_gain`` = ratio − 1) and both SLA attainments (``best_baseline_sla``: the
    highest of any baseline)."""
    out = []
    keys = sorted({(r.get("workload", DEFAULT_WORKLOAD), r["mode"], r["concurrency"]) for r in rows})
    for workload, mode, c in keys:
        group = {r["policy"]: r for r in rows
                 if r.get("workload", DEFAULT_WORKLOAD) == workload and r["mode"] == mode and r["concurrency"] == c}
        if "adaptive" not in group:
            continue
        base = [group[p] for p in BASELINES if p in group]
        if not base:
            continue
        best = max(base, key=lambda r: r["goodput_tok_s"])
        ad = group["adaptive"]
        ratio = ad["goodput_tok_s"] / max(best["goodput_tok_s"], 1e-9)
        out.append({"workload": workload, "mode": mode, "concurrency": c,
                    "best_static": best["policy"], "best_baseline": best["policy"],
                    "baselines": [r["policy"] for r in base],
                    "adaptive_goodput_tok_s": ad["goodput_tok_s"], "best_static_goodput_tok_s": best["goodput_tok_s"],
                    "goodput_ratio": ratio, "goodput_gain": ratio - 1.0,
                    "adaptive_sla": ad["sla_attainment"], "best_static_sla": best["sla_attainment"],
                    "best_baseline_sla": max(r["sla_attainment"] for r in base),
                    "beats_all_goodput": all(ad["goodput_tok_s"] >= r["goodput_tok_s"] for r in base),
                    "sla_at_least": all(ad["sla_attainment"] >= r["sla_attainment"] for r in base)})
    return out


def headline(comp: list[dict]) -> str:
    """The Markdown table of `compare`: adaptive against the best static configuration."""
    lines = ["| workload | mode | concurrency | best static | its goodput tok/s | adaptive goodput tok/s | "
             "adaptive / best static | adaptive SLA | best static SLA |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = {"live": 0, "replay": 1}
    for c in sorted(comp, key=lambda c: (c["workload"], order.get(c["mode"], 2), c["concurrency"])):
        lines.append(f"| {c['workload']} | {c['mode']} | {c['concurrency']} | {c['best_static']} | "
                     f"{c['best_static_goodput_tok_s']:.1f} | {c['adaptive_goodput_tok_s']:.1f} | "
                     f"**{c['goodput_ratio']:.2f}×** | {c['adaptive_sla']:.2f} | {c['best_static_sla']:.2f} |")
    return "\n".join(lines)


def _plot(rows: list[dict], comp: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.get("workload", DEFAULT_WORKLOAD) for r in rows})
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, 4 * len(workloads)), squeeze=False)
    for wi, workload in enumerate(workloads):
        ax_g, ax_s, ax_r = axes[wi]
        for policy in BENCH_POLICIES:
            for mode, style in (("live", "-o"), ("replay", "--x")):
                pts = sorted((r["concurrency"], r["goodput_tok_s"], r["sla_attainment"]) for r in rows
                             if r["policy"] == policy and r["mode"] == mode
                             and r.get("workload", DEFAULT_WORKLOAD) == workload)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ax_g.plot(xs, [p[1] for p in pts], style, label=f"{policy} ({mode})")
                ax_s.plot(xs, [p[2] for p in pts], style, label=f"{policy} ({mode})")
        for mode, style in (("live", "-o"), ("replay", "--x")):
            pts = sorted((c["concurrency"], c["goodput_ratio"]) for c in comp
                         if c["mode"] == mode and c["workload"] == workload)
            if pts:
                ax_r.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"adaptive / best static ({mode})")
        ax_r.axhline(1.0, color="grey", lw=0.8)
        for ax, title in zip((ax_g, ax_s, ax_r), ("goodput (tokens/s)", "SLA attainment",
                                                  "adaptive / best static goodput")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_title(f"{workload}: {title}")
            ax.grid(alpha=0.3)
        ax_g.legend(fontsize=6)
        ax_r.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_policy(name: str, pf, *, steps_grid=(1,), width: int = 16):
    """A fresh policy `name` of `BENCH_POLICIES`: `ar` and `suffix` are fixed knobs
    (`adapt.bench.live.KnobsBaseline`; `suffix` drafts up to `width` tokens), the others
    `adapt.controller.build_policy` with the policy file `pf`."""
    from adapt.bench.live import KnobsBaseline
    from adapt.controller import build_policy

    if name == "ar":
        return KnobsBaseline("ar", draft_len=0)
    if name == "suffix":
        return KnobsBaseline("suffix", source="suffix", draft_len=int(width))
    extra = {"steps_grid": steps_grid} if name == "adaptive" else {}
    return build_policy(name, pf, **extra)


def _trace_name(kind: str, workload: str) -> str:
    return f"{kind}.jsonl" if workload == DEFAULT_WORKLOAD else f"{kind}-{workload}.jsonl"


def run(args) -> int:
    import numpy as np
    import torch

    from adapt.policy_file import load, save
    from adapt.replay import RecordPool, Scenario, make_mix, replay
    from adapt.trace_data import TraceTable, read_records
    from adapt.bench.evaluation import tight_tpot_ms
    from adapt.bench.interleave import engine_copies, rotated_engines, run_round, scenario_instance
    from adapt.bench.live import collect_traces, run_live
    from adapt.commands.policy import fit_policy

    torch.set_num_threads(max(1, args.threads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workloads = workload_list(args)
    cfg = _settings(args.quick)
    if args.requests:
        cfg["replay_requests"] = args.requests
    if args.live_loads:
        cfg["live_loads"] = tuple(int(v) for v in args.live_loads.split(","))
    if args.replay_loads:
        cfg["replay_loads"] = tuple(int(v) for v in args.replay_loads.split(","))
    if args.trace_requests:
        cfg["trace_requests"] = args.trace_requests
    if args.max_tokens:
        cfg["max_tokens"] = args.max_tokens
    if args.rounds:
        cfg["rounds"] = max(1, args.rounds)
    spread = args.length_spread
    if not 0.0 <= spread < 1.0:
        raise SystemExit(f"adapt bench policies: --length-spread: must be in [0, 1), got {spread}")
    t_begin = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}", flush=True)  # noqa: E731

    engine, kind, prompts = None, "none", {}
    if not (args.no_live and args.traces):
        from workers.engine import Engine, EngineConfig

        if args.target:
            kind, target, drafter = "demo", args.target, args.drafter
        else:
            kind, target, drafter = _pair(args.pair, out, args.quick)
        max_c = max(max(cfg["live_loads"]), max(cfg["trace_loads"]))
        rendered = kind == "smollm2" or any(w != DEFAULT_WORKLOAD for w in workloads)
        longest = chat_prompt_limit(cfg["prompt_len"]) if rendered else cfg["prompt_len"]
        most = round(cfg["max_tokens"] * (1.0 + spread)) + 1  # the longest request of the mix
        engine = Engine(EngineConfig(target=target, drafter=drafter, device="auto", dtype="auto", max_batch=max_c,
                                     max_len=longest + most + 8, admission=args.admission))
        for w in workloads:
            prompts[w] = _prompts(kind, engine, 64, cfg["prompt_len"], args.seed, w)
            lens = [len(p) for p in prompts[w]]
            log(f"pair {kind}: block {engine.block}, workload {w}: {len(lens)} prompts of "
                f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f})")
    width = engine.width if engine is not None else 16
    suffix_ok = engine is not None and engine.suffix is not None

    # 1. traces: explore (replayable) and suffix (for the suffix acceptance fit), per workload
    replay_tables: dict[str, TraceTable] = {}
    if args.traces:  # an earlier run's traces directory: its explore[-W].jsonl per workload
        table = TraceTable.read(args.traces)
        given = Path(args.traces)
        per = {w: given / _trace_name("explore", w) for w in workloads}
        if given.is_dir() and all(f.is_file() for f in per.values()):
            replay_tables = {w: TraceTable.read(f) for w, f in per.items()}
        else:
            replay_tables[workloads[0] if len(workloads) == 1 else "traces"] = table
    else:
        from workers.traces import FileTraceSink

        (out / "traces").mkdir(parents=True, exist_ok=True)
        files = []
        for w in workloads:
            probe_mix = make_mix(cfg["trace_requests"], 1e9, 1e9, max_tokens=cfg["max_tokens"])
            path = out / "traces" / _trace_name("explore", w)
            path.unlink(missing_ok=True)
            sink = FileTraceSink(path)
            for c in cfg["trace_loads"]:
                collect_traces(engine, Scenario("explore", c, probe_mix), prompts[w], sink, seed=args.seed + c)
            sink.close()
            files.append(path)
            replay_tables[w] = TraceTable.read(path)
            if suffix_ok:
                spath = out / "traces" / _trace_name("suffix", w)
                spath.unlink(missing_ok=True)
                sink = FileTraceSink(spath)
                c = max(cfg["trace_loads"])
                m = run_live(engine, make_policy("suffix", None, width=width), Scenario("suffix", c, probe_mix),
                             prompts[w], seed=args.seed + c, trace_sink=sink)
                sink.close()
                files.append(spath)
                log(f"traces {w}: suffix drafts on {100 * m['source_share']['suffix']:.0f}% of row-steps")
            log(f"traces {w} -> {path}")

        def records():
            for i, f in enumerate(files):
                for r in read_records(f):
                    r["run"] = i
                    yield r

        table = TraceTable.from_records(records())

    # 2. fit
    if args.policy_file:
        pf = load(args.policy_file)
    else:
        pf = fit_policy(table, policy="adaptive", seed=args.seed)
        if engine is not None and args.cost == "profile":
            from adapt.controller import profile_engine
            from adapt.cost_model import DEFAULT_ROW_GRID, profile_token_grid

            max_c = engine.config.max_batch  # beyond the grid the tables extrapolate linearly
            top = max_c * (engine.block + 1)
            pf.cost = profile_engine(engine, token_grid=profile_token_grid(top),
                                     row_grid=[r for r in DEFAULT_ROW_GRID if r <= max(max_c, 2)])
            pf.report["cost"] = {"source": "profile", "overhead_ms": pf.cost.overhead_ms}
            log(f"cost: profiled verify(1) {pf.cost.verify.at(1.0):.2f} ms, draft pass(1) "
                f"{pf.cost.draft_pass.at(1.0):.2f} ms, overhead {pf.cost.overhead_ms:.2f} ms")
        pf.settings.setdefault("allow_no_draft", True)
        save(pf, out / "policy.json")
        with open(out / "fit_report.json", "w", encoding="utf-8") as handle:
            json.dump(pf.report, handle, indent=1)
        log(f"fit: draft ECE {pf.report['draft']['ece_uncalibrated']:.4f} -> {pf.report['draft']['ece']:.4f}; "
            f"suffix acceptance from {pf.report.get('suffix', {}).get('records', 0)} records")
    K = int(table.block.max())
    tight = tight_tpot_ms(pf.cost, K)
    loose = 4.0 * tight
    log(f"TPOT targets: tight {tight:.1f} ms, loose {loose:.1f} ms")
    steps_grid = tuple(pf.settings.get("steps_grid", (1,)))

    def make(name: str):
        return make_policy(name, pf, steps_grid=steps_grid, width=width)

    rows: list[dict] = []
    # 3. replay (suffix drafts cannot be replayed: LIVE_ONLY)
    replayed = [p for p in BENCH_POLICIES if p not in LIVE_ONLY]
    for w, wtable in replay_tables.items():
        pool = RecordPool(wtable, args.seed)
        for c in cfg["replay_loads"]:
            mix = make_mix(cfg["replay_requests"], tight, loose, max_tokens=cfg["max_tokens"], length_spread=spread)
            for name in replayed:
                pool.rng = np.random.default_rng(args.seed)
                m = replay(make(name), wtable, Scenario("mix", c, mix), pf.cost, seed=args.seed, pool=pool)
                rows.append({"policy": name, "concurrency": c, "mode": "replay", "workload": w, **m})
            log(f"replay {w} c={c}: " + ", ".join(f"{r['policy']} {r['goodput_tok_s']:.0f}"
                                                   for r in rows[-len(replayed):]))
    # 4. live: every round runs every policy once, in a rotated order (load drifts fall on all
    # policies alike); a policy's row is its median-goodput round. Each run_live starts with an
    # empty suffix memory, warm-up runs included. --interleave: a round's runs go side by side.
    if engine is not None and not args.no_live:
        import statistics

        live_policies = [p for p in BENCH_POLICIES if p != "suffix" or suffix_ok]
        # --interleave: an engine per policy (same config, its own model copy); else one for all
        engines = engine_copies(engine, len(live_policies)) if args.interleave else [engine] * len(live_policies)
        engines = dict(zip(live_policies, engines))
        for w in workloads:
            for c in cfg["live_loads"]:
                mix = make_mix(cfg["live_requests"](c), tight, loose, max_tokens=cfg["max_tokens"], length_spread=spread)
                warm = Scenario("warm", min(c, 4), mix[:4])
                runs: dict[str, list[dict]] = {name: [] for name in live_policies}
                n = len(live_policies)
                for rnd in range(cfg["rounds"]):
                    order = live_policies[rnd % n:] + live_policies[:rnd % n]
                    served, seed = scenario_instance(prompts[w], rnd, len(mix), args.seed, vary=args.instances)
                    on = rotated_engines(engines, live_policies, rnd) if args.interleave else engines
                    measured = run_round([on[name] for name in order], [make(name) for name in order], warm,
                                         Scenario("mix", c, mix), served, interleave=args.interleave, seed=seed)
                    for name, m in zip(order, measured):
                        runs[name].append(m)
                for name in live_policies:
                    ms = sorted(runs[name], key=lambda m: m["goodput_tok_s"])
                    m = dict(ms[len(ms) // 2])
                    m["goodput_rounds"] = [round(r["goodput_tok_s"], 1) for r in runs[name]]
                    m["sla_attainment"] = statistics.mean(r["sla_attainment"] for r in runs[name])
                    rows.append({"policy": name, "concurrency": c, "mode": "live", "workload": w, "pair": kind,
                                 "instances": args.instances, **m})
                log(f"live {w} c={c}: " + ", ".join(f"{r['policy']} {r['goodput_tok_s']:.0f}"
                                                     for r in rows[-len(live_policies):]))
    for r in rows:
        for k in KEYS:
            r.setdefault(k, float("nan"))
    comp = compare(rows)
    for c in comp:  # the adaptive rows carry their comparison
        for r in rows:
            if (r["policy"] == "adaptive" and r["mode"] == c["mode"] and r["concurrency"] == c["concurrency"]
                    and r["workload"] == c["workload"]):
                r.update(best_static=c["best_static"], best_static_goodput_tok_s=c["best_static_goodput_tok_s"],
                         best_static_sla=c["best_static_sla"], gain_vs_best_static=c["goodput_ratio"])
    with open(out / "policies.json", "w", encoding="utf-8") as handle:
        json.dump(rows, handle, indent=1)
    with open(out / "best_static.json", "w", encoding="utf-8") as handle:
        json.dump(comp, handle, indent=1)
    with open(out / "policies.md", "w", encoding="utf-8") as handle:
        handle.write(f"# adapt bench policies\n\npair: {kind}; workloads: {', '.join(workloads)}; "
                     f"TPOT targets tight {tight:.1f} ms / loose {loose:.1f} ms; request lengths "
                     f"{cfg['max_tokens']} · (1 ± {spread:g}); admission {args.admission}\n\n")
        handle.write("## Adaptive against the best static configuration\n\n"
                     "Best static = the highest-goodput non-adaptive baseline (" + ", ".join(BASELINES) +
                     ") at that workload, mode and load; `suffix` runs live only (a trace replay cannot "
                     "replay suffix drafts). Ratio = adaptive goodput / best static goodput.\n\n")
        handle.write(headline(comp) + "\n\n## Every row\n\n" + _table(rows) + "\n")
    _plot(rows, comp, out / "policies.png")
    print(_table(rows))
    print(headline(comp))
    log(f"wrote {out / 'policies.json'}, {out / 'best_static.json'}, {out / 'policies.png'}, {out / 'policies.md'}")
    return 0
