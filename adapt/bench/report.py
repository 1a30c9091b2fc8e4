"""`adapt bench report`: rerun the benchmarks behind the README's results table, rewrite their results
files, and rewrite that table (in README.md and docs/benchmarks.md) from those files.

    adapt bench report                  # ~40 min on 2 cores (SmolLM2; + ~10 min once to build packages)
    adapt bench report --render-only    # only rewrite the tables from the current results files
    adapt bench report --quick --pair demo --results /tmp/r --readme /tmp/README.md --docs /tmp/b.md

A *headline benchmark* is one entry of `HEADLINES`: an `adapt bench speed` or `adapt bench policies`
run with fixed arguments, whose files go to ``RESULTS/<benchmark>/<pair>/``. The report runs each one
in this process through the same parser and runner as the command line, then writes, next to the
benchmark's own files, ``run.json`` (the command, the commit, the date, the machine: CPU model, its
vector flags, cores) and a ``README.md`` that says the same in prose.

The table lives between ``<!-- results:start -->`` and ``<!-- results:end -->`` (`START`, `END`) in
each document; `render_table` builds it from the results files alone, so the README can never say
more than the files do (tests/test_report.py checks that README.md equals what `--render-only`
renders).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
START = "<!-- results:start -->"
END = "<!-- results:end -->"


@dataclass(frozen=True)
class Headline:
    """One benchmark behind the README's table: ``adapt bench <benchmark> <args> --out <folder>``,
    the folder ``results/<name>/<pair>/`` (`name`: the benchmark's, unless one benchmark has two
    headlines)."""

    benchmark: str  # "speed" | "policies"
    args: tuple[str, ...]  # without --pair and --out (the report adds them)
    quick_args: tuple[str, ...]  # used instead of `args` by --quick (a smoke run: minutes on the demo pair)
    folder_name: str = ""

    @property
    def name(self) -> str:
        """The headline's results folder and its `--only` name."""
        return self.folder_name or self.benchmark


HEADLINES = (
    Headline("speed",
             ("--prompts", "models/smollm2/heldout_prompts.jsonl", "--batch-sizes", "1,8", "--num-prompts", "8",
              "--rows", "adapt-ar,adapt-policy,vllm,vllm-ngram",
              "--threads", "2", "--rounds", "4", "--interleave", "--compile", "aot"),
             ("--batch-sizes", "1", "--num-prompts", "1", "--max-tokens", "8", "--rows", "adapt-ar,adapt-policy",
              "--threads", "2", "--rounds", "1", "--interleave", "--compile", "off", "--no-profile")),
    # long documents to summarise and short chat in turns (vLLM #52258: drafts are accepted least on
    # long contexts), each class against the static configurations and vLLM
    Headline("speed",
             ("--workload", "longdoc-chat", "--batch-sizes", "1", "--num-prompts", "8",
              "--rows", "adapt-ar,adapt-policy,adapt-suffix,adapt-suffix-drafter,adapt-k4,vllm,vllm-ngram",
              "--threads", "2", "--rounds", "4", "--interleave", "--compile", "aot"),
             ("--workload", "mixed", "--batch-sizes", "1", "--num-prompts", "3", "--max-tokens", "8",
              "--rows", "adapt-ar,adapt-policy,adapt-k4", "--threads", "2", "--rounds", "1", "--interleave",
              "--compile", "off", "--no-profile"),
             folder_name="speed-longdoc"),
    Headline("policies",
             ("--quick", "--workload", "mixed", "--live-loads", "1,8", "--rounds", "6", "--interleave", "--instances",
              "--seed", "0"),
             ("--quick", "--live-loads", "1", "--replay-loads", "1", "--requests", "8", "--max-tokens", "16",
              "--rounds", "1", "--seed", "0")),
)


def folder(results: Path, benchmark: str, pair: str) -> Path:
    """Where one benchmark's files for one pair live: ``results/<benchmark>/<pair>/``."""
    return results / benchmark / pair


