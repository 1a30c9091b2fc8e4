"""`adapt bench kernels`: verification kernel vs torch reference, per rule.

Times `kernels.verify` on one ragged-batch shape (default batch 64 x K 16 x vocab 151,936):
- stop-first verification on CPU (`kernels/stop_first.py`, the engine's CPU path) and the
  per-position torch reference (the Triton kernel's twin),
- the Triton kernel under the interpreter on CPU (TRITON_INTERPRET=1; slow, a correctness
  tool; timed once, for the rules in --interpreter-rules),
- where CUDA is available, the compiled Triton kernel and the reference on the GPU.
Also checks that the backends emit identical tokens. Writes DIR/kernels.json and
DIR/kernels.png. A benchmark, not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("kernels", help="verification kernels vs torch reference (JSON + plot)")
    parser.add_argument("--out", required=True, help="output directory (kernels.json, kernels.png)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=16, help="drafts per row")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--rules", default="",
                        help="comma-separated rules timed with the reference (and on CUDA); default: every rule "
                             "of the table (kernels/rules.py)")
    parser.add_argument("--interpreter-rules", default="rejection,eps_tvd",
                        help="rules timed under the Triton interpreter on CPU ('' to skip)")
    parser.add_argument("--interpreter-batch", type=int, default=4,
                        help="rows timed under the interpreter (first rows of the batch; the full-batch "
                             "time is extrapolated linearly, as the kernel runs one program per position)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--ragged", action="store_true",
                        help="vary draft counts (every 7th row 0, every 5th K/2) instead of K for all")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run)


def _inputs(batch, k, vocab, seed, device, ragged=False):
    import torch

    g = torch.Generator().manual_seed(seed)
    ks = torch.full((batch,), k, dtype=torch.int64)
    if ragged:
        ks[::7] = 0
        ks[1::5] = max(k // 2, 1)
    n = int(ks.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), ks.cumsum(0)]).to(torch.int32)
    logits = torch.randn(n + batch, vocab, generator=g).mul_(2.0)
    p = logits.softmax(-1)                                               # [N + B, V]
    is_draft = torch.ones(n + batch, dtype=torch.bool)
    is_draft[cu[1:].long() + torch.arange(batch)] = False
    q = logits[is_draft].add_(torch.randn(n, vocab, generator=g)).softmax(-1)   # [N, V] a related drafter
    del logits
    e_draft = torch.rand(n, vocab, generator=g).neg_().log1p_().neg_()
    x = (q / e_draft).argmax(-1)                                         # drafts ~ q
    del e_draft
    u = torch.rand(n, generator=g)
    s = torch.rand(n + batch, generator=g)                               # one draw uniform per target row
    out = dict(draft_tokens=x, cu_num_draft=cu, target_probs=p, draft_probs=q, uniforms=u, sample_u=s)
    return {name: t.to(device) for name, t in out.items()}, n


def _first_rows(d, rows):
    """The first `rows` requests of a batch (views where possible)."""
    cu = d["cu_num_draft"][: rows + 1]
    n = int(cu[-1])
    return dict(draft_tokens=d["draft_tokens"][:n], cu_num_draft=cu, target_probs=d["target_probs"][: n + rows],
                draft_probs=d["draft_probs"][:n], uniforms=d["uniforms"][:n], sample_u=d["sample_u"][: n + rows])


def _call_rows(d, rule, backend, k, rows):
    from kernels import verify

    rule_t, prm, prm2 = _rule_args(rule, rows, d["target_probs"].device)
    return lambda: verify(d["draft_tokens"], d["cu_num_draft"], d["target_probs"], d["draft_probs"],
                          rule_t, prm, prm2, d["uniforms"], d["sample_u"], k, backend=backend)


def _rule_args(rule, batch, device):
    import torch
    from kernels import DEFAULT_PARAMS

    prm, prm2 = DEFAULT_PARAMS[rule]
    return (torch.full((batch,), int(rule), dtype=torch.int32, device=device),
            torch.full((batch,), prm, device=device), torch.full((batch,), prm2, device=device))


def _time(fn, repeats, sync):
    times, out = [], None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times, out


def run(args) -> int:
    interp_rules = [r for r in args.interpreter_rules.split(",") if r.strip()]
    if interp_rules:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before kernels.triton_verify is imported
    import torch
    from kernels import RULES, parse_rule, verify

    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rules = [parse_rule(r) for r in args.rules.split(",") if r.strip()] or [parse_rule(r) for r in sorted(RULES)]
    interp = [parse_rule(r) for r in interp_rules]
    batch, k = args.batch, args.k
    cpu = torch.device("cpu")
    data, num_tokens = _inputs(batch, k, args.vocab, args.seed, cpu, args.ragged)
    shape = dict(batch=batch, max_k=k, vocab=args.vocab, num_tokens=num_tokens, ragged=args.ragged)
    print(f"kernels bench: {shape}, torch threads {torch.get_num_threads()}", flush=True)

    def call(d, rule, backend, device):
        rule_t, prm, prm2 = _rule_args(rule, batch, device)
        return lambda: verify(d["draft_tokens"], d["cu_num_draft"], d["target_probs"], d["draft_probs"],
                              rule_t, prm, prm2, d["uniforms"], d["sample_u"], k, backend=backend)

    results = []
    for rule in rules:
        rec = {"rule": rule.name}
        ms, all_ms, ref = _time(call(data, rule, "torch", cpu), args.repeats, lambda: None)
        rec.update(reference_cpu_ms=ms, reference_cpu_all_ms=all_ms,
                   mean_accepted=float(ref.num_accepted.float().mean()),
                   mean_tvd_spent=float(ref.tvd_spent.mean()))
        ms_f, all_f, first = _time(call(data, rule, "stop_first", cpu), args.repeats, lambda: None)
        rec.update(stop_first_cpu_ms=ms_f, stop_first_cpu_all_ms=all_f,
                   stop_first_equal=bool(torch.equal(first.tokens, ref.tokens)
                                         and torch.equal(first.num_accepted, ref.num_accepted)))
        print(f"  {rule.name:9s} reference cpu {ms:10.1f} ms, stop-first cpu {ms_f:10.1f} ms "
              f"equal={rec['stop_first_equal']}", flush=True)
        if rule in interp:
            rows = min(args.interpreter_batch, batch)
            sub = _first_rows(data, rows)
            sub_call = lambda backend: _call_rows(sub, rule, backend, k, rows)  # noqa: E731
            _call_rows(_first_rows(data, 1), rule, "triton", k, 1)()           # interpreter warm-up
            ms_i, _, tri = _time(sub_call("triton"), 1, lambda: None)
            ms_s, _, ref_s = _time(sub_call("torch"), 1, lambda: None)
            rec.update(interpreter_rows=rows, interpreter_cpu_ms=ms_i, reference_cpu_ms_same_rows=ms_s,
                       interpreter_cpu_ms_extrapolated=ms_i * batch / rows,
                       interpreter_equal=bool(torch.equal(tri.tokens, ref_s.tokens)
                                              and torch.equal(tri.num_accepted, ref_s.num_accepted)
                                              and torch.equal(tri.tokens, ref.tokens[:rows])))
            print(f"  {rule.name:9s} triton interpreter {ms_i:10.1f} ms on {rows} rows "
                  f"(reference {ms_s:.1f} ms; x{batch / rows:.0f} = {ms_i * batch / rows:.0f} ms) "
                  f"equal={rec['interpreter_equal']}", flush=True)
        results.append(rec)

    cuda = None
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        dev = torch.device("cuda")
        gpu = {name: t.to(dev) for name, t in data.items()}
        sync = torch.cuda.synchronize
        cuda = torch.cuda.get_device_name(dev)
        for rec in results:
            rule = parse_rule(rec["rule"])
            _time(call(gpu, rule, "triton", dev), 2, sync)                     # compile + warm up
            ms_t, _, tri = _time(call(gpu, rule, "triton", dev), max(args.repeats, 10), sync)
            ms_r, _, ref = _time(call(gpu, rule, "torch", dev), max(args.repeats, 10), sync)
            rec.update(triton_cuda_ms=ms_t, reference_cuda_ms=ms_r, cuda_equal=bool(
                torch.equal(tri.tokens, ref.tokens) and torch.equal(tri.num_accepted, ref.num_accepted)))
            print(f"  {rec['rule']:9s} cuda triton {ms_t:8.2f} ms, reference {ms_r:8.2f} ms", flush=True)
    elif torch.cuda.is_available():
        print("  (CUDA present but TRITON_INTERPRET=1 is set: compiled CUDA timings skipped)")

    report = {"benchmark": "kernels", "shape": shape, "repeats": args.repeats,
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": platform.machine(), "cpu_count": os.cpu_count(),
              "load_average": list(os.getloadavg()), "cuda_device": cuda, "results": results}
    (out_dir / "kernels.json").write_text(json.dumps(report, indent=2))
    _plot(report, out_dir / "kernels.png")
    print(f"wrote {out_dir / 'kernels.json'} and {out_dir / 'kernels.png'}")
    return 0


def _plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("stop_first_cpu_ms", "stop-first (CPU)"), ("reference_cpu_ms", "torch reference (CPU)"),
              ("interpreter_cpu_ms_extrapolated", "Triton interpreter (CPU, extrapolated)"),
              ("reference_cuda_ms", "torch reference (CUDA)"), ("triton_cuda_ms", "Triton (CUDA)")]
    series = [(key, label) for key, label in series if any(key in r for r in report["results"])]
    rules = [r["rule"] for r in report["results"]]
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (key, label) in enumerate(series):
        xs = [j + i * width for j, r in enumerate(report["results"]) if key in r]
        ys = [r[key] for r in report["results"] if key in r]
        ax.bar(xs, ys, width=width, label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(rules))], rules)
    ax.set_yscale("log")
    ax.set_ylabel("ms per verify call (median)")
    s = report["shape"]
    ax.set_title(f"verify: batch {s['batch']} x K {s['max_k']} x vocab {s['vocab']} ({s['num_tokens']} drafts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
