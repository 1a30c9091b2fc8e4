"""`adapt bench forward`: what one target forward (and one drafter pass) costs, side by side.

    adapt bench forward widths --pair smollm2 --compile aot       # per width, on the engine the benchmarks use
    adapt bench forward widths --contexts 64,448,960              # + per width after each prompt length
    adapt bench forward variants                                  # demo target, bf16, 1 thread
    adapt bench forward variants --linears                        # + fp32 / bf16 / packed F.linear table
    adapt bench forward variants --thresholds                     # + shape-aware fp32 thresholds
    adapt bench forward variants --torch-compile                  # + torch.compile of the forward
    adapt bench forward variants --thread-table                   # + the default forward at 1 vs N threads
    adapt bench forward variants --wide-table                     # + wide fp32 matmuls on vs off

(`python -m adapt.bench.forward_speed ...` runs the same.) Each prints its report as JSON and
writes it to ``--out``.

**widths**: the cost model's verify table is indexed by the tokens a target forward takes, and a
start-up profile times it at a grid of token counts (`adapt.cost_model.PROFILE_TOKEN_GRID`);
between grid points the table interpolates linearly. This times, on the pair's engine at one row
after a prompt of ``--context`` tokens, the target forward over 1 .. ``--max-tokens`` tokens (as a
decode step verifies an anchor and its drafts) and the drafter's denoising pass over
``[anchor, MASK x span]`` for each span (`DrafterContext.block_pass`, the compiled package where it
takes the shape). The widths take turns in sweeps, in a new shuffled order each sweep, as the
start-up profile times its grid (`adapt.cost_model.sweep_medians`: a drift of the machine meets
every width alike, and so does the slower first call after the other model's; in a fixed order the
first forward of each sweep read ~15 % slower than the next), and each keeps its median.
``--contexts`` also times the target forward after each of those prompt lengths, in the same sweeps
(``target_forward_ms_by_context``): what a wide verify costs as the cache grows (on SmolLM2, its
extra over one token is attention, ~0.4 ms for five more tokens over 64 cached ones and ~4.5 ms over
960; the engine is sized for the longest).

**variants**: Variants of the same `TargetModel`, loaded side by side in one process and timed in turns (so a
busy machine slows all of them alike; compare the ratios, not the absolute times):
- `plain`: `load_target(shape_aware=False, fuse=False)`, every projection its own bf16 matmul;
- `fused`: q/k/v and gate/up fused (`fuse=True`), plain bf16 matmuls;
- `fused+packed`: fused, shape-aware linears without fp32 shadows (threshold 0);
- `fused+sa`: fused and shape-aware linears, the engine's default on CPU (workers/linear.py);
- `sa@N` (`--thresholds`): `fused+sa` with `SMALL_MATMUL_MACS` = N;
- `compiled` (`--torch-compile`): `fused` with a plain `torch.compile(forward, dynamic=True)`, no
  freezing; its compile time (first calls) is reported separately. This is *not* the engine's
  compiled path (workers/compiled.py: freezing, cpp_wrapper; docs/engine.md, "Compiled decode
  steps"), which measured 0.5-0.6x of the eager forward where this one measured 0.9-1.3x.
Each (B, T) decodes T new tokens per row after `--context` cached ones: T = 1 is an
autoregressive step, T = 17 a verification of 16 drafts. Rows share their start position and
the forward is told so (`start_value`), as the engine does for such batches.

`--thread-table` times the default (`fused+sa`) forward at one thread and at `--threads` threads,
in turns, for more shapes (B x T tokens from 1 to 136): where OpenMP's fork/join per op costs more
than the second core gives back.

`--wide-table` times the default forward with wide fp32 matmuls from each weight shape's timed
crossover (`auto`, the engine's default: workers/wide_rows.py), from the one constant `WIDE_ROWS`
(`fixed`, workers/linear.py) and without them (`off`), in turns, from one token to a 256-token
prefill. Where the CPU has native bf16 matmuls the variants are the same program (the wide path
never applies).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn import functional as F

SHAPES = ((1, 1), (1, 17), (8, 1), (8, 17))
WIDE_SHAPES = ((1, 1), (1, 4), (4, 1), (1, 6), (1, 7), (1, 8), (8, 1), (1, 9), (1, 10), (1, 12), (12, 1),
               (1, 17), (16, 1), (8, 3), (8, 17), (1, 256))
THREAD_SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 4), (1, 8), (1, 17), (2, 17), (4, 17), (8, 17))
LINEAR_SHAPES = ((256, 768), (256, 256), (768, 256), (256, 1536), (256, 4096))
LINEAR_ROWS = (1, 2, 4, 8, 17, 136)
COLD_WEIGHTS = 24
THRESHOLDS = (500_000, 1_600_000)  # besides the default SMALL_MATMUL_MACS


def _best_us(fn, iters: int, reps: int = 5) -> float:
    """Best of `reps` means over `iters` calls, in µs."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters * 1e6)
    return best