def machine() -> dict:
    """This machine as a results file names it: CPU model, the capability flags it has
    (`workers.cpu_capability.CAPABILITY_FLAGS`, as the profile cache keys them), cores."""
    from workers.cpu_capability import cpu_identity

    cpu = cpu_identity()
    return {"cpu": cpu["cpu"], "flags": cpu["flags"], "cores": os.cpu_count() or 1}


def commit() -> str:
    """The checked-out commit (short hash), ``+modified`` when tracked files outside results/ differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # results/ is what the report writes itself (a later headline runs after an earlier one wrote there)
    return head + ("+modified" if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!results") else "")


def folder_readme(meta: dict, benchmark: str, pair: str) -> str:
    """The short README.md of one results folder, from its run.json."""
    m = meta["machine"]
    flags = ", ".join(m["flags"]) or "none of the capability flags"
    lines = [f"# `adapt bench {benchmark}`, {pair} pair", "",
             "The latest run of this benchmark on this pair; `adapt bench report` rewrites this folder.", "",
             f"- command: `{meta['command']}`",
             f"- commit: `{meta['commit']}`",
             f"- date: {meta['date']}",
             f"- machine: {m['cpu']}, {m['cores']} cores, flags {flags}"]
    if meta.get("note"):
        lines.append(f"- note: {meta['note']}")
    if meta.get("duration_s"):
        lines.append(f"- duration: {meta['duration_s'] / 60:.1f} min")
    return "\n".join(lines) + "\n"


def write_meta(out: Path, meta: dict, benchmark: str, pair: str) -> None:
    (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    (out / "README.md").write_text(folder_readme(meta, benchmark, pair), encoding="utf-8")


def run_headline(h: Headline, pair: str, results: Path, quick: bool) -> dict:
    """Run one headline benchmark in this process and write its run.json and README.md; returns the meta."""
    from adapt.cli import build_parser

    out = folder(results, h.name, pair)
    argv = ["bench", h.benchmark, "--pair", pair, *(h.quick_args if quick else h.args), "--out", str(out)]
    args = build_parser().parse_args(argv)
    code_commit = commit()  # before the run: the run rewrites tracked results files
    began = time.perf_counter()
    code = int(args.run(args) or 0)
    if code:
        raise SystemExit(f"adapt bench report: `adapt {shlex.join(argv)}` exited with {code}")
    shown = [a if a != str(out) else _shown_path(out) for a in argv]
    meta = {"command": "adapt " + shlex.join(shown), "commit": code_commit,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "duration_s": round(time.perf_counter() - began, 1)}
    write_meta(out, meta, h.benchmark, pair)
    return meta


def _shown_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _ratio(x: float) -> str:
    return f"{x:.3f}×" if abs(x - round(x, 2)) > 1e-9 else f"{x:.2f}×"


def _speed_rows(out: Path) -> list[tuple[str, str, str]]:
    """(what, number, against) per batch size of a speed run: the adaptive policy over autoregressive decoding."""
    report = json.loads((out / "speed.json").read_text(encoding="utf-8"))
    cfg = report["config"]
    by = {(r["row"], r["batch"]): r for r in report["results"]}
    paired = report.get("ratios", {}).get("paired", {}).get("adapt-policy/adapt-ar", {})
    plain = report.get("ratios", {}).get("adapt-policy/adapt-ar", {})
    prompts = Path(str(cfg.get("prompts", "prompts"))).name if "file" in str(cfg.get("prompts")) else cfg.get("prompts")
    steps = {"aot": "compiled packages", "off": "eager steps"}.get(cfg.get("compile"), f"compile {cfg.get('compile')}")
    if report.get("ratios", {}).get("per_class"):  # a mix of prompt classes: a row per class
        return _class_rows(report, prompts, steps)
    rows = []
    for b in cfg["batch_sizes"]:
        ours, ar = by.get(("adapt-policy", b)), by.get(("adapt-ar", b))
        if ours is None or ar is None:
            continue
        p = paired.get(str(b))
        if p:
            number = f"**{_ratio(p['median'])}** (rounds {', '.join(f'{v:.3f}' for v in p['rounds'])}); " \
                     f"{ours['tokens_per_s']:.0f} against {ar['tokens_per_s']:.0f} tok/s, τ {ours['tau']:.2f}"
        else:
            number = f"**{_ratio(plain.get(str(b), ours['tokens_per_s'] / ar['tokens_per_s']))}**; " \
                     f"{ours['tokens_per_s']:.0f} against {ar['tokens_per_s']:.0f} tok/s, τ {ours['tau']:.2f}"
        n = cfg["num_prompts"]
        what = (f"speed, adaptive policy, batch {b}: {n} prompt{'s' if n != 1 else ''} ({prompts}) × "
                f"{cfg['max_tokens']} tokens, greedy, {steps}")
        rows.append((what, number, "autoregressive decoding on the same engine (`adapt-ar`)"
                     + (", interleaved step by step" if cfg.get("interleave") else "")))
        theirs = {name: by[(name, b)] for name in ("vllm", "vllm-ngram") if by.get((name, b), {}).get("tokens_per_s")}
        if theirs:
            best = max(theirs, key=lambda name: theirs[name]["tokens_per_s"])
            number = (f"**{_ratio(ours['tokens_per_s'] / theirs[best]['tokens_per_s'])}**; {ours['tokens_per_s']:.0f} against "
                      + ", ".join(f"{name} {e['tokens_per_s']:.0f}" for name, e in theirs.items()) + " tok/s")
            rows.append((what.replace("speed, adaptive policy", "speed against vLLM, adaptive policy"), number,
                         f"the faster of vLLM's CPU build (`vllm`) and vLLM with n-gram speculation (`vllm-ngram`), "
                         f"same weights and dtype, rounds one after another (`{best}` here)"))
    return rows


def _class_rows(report: dict, prompts: str, steps: str) -> list[tuple[str, str, str]]:
    """(what, number, against) per prompt class and batch size of a speed run over a mix of classes
    (`ratios.per_class`): the adaptive policy against the fastest static row on that class, over
    autoregressive decoding round by round, and beside vLLM's rows on the same prompts."""
    from adapt.bench.speed import is_static

    cfg = report["config"]
    classes = cfg.get("prompt_classes") or []
    rates = {(r["row"], r["batch"]): r.get("per_class", {}) for r in report["results"]}
    rows = []
    for cls, per_batch in report["ratios"]["per_class"].items():
        for b, v in per_batch.items():
            ours = rates.get(("adapt-policy", int(b)), {}).get(cls)
            if ours is None or "best_static" not in v:
                continue
            best = rates[(v["best_static"], int(b))][cls]
            number = (f"**{_ratio(v['ratio'])}**; {ours['tokens_per_s']:.1f} against {best['tokens_per_s']:.1f} tok/s, "
                      f"τ {ours['tau']:.2f} against {best['tau']:.2f}")
            if "over_ar" in v:
                number += (f"; {_ratio(v['over_ar']['median'])} `adapt-ar` (rounds "
                           + ", ".join(f"{x:.3f}" for x in v["over_ar"]["rounds"]) + ")")
            theirs = [f"{name} {rates[(name, int(b))][cls]['tokens_per_s']:.1f}" for name in ("vllm", "vllm-ngram")
                      if cls in rates.get((name, int(b)), {})]
            if theirs:
                number += "; " + ", ".join(theirs) + " tok/s"
            statics = [r for (r, bb), pc in rates.items() if bb == int(b) and cls in pc and is_static(r)]
            what = (f"speed, adaptive policy, batch {b}, {cls} class: {classes.count(cls)} of {cfg['num_prompts']} "
                    f"prompts ({prompts}) × {cfg['max_tokens']} tokens, greedy, {steps}")
            rows.append((what, number, f"the fastest static configuration on that class (`{v['best_static']}` of "
                         + ", ".join(f"`{r}`" for r in statics) + ")"
                         + (", interleaved step by step" if cfg.get("interleave") else "")))
    return rows


