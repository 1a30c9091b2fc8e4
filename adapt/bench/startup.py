"""`adapt bench startup`: a cold process, from spawn to its first token and to its last, for the
README main job (`adapt generate --chat "..."`, 128 tokens) against a cold transformers process.

Words used here:
- **first run**: `adapt generate` with an empty profile cache (a fresh cache directory whose
  ``models/`` links to the already pulled model): it times the --dtype auto choice and the cost
  profile (adapt/profile_cache.py) before its first token, as a user's first command does.
- **later run**: the same command again on that cache directory: both are read back.
- **transformers**: a cold Python process that loads the same weights with
  `AutoModelForCausalLM.from_pretrained` (``--hf-dtype``, bfloat16 by default) and runs greedy
  `generate` on the same chat prompt, streaming tokens.
- **first token / end**: seconds from spawning the process to the first byte of generated text
  on its stdout, and to the process's exit.

Each repetition runs the three kinds one after another (transformers, first run, later run), so a
machine whose speed drifts meets them alike; the JSON holds every run, the medians, and the
machine (CPU model, flags, cores). A short Markdown table is written beside it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAIN_JOB = "Write a Python function that checks whether a number is prime."

# a cold transformers process: load, then greedy generate with a streamer that flushes each piece
_HF_SCRIPT = r"""
import sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
path, dtype, message, max_new = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, return_tensors="pt")
if not torch.is_tensor(ids):
    ids = ids["input_ids"]

class Flush(TextStreamer):
    def on_finalized_text(self, text, stream_end=False):
        sys.stdout.write(text); sys.stdout.flush()

with torch.inference_mode():
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, streamer=Flush(tok, skip_prompt=True))
print(f"[{out.shape[1] - ids.shape[1]} tokens]", file=sys.stderr)
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("startup", help="cold process to first token and to the end: adapt (first and later "
                                              "run) against transformers (JSON + Markdown)")
    p.add_argument("--out", required=True, help="output directory (startup.json, startup.md)")
    p.add_argument("--pair", default="smollm2", choices=["smollm2"], help="the pulled pair whose target is timed")
    p.add_argument("--message", default=MAIN_JOB, help="the chat message (default: the README main job)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="repetitions of the three kinds, interleaved")
    p.add_argument("--hf-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the dtype transformers loads the weights in")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one process may take")
    p.set_defaults(run=run)


def timed_process(cmd: list[str], env: dict, timeout: float) -> dict:
    """Spawn ``cmd``; seconds to its first stdout byte and to its exit, its stdout text and the
    tail of its stderr. A process that fails or times out raises RuntimeError with its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    t_first = time.perf_counter() - t0
    rest = proc.stdout.read()
    try:
        err = proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{cmd[:4]} ran past {timeout} s") from None
    t_end = time.perf_counter() - t0
    err_text = err.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:5])} exited {proc.returncode}: {err_text[-2000:]}")
    return {"first_token_s": round(t_first, 3) if first else None, "end_s": round(t_end, 3),
            "text": (first + rest).decode(errors="replace"), "stderr_tail": err_text[-3000:]}


def _stats_line(stderr: str) -> dict:
    """tokens, τ and decode tok/s from `adapt generate`'s closing stderr line (and the seconds its
    dtype choice and profile took, where it timed them), or transformers' token count."""
    out = {}
    for key, pattern in (("dtype_choice_s", r"measured in ([\d.]+) s"), ("profile_s", r"profiled in ([\d.]+) s")):
        if found := re.search(pattern, stderr):
            out[key] = float(found.group(1))
    m = re.search(r"\[(\d+) tokens, tau ([\d.]+), (\d+) tok/s", stderr)
    if m:
        return {"tokens": int(m.group(1)), "tau": float(m.group(2)), "decode_tok_s": float(m.group(3)), **out}
    m = re.search(r"\[(\d+) tokens\]", stderr)
    return {"tokens": int(m.group(1))} if m else {}