def linear_table(dtype: torch.dtype, iters: int) -> list[dict]:
    """Per weight shape and rows: F.linear through an fp32 copy (input and output cast), plain in
    `dtype`, and with a packed `dtype` weight (workers/linear.py). Each call cycles through
    `COLD_WEIGHTS` distinct weights, so that, as in a real forward, they are not in cache."""
    rows = []
    for fan_in, fan_out in LINEAR_SHAPES:
        w32 = [torch.randn(fan_out, fan_in) for _ in range(COLD_WEIGHTS)]
        w = [x.to(dtype) for x in w32]
        packed = [torch.ops.mkldnn._reorder_linear_weight(x, 1) for x in w]
        for m in LINEAR_ROWS:
            x = torch.randn(m, fan_in).to(dtype)
            us = {
                "fp32_us": _best_us(lambda: [F.linear(x.float(), a).to(dtype) for a in w32], iters),
                "plain_us": _best_us(lambda: [F.linear(x, a) for a in w], iters),
                "packed_us": _best_us(lambda: [torch.ops.mkldnn._linear_pointwise(x, a, None, "none", [], "")
                                               for a in packed], iters),
            }
            rows.append({"in": fan_in, "out": fan_out, "rows": m, "macs": m * fan_in * fan_out}
                        | {k: round(v / COLD_WEIGHTS, 1) for k, v in us.items()})
    return rows


def forward_table(target: str, dtype: torch.dtype, context: int, iters: int, compile_: bool,
                  thresholds: tuple[int, ...] = (), rounds: int = 7) -> dict:
    from workers.target_model import load_target

    variants = {
        "plain": load_target(target, dtype, shape_aware=False, fuse=False),
        "fused": load_target(target, dtype, shape_aware=False, fuse=True),
        "fused+packed": load_target(target, dtype, shape_aware=False).prepare_for_inference(threshold=0),
        "fused+sa": load_target(target, dtype),
    }
    for n in thresholds:
        variants[f"sa@{n}"] = load_target(target, dtype, shape_aware=False).prepare_for_inference(threshold=n)
    compile_s = None
    if compile_:  # inductor cannot lower the packed oneDNN weights: compile plain fused linears
        model = load_target(target, dtype, shape_aware=False)
        model.forward = torch.compile(model.forward, dynamic=True)
        variants["compiled"] = model
    max_b = max(b for b, _ in SHAPES)
    caches = {name: m.new_cache(max_b, context + 64) for name, m in variants.items()}
    capture = (1, 3, 5)
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        if compile_:
            t = time.perf_counter()
            for b, T in SHAPES:  # compile (and recompile) once per shape before timing
                ids = torch.randint(0, 100, (b, T), generator=gen)
                variants["compiled"](ids, torch.full((b,), context), caches["compiled"], 0, context + T, capture, start_value=context)
            compile_s = time.perf_counter() - t
        for b, T in SHAPES:
            ids = torch.randint(0, 100, (b, T), generator=gen)
            start = torch.full((b,), context)
            ms = {name: float("inf") for name in variants}
            for _ in range(rounds):  # the variants in turns, best round each
                for name, m in variants.items():
                    call = lambda m=m, c=caches[name]: m(ids, start, c, 0, context + T, capture, start_value=context)
                    ms[name] = min(ms[name], _best_us(call, iters, reps=1) / 1e3)
            out[f"B={b} T={T}"] = {name: round(v, 3) for name, v in ms.items()} | {
                f"{name}/plain": round(v / ms["plain"], 3) for name, v in ms.items() if name != "plain"}
    return {"forward_ms": out, "compile_s": compile_s}


def thread_table(target: str, dtype: torch.dtype, context: int, iters: int, threads: int, rounds: int = 9) -> dict:
    """The default forward at 1 and at `threads` threads, in turns (median of `rounds`), per shape."""
    import statistics

    from workers.target_model import load_target

    model = load_target(target, dtype)
    cache = model.new_cache(max(b for b, _ in THREAD_SHAPES), context + 64)
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for b, T in THREAD_SHAPES:
            ids = torch.randint(0, 100, (b, T), generator=gen)
            start = torch.full((b,), context)
            call = lambda: model(ids, start, cache, 0, context + T, (1, 3, 5), start_value=context)
            ms = {1: [], threads: []}
            for r in range(rounds):
                for n in ((1, threads) if r % 2 else (threads, 1)):
                    torch.set_num_threads(n)
                    ms[n].append(_best_us(call, iters, reps=1) / 1e3)
            med = {n: statistics.median(v) for n, v in ms.items()}
            out[f"B={b} T={T}"] = {"1": round(med[1], 3), str(threads): round(med[threads], 3),
                                   f"{threads}/1": round(med[threads] / med[1], 3)}
    torch.set_num_threads(threads)
    return out


