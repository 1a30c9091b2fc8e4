"""The CUDA path checked in one run (issue #20): kernels, engine exactness, speed, cost table, host
syncs, policy replay with the device's cost model, compiled decode steps.

    python -m adapt.bench.gpu_check --device cuda --out results/gpu        # on a GPU (~5 min on an H200)
    python -m adapt.bench.gpu_check --device cpu --quick --out /tmp/gpu    # the CPU-runnable parts, < 1 min
    bash scripts/gpu_check.sh --out "$OUT"                                 # what a device run calls

Sections (each writes OUT/<section>.json as soon as it ends, so a run cut short keeps what ran;
OUT/summary.json is rewritten after every section with each one's status and the log):

| section | what it checks | CPU (`--quick`) | CUDA |
|---|---|---|---|
| kernels | `kernels.verify` (every rule, mixed rules, ragged batches with zero-length drafts, one-hot greedy rows, V = 1000 and 151,936) and `select_commit`: Triton vs the torch reference, tokens and accept counts `torch.equal`, TVD within 2e-6 + 1e-5·|x| | Triton interpreter (TRITON_INTERPRET=1), small batches | compiled kernels, batch 64 × K 16, also V = 4096; also against the reference on CPU; timings |
| exactness | the engine's greedy output in fp32 vs transformers' own greedy decoding in fp32, token for token, rows with different s / k / commit order in one batch, half joining late | yes | yes, plus a ragged batch of 16 |
| speed | τ and tokens/s of our speculative default (`adapt`), our autoregressive decoding (`adapt-ar`) and transformers `generate` (`hf`), and our step's phases | batch 1, 2; 16 tokens | batch 1, 8, 64; 128 tokens; 3 rounds |
| cost | `adapt.controller.profile_engine` on the device → OUT/cost_model.json (`CostModel.from_dict` reads it) | max batch 4 | max batch 64 |
| syncs | host syncs per decode step, by call site (`gpu_check_engine.SyncCounter`) | host reads of tensors: an upper bound | `torch.cuda.set_sync_debug_mode` |
| replay | the policies benchmark's traces replayed (`adapt.replay`) with the device's cost model and with the policy file's own, and what the adaptive policy decides: s, k, rule | 2 loads, 2 policies | 3 loads, 4 policies |
| compiled | the engine with `compile="on"` (torch.compile; the engine has no CUDA-graph path): warm-up time, speed, agreement with eager | not run (minutes of compiling on 2 cores; tests/test_compiled.py covers it) | yes, last, while the time budget lasts |

Models: `--pair NAME` (default `demo`) is the project's named pair (`workers.pairs`; else
`models/NAME/{target,drafter}`), never pulled: a device machine cannot fetch, and only 64 MiB of
working tree travels to it; `--target/--drafter` override it. The replay reads `results/policies/demo/traces/explore.jsonl` and
`results/policies/demo/policy.json` (the predictor fitted on them) unless told otherwise.
`--budget-s` skips sections that would start too late (a device run has a hard time limit).
Exit status 0 when every section that ran passed its checks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("kernels", "exactness", "cost", "syncs", "speed", "replay", "compiled")
# seconds a section needs at least on a GPU (full mode): with less budget left it is skipped
MIN_SECONDS = {"kernels": 30, "exactness": 20, "cost": 20, "syncs": 15, "speed": 45, "replay": 25, "compiled": 120}
TVD_ATOL, TVD_RTOL = 2e-6, 1e-5


@dataclass
class Context:
    out: Path
    device: object            # torch.device
    device_name: str
    quick: bool
    pair: str
    target: Path
    drafter: Path
    dtype: str
    compile: str
    seed: int
    speed_rows: list[str]
    traces: Path
    policy_file: Path         # the replay's (fitted on its traces)
    pair_policy: Path | None  # the pair's own policy file (the sync section's adaptive scenario)
    log: Callable[[str], None]
    shared: dict = field(default_factory=dict)  # results later sections read (cost model, speed outputs)


def resolve_pair(name: str, target: str | None, drafter: str | None) -> tuple[str, Path, Path, Path | None]:
    """(label, target, drafter, the pair's policy file or None) for `--pair NAME`: the project's
    pair registry (`workers.pairs.get_pair`; paths only, nothing is pulled: a device machine
    cannot fetch) where there is one, else models/NAME/{target,drafter,policy.json}. Explicit
    `--target/--drafter` win (and drop the pair's policy file)."""
    try:
        from workers.pairs import get_pair
    except ImportError:
        root = REPO_ROOT / "models" / name
        t0, d0, pol = root / "target", root / "drafter", root / "policy.json"
    else:
        try:
            pair = get_pair(name)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        t0, d0, pol = pair.target, pair.drafter, pair.policy_file
    t = Path(target) if target else t0
    d = Path(drafter) if drafter else d0
    for what, path in (("target", t), ("drafter", d)):
        if path is None or not (path / "config.json").is_file():
            raise SystemExit(f"--pair {name} / --{what}: {path} has no config.json (pulled targets must be in the "
                             "cache already; the check needs a drafter)")
    own = not (target or drafter)
    return (name if own else f"{name} (overridden)"), t, d, (pol if own and pol and Path(pol).is_file() else None)


# -- (1) kernels ----------------------------------------------------------------------------------
def make_batch(ks, vocab, seed, temperature=1.0, greedy_rows=(), close=0.5):
    """A ragged batch on CPU (tests/test_kernels_equal.py uses it too): drafts drawn from q, q partly
    aligned with p (`close`), rows in `greedy_rows` with one-hot p (T = 0), fresh coins and draw uniforms."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ks = torch.tensor(ks, dtype=torch.int64)
    batch, n = ks.numel(), int(ks.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), ks.cumsum(0)]).to(torch.int32)
    logits = torch.randn(n + batch, vocab, generator=g) * 3
    p = (logits / temperature).softmax(-1)
    row = torch.repeat_interleave(torch.arange(batch), ks + 1)
    for r in greedy_rows:
        rows = (row == r).nonzero().squeeze(1)
        p[rows] = torch.nn.functional.one_hot(p[rows].argmax(-1), vocab).float()
    is_draft = torch.ones(n + batch, dtype=torch.bool)
    is_draft[(cu[1:] + torch.arange(batch)).long()] = False
    q = (close * logits[is_draft] + (1 - close) * torch.randn(n, vocab, generator=g) * 3).softmax(-1)
    x = torch.multinomial(q, 1, generator=g).squeeze(1) if n else torch.zeros(0, dtype=torch.int64)
    u = torch.rand(n, generator=g)
    s = torch.rand(n + batch, generator=g)  # one draw uniform per target row
    return {"x": x, "cu": cu, "p": p.contiguous(), "q": q.contiguous(), "u": u, "s": s}


def _rule_args(rules, device):
    import torch

    from kernels import DEFAULT_PARAMS

    prm = [DEFAULT_PARAMS[r] for r in rules]  # each rule's defaults, from the rule table
    return (torch.tensor([int(r) for r in rules], dtype=torch.int32, device=device),
            torch.tensor([a for a, _ in prm], device=device), torch.tensor([b for _, b in prm], device=device))


def compare_verify(batch, rules, max_k, device, with_q=True, cpu_reference=False, time_it=0) -> dict:
    """Triton vs the torch reference on `device` for one batch and per-row rules."""
    import statistics

    import torch

    from kernels import verify

    def call(d, dev, backend):
        rule, prm, prm2 = _rule_args(rules, dev)
        return lambda: verify(d["x"], d["cu"], d["p"], d["q"] if with_q else None, rule, prm, prm2, d["u"], d["s"],
                              max_k, backend=backend)

    dev_batch = {k: v.to(device) for k, v in batch.items()}
    ref, tri = call(dev_batch, device, "torch")(), call(dev_batch, device, "triton")()
    diff = (ref.tvd_spent - tri.tvd_spent).abs()
    rec = {"rows": int(batch["cu"].numel() - 1), "drafts": int(batch["x"].numel()), "vocab": int(batch["p"].shape[1]),
           "with_q": with_q, "tokens_equal": bool(torch.equal(ref.tokens, tri.tokens)),
           "accepted_equal": bool(torch.equal(ref.num_accepted, tri.num_accepted)),
           "tvd_close": bool((diff <= TVD_ATOL + TVD_RTOL * ref.tvd_spent.abs()).all()),
           "tvd_max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
           "mean_accepted": float(ref.num_accepted.float().mean()) if ref.num_accepted.numel() else 0.0,
           "mean_tvd_spent": float(ref.tvd_spent.mean()) if ref.tvd_spent.numel() else 0.0}
    rec["equal"] = rec["tokens_equal"] and rec["accepted_equal"] and rec["tvd_close"]
    if cpu_reference:  # informational: the CPU's reference is a different set of float kernels
        cpu = call(batch, torch.device("cpu"), "torch")()
        rec["tokens_equal_to_cpu_reference"] = bool(torch.equal(cpu.tokens, tri.tokens.cpu()))
    if time_it:
        for backend in ("triton", "torch"):
            fn, times = call(dev_batch, device, backend), []
            for _ in range(time_it):
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize(device)
                times.append(1e3 * (time.perf_counter() - t0))
            rec[f"{backend}_ms"] = statistics.median(times)
    return rec


def section_kernels(ctx) -> dict:
    """Every acceptance rule and mixed-rule batches through both backends (see the module table)."""
    import torch

    from kernels import NEEDS_DRAFT_PROBS, RULES, Rule, rule_name, select_commit
    from kernels.triton_verify import TRITON_RULES

    kernel_rules = [r for r in sorted(RULES) if int(r) in TRITON_RULES]  # the rule table's rules with Triton code
    cuda = ctx.device.type == "cuda"
    K = 16
    if ctx.quick:
        shapes = [(1000, [5, 0, 16, 1, 3], 1.0), (151_936, [4, 0, 2], 0.7)]
    else:
        ragged = [(7 * i) % (K + 1) for i in range(64)]  # every k in 0..16, zero-length drafts included
        shapes = [(1000, ragged, 1.0), (4096, ragged, 1.0), (151_936, ragged, 0.7)]
    cases = []
    for vocab, ks, temp in shapes:
        batch = make_batch(ks, vocab, seed=ctx.seed + vocab % 97, temperature=temp, close=0.8)
        big = vocab > 100_000
        for rule in kernel_rules:
            rec = compare_verify(batch, [rule] * len(ks), K, ctx.device, cpu_reference=cuda,
                                 time_it=10 if cuda and big else 0)
            cases.append({"case": f"rule {rule_name(rule)}", **rec})
        mixed = [kernel_rules[i % len(kernel_rules)] for i in range(len(ks))]
        greedy_batch = make_batch(ks, vocab, seed=ctx.seed + 1, temperature=temp, greedy_rows=(1, 2), close=0.5)
        cases.append({"case": "mixed rules, one-hot greedy rows", **compare_verify(greedy_batch, mixed, K, ctx.device)})
        no_q = [Rule.MATCH if r in NEEDS_DRAFT_PROBS else r for r in mixed]
        cases.append({"case": "mixed rules without draft probabilities",
                      **compare_verify(greedy_batch, no_q, K, ctx.device, with_q=False)})
        del batch, greedy_batch
        ctx.log(f"kernels V={vocab}: {sum(c['equal'] for c in cases)}/{len(cases)} equal so far")
    for ks, name in (([0, 0, 0], "no drafts in any row"), ([], "empty batch")):
        cases.append({"case": name, **compare_verify(make_batch(ks, 50, seed=2), [Rule.MATCH] * len(ks), 4, ctx.device)})
    g = torch.Generator().manual_seed(ctx.seed)
    commits = []
    for k in (1, 5, 16):
        rows = 40 if ctx.quick else 256
        conf = torch.rand(rows, k, generator=g)
        conf[:, ::3] = 0.5  # ties
        masked = torch.rand(rows, k, generator=g) > 0.3
        num = torch.randint(0, k + 2, (rows,), generator=g).to(torch.int32)
        l2r = torch.rand(rows, generator=g) > 0.5
        args = [t.to(ctx.device) for t in (conf, masked, num, l2r)]
        ref, tri = select_commit(*args, backend="torch"), select_commit(*args, backend="triton")
        commits.append({"k": k, "rows": rows, "equal": bool(torch.equal(ref, tri))})
    backend = "compiled Triton on " + ctx.device_name if cuda else "Triton interpreter (TRITON_INTERPRET=1) on CPU"
    return {"backend": backend, "verify": cases, "select_commit": commits,
            "checks": {"verify_equal": all(c["equal"] for c in cases),
                       "select_commit_equal": all(c["equal"] for c in commits)}}


# -- (6) replay with the device's cost model --------------------------------------------------------
class DecisionRecorder:
    """A policy that records what it decides per row (replay calls it as the engine would)."""

    def __init__(self, policy):
        self.policy = policy
        self.records: list[tuple] = []

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def before_draft(self, rows):
        return self.policy.before_draft(rows)

    def after_draft(self, rows, intent, draft):
        dec = self.policy.after_draft(rows, intent, draft)
        self.records.append((draft.steps.cpu().clone(), dec.draft_len.cpu().clone(), dec.rule.cpu().clone(),
                             rows.remaining.cpu().clone(), rows.temperature.cpu().clone()))
        return dec

    def observe(self, record):
        return self.policy.observe(record)

    def summary(self, K: int) -> dict:
        """Shares over row-steps: s chosen, k verified (what the engine would enforce: k ≤ K on rows
        that drafted, ≤ remaining − 1), and the rule of rows that verify drafts."""
        import torch

        from kernels import rule_name

        if not self.records:
            return {"row_steps": 0}
        s, k, rule, remaining, temp = (torch.cat(c) for c in zip(*self.records))
        s = s.clamp(0, K)
        k = torch.minimum(torch.minimum(k.clamp(min=0), torch.where(s > 0, K, 0)), (remaining - 1).clamp(min=0))
        drafting = s > 0
        verifying = k > 0

        def hist(values) -> dict:
            vals, counts = values.unique(return_counts=True)
            total = max(int(counts.sum()), 1)
            return {str(int(v)): round(int(c) / total, 4) for v, c in zip(vals, counts)}

        out = {"row_steps": int(s.numel()), "drafting_share": float(drafting.float().mean()),
               "steps_share": hist(s), "draft_len_share_when_drafting": hist(k[drafting]) if drafting.any() else {},
               "mean_draft_len_when_drafting": float(k[drafting].float().mean()) if drafting.any() else 0.0,
               "full_block_share_when_drafting": float((k[drafting] == K).float().mean()) if drafting.any() else 0.0,
               "rule_share_when_verifying": {rule_name(r): v for r, v in hist(rule[verifying]).items()}
               if verifying.any() else {}}
        for cls, m in (("greedy", temp <= 0), ("sampled", temp > 0)):
            if m.any():
                out[f"drafting_share_{cls}"] = float(drafting[m].float().mean())
        return out


def section_replay(ctx) -> dict:
    """Replay the policies benchmark's traces with (a) the cost model profiled in this run on the
    device and (b) the policy file's own (profiled on the CPU that logged the traces); every
    policy's goodput, SLA attainment and τ, and the adaptive policy's decisions. Verification is
    'nearly free' where verifying a full block per row costs little more than one token per row
    (`verify_full_block_over_one_token` near 1); that is where the adaptive policy should draft
    long. TPOT targets as in `adapt bench policies`: tight = the cost model's batch-1 full-block
    step, loose = 4x."""
    import numpy as np
    import torch

    try:
        from adapt.replay import RecordPool, Scenario, make_mix, replay
    except ModuleNotFoundError as exc:  # pydantic, on a device image without it
        raise RuntimeError(f"{exc}: carry it as wheels in .whl/ (docs/benchmarks.md, 'GPU check')") from None
    from adapt.bench.policies import POLICIES
    from adapt.controller import build_policy
    from adapt.cost_model import CostModel
    from adapt.policy_file import load
    from adapt.trace_data import TraceTable

    table = TraceTable.read(ctx.traces)
    pf = load(ctx.policy_file)
    pf.settings.setdefault("allow_no_draft", True)
    K = int(table.block.max())
    costs = {}
    if "cost" in ctx.shared:
        costs["device"] = ctx.shared["cost"]
    elif (ctx.out / "cost_model.json").is_file():
        costs["device"] = CostModel.from_dict(json.loads((ctx.out / "cost_model.json").read_text()))
    costs["policy_file"] = pf.cost
    loads = (1, 4) if ctx.quick else (1, 8, 64)
    n_req = lambda c: 16 if ctx.quick else max(16, 2 * c)  # noqa: E731 - a load-1 replay is 64 steps per request
    names = ("static", "adaptive") if ctx.quick else POLICIES
    rows = []
    for cname, cost in costs.items():
        tight = float(cost.step_ms(float(K + 1), torch.tensor([1])))
        flat = {c: float(cost.verify.at(float(c * (K + 1))) / max(cost.verify.at(float(c)), 1e-9)) for c in loads}
        # what a full-block drafting step costs against a plain one (drafter pass included)
        dear = {c: float(cost.step_ms_at(c * (K + 1.0), [c]) / max(cost.step_ms_at(float(c)), 1e-9)) for c in loads}
        for c in loads:
            mix = make_mix(n_req(c), tight, 4 * tight, max_tokens=64)
            for name in names:
                rec = DecisionRecorder(build_policy(name, pf, cost=CostModel.from_dict(cost.to_dict())))
                pool = RecordPool(table, ctx.seed)
                pool.rng = np.random.default_rng(ctx.seed)
                m = replay(rec, table, Scenario("mix", c, mix), cost, seed=ctx.seed, pool=pool)
                rows.append({"cost_model": cname, "policy": name, "concurrency": c, "requests": len(mix),
                             "verify_full_block_over_one_token": flat[c],
                             "drafting_step_over_plain_step": dear[c], "tight_tpot_ms": tight,
                             **{k: m[k] for k in ("goodput_tok_s", "sla_attainment", "tau", "tvd_spent_per_token",
                                                  "decision_ms_per_step", "unknown_share")},
                             "decisions": rec.summary(K)})
            ad = rows[-1] if rows[-1]["policy"] == "adaptive" else None
            ctx.log(f"replay {cname} c={c}: " + ", ".join(f"{r['policy']} {r['goodput_tok_s']:.0f}" for r in rows[-len(names):])
                    + (f"; adaptive drafts {ad['decisions']['drafting_share']:.2f} of rows, mean k "
                       f"{ad['decisions']['mean_draft_len_when_drafting']:.1f}" if ad else ""))
    return {"traces": str(ctx.traces), "policy_file": str(ctx.policy_file), "block": K,
            "cost_models": {n: c.to_dict() for n, c in costs.items()}, "rows": rows,
            "device_cost_model": "device" in costs}


# -- the run ------------------------------------------------------------------------------------
RUNNERS = {"kernels": section_kernels, "replay": section_replay}


def _runner(name: str):
    if name in RUNNERS:
        return RUNNERS[name]
    from adapt.bench import gpu_check_engine

    return getattr(gpu_check_engine, f"section_{name}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m adapt.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="cuda | cuda:N | cpu | auto (cuda when available)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "gpu", help="output directory")
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU test mode)")
    p.add_argument("--pair", default="demo", help="model pair: models/NAME/{target,drafter} (default demo)")
    p.add_argument("--target", default=None, help="target directory (overrides --pair)")
    p.add_argument("--drafter", default=None, help="drafter directory (overrides --pair)")
    p.add_argument("--dtype", default="auto", help="dtype of the speed, cost and sync engines (exactness: float32)")
    p.add_argument("--compile", default="off", choices=("auto", "on", "off"),
                   help="compile setting of the speed, cost and sync engines (workers/backends.py: auto = a built "
                        "package, else eager; the `compiled` section runs 'on')")
    p.add_argument("--sections", default="all", help=f"comma-separated, of {', '.join(SECTIONS)} (default all; "
                                                     "on CPU with --quick all but compiled)")
    p.add_argument("--speed-rows", default="adapt,adapt-ar,hf", help="rows of the speed section")
    p.add_argument("--traces", type=Path, default=REPO_ROOT / "results" / "policies" / "demo" / "traces" / "explore.jsonl")
    p.add_argument("--policy-file", type=Path, default=REPO_ROOT / "results" / "policies" / "demo" / "policy.json")
    p.add_argument("--budget-s", type=float, default=0.0, help="time budget: skip sections that cannot fit (0 = none)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def environment(device) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "device": str(device), "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"unavailable ({type(exc).__name__})"
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        info.update(gpu=prop.name, gpu_memory_gib=round(prop.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    capability=f"{prop.major}.{prop.minor}")
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    t_begin = time.perf_counter()
    import torch

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here")
    if device.type == "cpu":
        # Triton decides interpretation when a kernel is decorated: before kernels.triton_* import
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.pop("TRITON_INTERPRET", None) == "1":
        print("gpu_check: TRITON_INTERPRET=1 removed: on CUDA the compiled kernels are what is checked", flush=True)
    pair, target, drafter, pair_policy = resolve_pair(args.pair, args.target, args.drafter)
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = SECTIONS if args.sections == "all" else tuple(s.strip() for s in args.sections.split(",") if s.strip())
    bad = [s for s in wanted if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--sections: unknown {bad}; choose from {', '.join(SECTIONS)}")
    lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.perf_counter() - t_begin:6.1f}s] {msg}"
        lines.append(line)
        print(line, flush=True)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    ctx = Context(out=args.out, device=device, device_name=name, quick=args.quick, pair=pair, target=target,
                  drafter=drafter, dtype=args.dtype, compile=args.compile, seed=args.seed,
                  speed_rows=[r.strip() for r in args.speed_rows.split(",") if r.strip()],
                  traces=args.traces, policy_file=args.policy_file, pair_policy=pair_policy, log=log)
    summary = {"check": "gpu_check", "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "argv": sys.argv[1:] if argv is None else list(argv), "quick": args.quick,
               "pair": {"name": pair, "target": str(target), "drafter": str(drafter)},
               "environment": environment(device), "sections": {}, "log": lines}
    log(f"gpu_check on {name}, pair {pair}, sections {','.join(wanted)}")
    failed = False
    for section in SECTIONS:
        if section not in wanted:
            continue
        reason = None
        elapsed = time.perf_counter() - t_begin
        if section == "compiled" and device.type == "cpu" and args.quick and args.sections == "all":
            reason = "not run on CPU with --quick: compiling the decode steps takes minutes on 2 cores"
        elif args.budget_s and not args.quick and args.budget_s - elapsed < MIN_SECONDS[section]:
            reason = f"time budget: {args.budget_s - elapsed:.0f} s left, the section needs ~{MIN_SECONDS[section]} s"
        t0 = time.perf_counter()
        if reason:
            result = {"status": "skipped", "reason": reason}
            log(f"{section}: skipped ({reason})")
        else:
            log(f"{section}: start")
            summary["sections"][section] = {"status": "running (a run that ends here was stopped in it)"}
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
            try:
                result = _runner(section)(ctx)
                checks = result.get("checks", {})
                result = {"status": "ok" if all(checks.values()) else "failed", **result}
            except Exception as exc:  # noqa: BLE001 - a section's failure must not stop the others
                result = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                log(f"{section}: error {type(exc).__name__}: {exc}")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        result = {"section": section, "seconds": round(time.perf_counter() - t0, 2), **result}
        failed |= result["status"] in ("failed", "error")
        path = args.out / f"{section}.json"
        if section == "cost" and (args.out / "cost_model.json").is_file() and result["status"] != "error":
            data = json.loads((args.out / "cost_model.json").read_text())  # the cost model file carries its check
            data["check"] = result
            path, result_doc = args.out / "cost_model.json", data
        else:
            result_doc = result
        path.write_text(json.dumps(result_doc, indent=1, default=str))
        summary["sections"][section] = {"status": result["status"], "seconds": result["seconds"], "file": path.name,
                                        **({"reason": result["reason"]} if "reason" in result else {}),
                                        **({"error": result["error"]} if "error" in result else {}),
                                        **({"checks": result["checks"]} if "checks" in result else {})}
        log(f"{section}: {result['status']} in {result['seconds']:.1f} s -> {path.name}")
        summary["seconds"] = round(time.perf_counter() - t_begin, 1)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    summary["all_ok"] = not failed
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    log(f"done: {'all sections that ran passed' if not failed else 'FAILURES'}; {args.out}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
