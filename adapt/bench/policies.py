"""`adapt bench policies`: every policy, live through the engine and by trace replay, across loads.

    adapt bench policies --out results/policies            # full: loads 1..64, demo pair
    adapt bench policies --quick --out /tmp/pol            # < 10 min on 2 cores

Steps:
1. **traces**: the `explore` policy (full block, random diffusion steps, random leniency) serves
   the evaluation mix at a few loads on the model pair, logging every row of every step;
2. **fit**: `adapt policy fit` on those traces: calibrated acceptance predictor + step-cost model
   (written to OUT/policy.json, ECE in OUT/fit_report.json);
3. **replay** (`adapt.replay`): every policy, every concurrency, on the logged records;
4. **live**: every policy, every concurrency of the live set, through the real engine.

The mix (`adapt.replay.make_mix`): half greedy, half sampled (T = 0.8); sampled requests alternate
lossless and ``tvd=0.1``; one in three has a tight TPOT target (the cost model's batch-1 step
time with a full draft), the others a loose one (4×). All policies share the fitted predictor and
cost model. Writes OUT/policies.json (a list of rows: policy, concurrency, goodput_tok_s,
sla_attainment, tau, tvd_spent_per_token, decision_ms_per_step, plus mode = live | replay and
extras), OUT/policies.png and OUT/policies.md (the table, and adaptive vs the best baseline).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

BASELINES = ("static", "batch-schedule", "dspark")
POLICIES = BASELINES + ("adaptive",)
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
    p.add_argument("--traces", default=None, help="reuse these traces instead of collecting new ones")
    p.add_argument("--policy-file", default=None, help="reuse this policy file instead of fitting")
    p.add_argument("--no-live", action="store_true", help="replay only")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--requests", type=int, default=None, help="override the replay request count per load")
    p.add_argument("--live-loads", default=None, help="override the live concurrencies, e.g. 1,4")
    p.add_argument("--trace-requests", type=int, default=None, help="override the requests per trace load")
    p.add_argument("--max-tokens", type=int, default=None, help="override the tokens per request")
    p.add_argument("--cost", default="profile", choices=("profile", "traces"),
                   help="step-cost model: profile the engine here (default; as a worker does at start) "
                        "or the one fitted from the traces' timings")
    p.add_argument("--rounds", type=int, default=None,
                   help="live rounds per load (policies in rotated order each round; the median is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


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


def _prompts(kind: str, engine, n: int, length: int, seed: int) -> list[list[int]]:
    import torch

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


def _table(rows: list[dict]) -> str:
    lines = ["| mode | concurrency | policy | goodput tok/s | SLA | τ | TVD/token | decision ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["mode"], r["concurrency"], r["policy"])):
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['policy']} | {r['goodput_tok_s']:.1f} | "
                     f"{r['sla_attainment']:.2f} | {r['tau']:.2f} | {r['tvd_spent_per_token']:.4f} | "
                     f"{r['decision_ms_per_step']:.3f} |")
    return "\n".join(lines)


def compare(rows: list[dict]) -> list[dict]:
    """Per (mode, concurrency): adaptive vs the best baseline on goodput, and SLA attainment."""
    out = []
    keys = sorted({(r["mode"], r["concurrency"]) for r in rows})
    for mode, c in keys:
        group = {r["policy"]: r for r in rows if r["mode"] == mode and r["concurrency"] == c}
        if "adaptive" not in group:
            continue
        base = [group[p] for p in BASELINES if p in group]
        if not base:
            continue
        best = max(base, key=lambda r: r["goodput_tok_s"])
        ad = group["adaptive"]
        out.append({"mode": mode, "concurrency": c, "best_baseline": best["policy"],
                    "goodput_gain": ad["goodput_tok_s"] / max(best["goodput_tok_s"], 1e-9) - 1.0,
                    "adaptive_sla": ad["sla_attainment"], "best_baseline_sla": max(r["sla_attainment"] for r in base),
                    "beats_all_goodput": all(ad["goodput_tok_s"] >= r["goodput_tok_s"] for r in base),
                    "sla_at_least": all(ad["sla_attainment"] >= r["sla_attainment"] for r in base)})
    return out


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy in POLICIES:
        for mode, style in (("live", "-o"), ("replay", "--x")):
            pts = sorted((r["concurrency"], r["goodput_tok_s"], r["sla_attainment"]) for r in rows
                         if r["policy"] == policy and r["mode"] == mode)
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[0].plot(xs, [p[1] for p in pts], style, label=f"{policy} ({mode})")
            axes[1].plot(xs, [p[2] for p in pts], style, label=f"{policy} ({mode})")
    for ax, title in zip(axes, ("goodput (tokens/s)", "SLA attainment")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    import torch

    from adapt.controller import build_policy
    from adapt.policy_file import load, save
    from adapt.replay import RecordPool, Scenario, make_mix, replay
    from adapt.trace_data import TraceTable
    from adapt.bench.live import collect_traces, run_live
    from adapt.commands.policy import fit_policy

    torch.set_num_threads(max(1, args.threads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _settings(args.quick)
    if args.requests:
        cfg["replay_requests"] = args.requests
    if args.live_loads:
        cfg["live_loads"] = tuple(int(v) for v in args.live_loads.split(","))
    if args.trace_requests:
        cfg["trace_requests"] = args.trace_requests
    if args.max_tokens:
        cfg["max_tokens"] = args.max_tokens
    if args.rounds:
        cfg["rounds"] = max(1, args.rounds)
    t_begin = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_begin:6.1f}s] {msg}", flush=True)  # noqa: E731

    engine, kind = None, "none"
    if not (args.no_live and args.traces):
        from workers.engine import Engine, EngineConfig

        if args.target:
            kind, target, drafter = "demo", args.target, args.drafter
        else:
            kind, target, drafter = _pair(args.pair, out, args.quick)
        max_c = max(max(cfg["live_loads"]), max(cfg["trace_loads"]))
        longest = chat_prompt_limit(cfg["prompt_len"]) if kind == "smollm2" else cfg["prompt_len"]
        engine = Engine(EngineConfig(target=target, drafter=drafter, device="auto", dtype="auto", max_batch=max_c,
                                     max_len=longest + cfg["max_tokens"] + 8))
        prompts = _prompts(kind, engine, 64, cfg["prompt_len"], args.seed)
        log(f"pair {kind}: block {engine.block}, {len(prompts)} prompts")

    # 1. traces
    if args.traces:
        trace_path = Path(args.traces)
    else:
        from workers.traces import FileTraceSink

        trace_path = out / "traces" / "explore.jsonl"
        if trace_path.exists():
            trace_path.unlink()
        sink = FileTraceSink(trace_path)
        probe_mix = make_mix(cfg["trace_requests"], 1e9, 1e9, max_tokens=cfg["max_tokens"])
        for c in cfg["trace_loads"]:
            collect_traces(engine, Scenario("explore", c, probe_mix), prompts, sink, seed=args.seed + c)
        sink.close()
        log(f"traces -> {trace_path}")
    table = TraceTable.read(trace_path)

    # 2. fit
    if args.policy_file:
        pf = load(args.policy_file)
    else:
        pf = fit_policy(table, policy="adaptive", seed=args.seed)
        if engine is not None and args.cost == "profile":
            from adapt.controller import profile_engine
            from adapt.cost_model import DEFAULT_ROW_GRID, DEFAULT_TOKEN_GRID

            max_c = engine.config.max_batch  # beyond the grid the tables extrapolate linearly
            top = max_c * (engine.block + 1)
            pf.cost = profile_engine(engine, token_grid=[g for g in DEFAULT_TOKEN_GRID if g <= max(top, 2)],
                                     row_grid=[r for r in DEFAULT_ROW_GRID if r <= max(max_c, 2)])
            pf.report["cost"] = {"source": "profile", "overhead_ms": pf.cost.overhead_ms}
            log(f"cost: profiled verify(1) {pf.cost.verify.at(1.0):.2f} ms, draft pass(1) "
                f"{pf.cost.draft_pass.at(1.0):.2f} ms, overhead {pf.cost.overhead_ms:.2f} ms")
        pf.settings.setdefault("allow_no_draft", True)
        save(pf, out / "policy.json")
        with open(out / "fit_report.json", "w", encoding="utf-8") as handle:
            json.dump(pf.report, handle, indent=1)
        log(f"fit: draft ECE {pf.report['draft']['ece_uncalibrated']:.4f} -> {pf.report['draft']['ece']:.4f}")
    K = int(table.block.max())
    t1 = float(pf.cost.step_ms(float(K + 1), torch.tensor([1])))
    tight, loose = t1, 4.0 * t1
    log(f"TPOT targets: tight {tight:.1f} ms, loose {loose:.1f} ms")
    steps_grid = tuple(pf.settings.get("steps_grid", (1,)))

    def make(name: str):
        extra = {"steps_grid": steps_grid} if name == "adaptive" else {}
        return build_policy(name, pf, **extra)

    rows: list[dict] = []
    # 3. replay
    pool = RecordPool(table, args.seed)
    for c in cfg["replay_loads"]:
        mix = make_mix(cfg["replay_requests"], tight, loose, max_tokens=cfg["max_tokens"])
        for name in POLICIES:
            pool.rng = __import__("numpy").random.default_rng(args.seed)
            m = replay(make(name), table, Scenario("mix", c, mix), pf.cost, seed=args.seed, pool=pool)
            rows.append({"policy": name, "concurrency": c, "mode": "replay", **m})
        log(f"replay c={c}: " + ", ".join(f"{r['policy']} {r['goodput_tok_s']:.0f}" for r in rows[-len(POLICIES):]))
    # 4. live: every round runs every policy once, in a rotated order (load drifts fall on all
    # policies alike); a policy's row is its median-goodput round
    if engine is not None and not args.no_live:
        import statistics

        for c in cfg["live_loads"]:
            mix = make_mix(cfg["live_requests"](c), tight, loose, max_tokens=cfg["max_tokens"])
            warm = Scenario("warm", min(c, 4), mix[:4])
            runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
            for rnd in range(cfg["rounds"]):
                order = POLICIES[rnd % len(POLICIES):] + POLICIES[:rnd % len(POLICIES)]
                for name in order:
                    policy = make(name)
                    run_live(engine, policy, warm, prompts, seed=args.seed)  # warm-up, not recorded
                    runs[name].append(run_live(engine, policy, Scenario("mix", c, mix), prompts, seed=args.seed))
            for name in POLICIES:
                ms = sorted(runs[name], key=lambda m: m["goodput_tok_s"])
                m = dict(ms[len(ms) // 2])
                m["goodput_rounds"] = [round(r["goodput_tok_s"], 1) for r in runs[name]]
                m["sla_attainment"] = statistics.mean(r["sla_attainment"] for r in runs[name])
                rows.append({"policy": name, "concurrency": c, "mode": "live", "pair": kind, **m})
            log(f"live c={c}: " + ", ".join(f"{r['policy']} {r['goodput_tok_s']:.0f}" for r in rows[-len(POLICIES):]))
    for r in rows:
        for k in KEYS:
            r.setdefault(k, float("nan"))
    with open(out / "policies.json", "w", encoding="utf-8") as handle:
        json.dump(rows, handle, indent=1)
    comp = compare(rows)
    with open(out / "policies.md", "w", encoding="utf-8") as handle:
        handle.write(f"pair: {kind}; TPOT targets tight {tight:.1f} ms / loose {loose:.1f} ms\n\n")
        handle.write(_table(rows) + "\n\n| mode | concurrency | best baseline | adaptive goodput gain | "
                     "adaptive SLA | best baseline SLA |\n|---|---|---|---|---|---|\n")
        for c in comp:
            handle.write(f"| {c['mode']} | {c['concurrency']} | {c['best_baseline']} | {100 * c['goodput_gain']:+.1f}% | "
                         f"{c['adaptive_sla']:.2f} | {c['best_baseline_sla']:.2f} |\n")
    _plot(rows, out / "policies.png")
    print(_table(rows))
    for c in comp:
        print(f"{c['mode']:6s} c={c['concurrency']:3d}: adaptive {100 * c['goodput_gain']:+6.1f}% vs {c['best_baseline']}, "
              f"SLA {c['adaptive_sla']:.2f} vs best baseline {c['best_baseline_sla']:.2f}")
    log(f"wrote {out / 'policies.json'}, {out / 'policies.png'}, {out / 'policies.md'}")
    return 0