def wide_table(target: str, dtype: torch.dtype, context: int, iters: int, rounds: int = 5) -> dict:
    """The default forward with wide fp32 matmuls from the timed per-shape crossovers (`auto`), from
    `WIDE_ROWS` (`fixed`) and without (`off`), in turns (median of `rounds`), per shape;
    `auto/off` and `fixed/off` < 1 where the wide path pays, `auto/fixed` < 1 where timing the
    crossover pays. One model whose layers' thresholds are switched between the variants, so all
    three read the same weights from the same memory."""
    import statistics

    from workers.linear import WIDE_ROWS, can_pack
    from workers.target_model import load_target
    from workers.wide_rows import calibrate_wide_rows, forward_linears

    model = load_target(target, dtype)
    crossovers = calibrate_wide_rows(model)
    linears = [m for m in forward_linears(model) if m.wide_rows is not None]
    never = 1 << 30  # a threshold no forward reaches: the wide path off
    settings = {"auto": [m.wide_rows for m in linears], "fixed": [WIDE_ROWS] * len(linears),
                "off": [never] * len(linears)}
    cache = model.new_cache(max(b for b, _ in WIDE_SHAPES), context + 300)
    gen = torch.Generator().manual_seed(0)
    out = {"wide_rows": WIDE_ROWS, "native_low_precision": can_pack(next(model.parameters())),
           "crossovers": {f"{o}x{i}": rows for (o, i), rows in crossovers.items()}}
    with torch.inference_mode():
        for b, T in WIDE_SHAPES:
            ids = torch.randint(0, 100, (b, T), generator=gen)
            start = torch.full((b,), context)
            n = max(1, iters // max(1, b * T // 8))
            ms = {k: [] for k in settings}
            for r in range(rounds):
                for k in (list(settings) if r % 2 else list(settings)[::-1]):
                    for m, rows in zip(linears, settings[k]):
                        m.wide_rows = rows
                    ms[k].append(_best_us(lambda: model(ids, start, cache, 0, context + T, start_value=context), n, reps=1) / 1e3)
            med = {k: statistics.median(v) for k, v in ms.items()}
            out[f"B={b} T={T}"] = {k: round(v, 2) for k, v in med.items()} | {
                "auto/off": round(med["auto"] / med["off"], 3), "fixed/off": round(med["fixed"] / med["off"], 3),
                "auto/fixed": round(med["auto"] / med["fixed"], 3)}
    return out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("forward", help="target forward and drafter pass cost per width or per variant (JSON)",
                              description=__doc__.split("\n\n")[0])
    _add_tables(p)


def _add_tables(p: argparse.ArgumentParser) -> None:
    from workers.engine import DEMO_TARGET
    from workers.target_model import DTYPES

    sub = p.add_subparsers(dest="table", required=True)
    w = sub.add_parser("widths", help="per width (tokens of a target forward, span of a drafter pass) on the pair's engine")
    w.add_argument("--pair", default="smollm2", choices=("demo", "smollm2"))
    w.add_argument("--compile", default="aot", choices=("off", "aot"), help="the engine's decode steps")
    w.add_argument("--context", type=int, default=400, help="prompt tokens before the timed positions")
    w.add_argument("--max-tokens", type=int, default=17, help="the widest target forward timed")
    w.add_argument("--contexts", default="", help="comma-separated prompt lengths to time the target "
                   "forward after as well (e.g. 64,448,960)")
    w.add_argument("--sweeps", type=int, default=15)
    w.add_argument("--threads", type=int, default=2)
    w.add_argument("--out", default=None, help="also write the report (JSON) here")
    w.set_defaults(run=run_widths)

    v = sub.add_parser("variants", help="variants of the target forward (fusion, shape-aware linears, threads) in turns")
    v.add_argument("--target", default=str(DEMO_TARGET))
    v.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("--context", type=int, default=300, help="cached tokens per row before the timed call")
    v.add_argument("--iters", type=int, default=20, help="forward calls per timing")
    v.add_argument("--rounds", type=int, default=7, help="timings per variant and shape, in turns; the best counts")
    v.add_argument("--torch-compile", action="store_true", help="also time torch.compile(forward, dynamic=True)")
    v.add_argument("--linears", action="store_true", help="also print the fp32 / plain / packed F.linear table")
    v.add_argument("--thresholds", action="store_true", help="also time fp32 thresholds " + str(THRESHOLDS))
    v.add_argument("--thread-table", action="store_true", help="also time the default forward at 1 vs --threads threads")
    v.add_argument("--wide-table", action="store_true", help="only time the default forward with wide fp32 matmuls auto vs fixed vs off")
    v.add_argument("--out", help="also write the report (JSON) here")
    v.set_defaults(run=run_variants)


def main(argv: list[str] | None = None) -> int:
    """`python -m adapt.bench.forward_speed TABLE ARGS`: the same as `adapt bench forward TABLE ARGS`."""
    p = argparse.ArgumentParser(prog="adapt bench forward", description=__doc__.split("\n\n")[0])
    _add_tables(p)
    args = p.parse_args(argv)
    return args.run(args)


def run_variants(args) -> int:
    from workers.target_model import DTYPES

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    report = {"threads": args.threads, "dtype": args.dtype}
    if args.wide_table:
        report["wide_ms"] = wide_table(args.target, dtype, args.context, args.iters, args.rounds)
        _emit(report, args.out)
        return 0
    if args.linears:
        report["linear_us"] = linear_table(dtype, iters=10)
    report |= forward_table(args.target, dtype, args.context, args.iters, args.torch_compile,
                            THRESHOLDS if args.thresholds else (), args.rounds)
    if args.thread_table:
        report["thread_table_ms"] = thread_table(args.target, dtype, args.context, args.iters, args.threads, args.rounds)
    _emit(report, args.out)
    return 0


def run_widths(args) -> int:
    """The target forward per token count and the drafter pass per span, on the pair's engine."""
    try:
        contexts = sorted({int(c) for c in args.contexts.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(f"adapt bench forward widths: error: --contexts: comma-separated integers, got {args.contexts!r}")
    if any(c < 1 for c in contexts):
        raise SystemExit("adapt bench forward widths: error: --contexts: prompt lengths must be >= 1")

    import functools

    from adapt.bench.policies import chat_prompt_limit, workload_engine
    from adapt.cost_model import sweep_medians

    torch.set_num_threads(args.threads)
    # room for the longest context (workload_engine sizes the cache for its prompts plus this)
    extra = max(args.max_tokens + 8, max(contexts, default=0) + args.max_tokens + 24 - chat_prompt_limit(64))
    engine, _ = workload_engine(args.pair, "mixed", 1, extra, compile=args.compile)
    dr, K = engine.drafter, engine.block
    longest = engine.max_len - args.max_tokens - K - 2
    context = min(args.context, longest)
    contexts = sorted({min(c, longest) for c in contexts})

    def forward(t: int, at: int = context) -> None:
        ids = torch.zeros(1, t, dtype=torch.long)  # [1, t]
        engine.target_forward(ids, torch.full((1,), at), engine.tcache, 0, at + t, start_value=at)

    def draft(span: int) -> None:
        W = context + span + 1
        tokens = torch.zeros(1, span + 1, dtype=torch.long)  # [1, span + 1]: the anchor, then masks
        masked = torch.ones(1, span + 1, dtype=torch.bool)
        masked[:, 0] = False
        rope = dr.rope(context + torch.arange(span + 1)[None], dr.mask_embedding.dtype, bound=engine.dcache.max_len)
        one_pass = engine.drafting.block_pass(engine.dcache.views(0, 1, W), None, rope, 1, span + 1, W)
        torch.softmax(one_pass(tokens, masked).float(), -1)

    points = [("forward", t) for t in range(1, args.max_tokens + 1)]
    if dr is not None:
        points += [("draft", s) for s in range(1, K + 1)]
    points += [("at", c, t) for c in contexts for t in range(1, args.max_tokens + 1)]
    run = {"forward": forward, "draft": draft, "at": lambda c, t: forward(t, c)}
    with torch.inference_mode():  # a new order every sweep, as the start-up profile times its grid
        ms = sweep_medians([functools.partial(run[kind], *n) for kind, *n in points], args.sweeps)
    median = dict(zip(points, ms.tolist()))
    result = {"pair": args.pair, "compile": args.compile, "context": context, "sweeps": args.sweeps,
              "target_forward_ms": {t: round(median[("forward", t)], 3) for t in range(1, args.max_tokens + 1)},
              "drafter_pass_ms": {s: round(median[("draft", s)], 3)
                                  for s in range(1, K + 1)} if dr is not None else {}}
    if contexts:
        result["target_forward_ms_by_context"] = {c: {t: round(median[("at", c, t)], 3)
                                                      for t in range(1, args.max_tokens + 1)} for c in contexts}
    _emit(result, args.out)
    return 0


def _emit(report: dict, out: str | None) -> None:
    print(json.dumps(report, indent=1))
    if out:
        from adapt.bench import write_json

        write_json(out, report)


if __name__ == "__main__":
    raise SystemExit(main())