def fresh_cache(model: Path, parent: Path) -> Path:
    """An empty cache directory whose models/ links to the pulled ``model`` (nothing else kept)."""
    root = Path(tempfile.mkdtemp(prefix="adapt-startup-", dir=parent))
    (root / "models").mkdir()
    (root / "models" / model.name).symlink_to(model.resolve(), target_is_directory=True)
    return root


def run(args) -> int:
    from adapt.bench.report import commit
    from adapt.commands.info import machine
    from workers.pull import pull

    model = Path(pull(args.pair, progress=True))  # a no-op when pulled: only the profiles start empty
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("ADAPT_CACHE_DIR", None)
    adapt_cmd = [sys.executable, "-m", "adapt.cli", "generate", "--chat", args.message, "--max-tokens",
                 str(args.max_tokens)]
    hf_cmd = [sys.executable, "-c", _HF_SCRIPT, str(model), args.hf_dtype, args.message, str(args.max_tokens)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="adapt-startup-") as scratch:
        for rep in range(args.repeats):
            cache = fresh_cache(model, Path(scratch))
            # the adapt runs keep everything they time in `cache` (--cache-dir, and $ADAPT_CACHE_DIR for
            # what the engine itself keeps: wide-matmul thresholds, compiled packages)
            adapt_env = dict(env, ADAPT_CACHE_DIR=str(cache))
            for kind, cmd, run_env in (("transformers", hf_cmd, env),
                                       ("adapt first run", adapt_cmd + ["--cache-dir", str(cache)], adapt_env),
                                       ("adapt later run", adapt_cmd + ["--cache-dir", str(cache)], adapt_env)):
                print(f"startup: repetition {rep + 1}/{args.repeats}: {kind} ...", file=sys.stderr, flush=True)
                r = timed_process(cmd, run_env, args.timeout)
                row = {"kind": kind, "repeat": rep, "first_token_s": r["first_token_s"], "end_s": r["end_s"],
                       **_stats_line(r["stderr_tail"]), "text_head": r["text"][:80]}
                print(f"  first token {row['first_token_s']} s, end {row['end_s']} s", file=sys.stderr, flush=True)
                runs.append(row)
    kinds = ["transformers", "adapt first run", "adapt later run"]
    summary = {}
    for kind in kinds:
        rows = [r for r in runs if r["kind"] == kind]
        summary[kind] = {"first_token_s": statistics.median(r["first_token_s"] for r in rows),
                         "end_s": statistics.median(r["end_s"] for r in rows),
                         "tokens": statistics.median(r.get("tokens", 0) for r in rows)}
    hf = summary["transformers"]
    for kind in kinds[1:]:
        summary[kind]["first_token_vs_transformers"] = round(summary[kind]["first_token_s"] / hf["first_token_s"], 3)
        summary[kind]["end_vs_transformers"] = round(summary[kind]["end_s"] / hf["end_s"], 3)
    report = {"benchmark": "startup", "command": " ".join(["adapt bench startup", "--out", str(out), "--repeats",
                                                          str(args.repeats), "--max-tokens", str(args.max_tokens),
                                                          "--hf-dtype", args.hf_dtype]),
              "commit": commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine(), "message": args.message, "max_tokens": args.max_tokens,
              "hf_dtype": args.hf_dtype, "model": str(model), "runs": runs, "summary": summary}
    (out / "startup.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "startup.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"Start-up of the README main job ({report['max_tokens']} tokens), cold processes, medians of "
             f"{len(report['runs']) // 3} interleaved repetitions.",
             "",
             f"Machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['flags'])}, torch {m['torch']}; "
             f"commit {report['commit']}, {report['date']}.",
             "",
             "| process | first token (s) | end (s) | tokens | first token / transformers | end / transformers |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, s in report["summary"].items():
        lines.append(f"| {kind} | {s['first_token_s']:.2f} | {s['end_s']:.2f} | {s['tokens']:.0f} | "
                     f"{s.get('first_token_vs_transformers', 1.0):.2f} | {s.get('end_vs_transformers', 1.0):.2f} |")
    return "\n".join(lines) + "\n"