def _policies_rows(out: Path) -> list[tuple[str, str, str]]:
    """(what, number, against) per live load of a policies run: adaptive goodput over the best static policy."""
    rows = json.loads((out / "policies.json").read_text(encoding="utf-8"))
    table = []
    for r in sorted(rows, key=lambda r: (str(r.get("workload")), r["concurrency"])):
        if r["policy"] != "adaptive" or r["mode"] != "live" or "best_static" not in r:
            continue
        what = f"goodput, adaptive policy, live, {r.get('workload', 'default')} workload, {r['concurrency']} " \
               f"request{'s' if r['concurrency'] != 1 else ''} in flight"
        number = (f"**{_ratio(r['gain_vs_best_static'])}** ({r['goodput_tok_s']:.1f} against "
                  f"{r['best_static_goodput_tok_s']:.1f} tok/s); SLA attainment {r['sla_attainment']:.2f} against "
                  f"{r['best_static_sla']:.2f}")
        table.append((what, number, f"the best static policy at that load (`{r['best_static']}`)"))
    return table


RENDERERS = {"speed": _speed_rows, "policies": _policies_rows}


def render_table(results: Path, pair: str = "smollm2", base: str = "") -> str:
    """The results table (Markdown, between the markers) from the files under `results` for `pair`;
    links to the results folders start with `base` (``"../"`` from docs/)."""
    lines = ["| what | number | against | results |", "|---|---|---|---|"]
    notes = []
    for h in HEADLINES:
        out = folder(results, h.name, pair)
        if not (out / "run.json").is_file():
            continue
        meta = json.loads((out / "run.json").read_text(encoding="utf-8"))
        rel = f"results/{h.name}/{pair}/"
        for what, number, against in RENDERERS[h.benchmark](out):
            lines.append(f"| {what} | {number} | {against} | [`{rel}`]({base}{rel}) |")
        m = meta["machine"]
        notes.append(f"- [`{rel}`]({base}{rel}): command `{meta['command']}`; commit `{meta['commit']}`, {meta['date']}; "
                     f"machine {m['cpu']}, {m['cores']} cores, flags {', '.join(m['flags']) or 'none recorded'}"
                     + (f" ({meta['note']})" if meta.get("note") else ""))
    return "\n".join([START, *lines, "", *notes, END])


def replace_table(text: str, table: str, name: str) -> str:
    """`text` with the part between the markers (included) replaced by `table`."""
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"adapt bench report: {name} has no `{START}` … `{END}` markers")
    return text[:i] + table + text[j + len(END):]


def rewrite_docs(results: Path, pair: str, docs: list[tuple[Path, str]]) -> None:
    """Rewrite the table of each (document, link base) from the files under `results`."""
    for path, base in docs:
        table = render_table(results, pair, base)
        path.write_text(replace_table(path.read_text(encoding="utf-8"), table, str(path)), encoding="utf-8")
        print(f"rewrote the results table in {path}")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="rerun the README's headline benchmarks and rewrite its results table",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="smollm2", choices=("smollm2", "demo"), help="model pair (default smollm2)")
    p.add_argument("--render-only", action="store_true",
                   help="only rewrite the tables from the current results files (no benchmarking)")
    p.add_argument("--quick", action="store_true", help="a smoke run of every headline benchmark (numbers are rough)")
    p.add_argument("--only", default="",
                   help="comma-separated headlines to rerun (default: all of " + ",".join(h.name for h in HEADLINES) + ")")
    p.add_argument("--results", type=Path, default=REPO_ROOT / "results", help="results root (default results/)")
    p.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md", help="README whose table is rewritten")
    p.add_argument("--docs", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md",
                   help="benchmarks page whose table is rewritten")
    p.set_defaults(run=run)


def run(args) -> int:
    if not args.render_only:
        os.chdir(REPO_ROOT)  # the headline arguments name files relative to the repository
        only = {s for s in args.only.split(",") if s}
        unknown = only - {h.name for h in HEADLINES}
        if unknown:
            raise SystemExit(f"adapt bench report: --only: unknown benchmark(s) {sorted(unknown)}")
        for h in HEADLINES:
            if not only or h.name in only:
                meta = run_headline(h, args.pair, args.results, args.quick)
                print(f"{h.name}: {meta['duration_s'] / 60:.1f} min -> {folder(args.results, h.name, args.pair)}")
    rewrite_docs(args.results, args.pair, [(args.readme, ""), (args.docs, "../")])
    return 0
