"""`adapt bench load --soak N`: N floods in a row against a running server, each decoder replica's
memory after each.

A *flood* is one `adapt.bench.load.run_load` (``--concurrency`` clients, ``--requests`` requests).
After each, once the workers have heartbeated again, it reads every worker's resident memory from
the server's ``GET /metrics`` (``adapt_worker_rss_bytes``, from each worker's heartbeat), so it
measures replicas on any node. It writes ``soak.json`` (per flood: wall time, completed, errors,
each worker's RSS in MiB; per worker: its growth from the second flood to the last), ``soak.png``
(RSS against flood) and a ``README.md`` (command, commit, date, machine) into ``--soak-out``
(default ``results/load-soak/<pair>/``, the pair from the model id ``adapt-<pair>``).

The second flood is the reference, not the first: the first also pays for what a worker allocates
once (its first batch at each shape class, the allocator's arenas).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import re
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_soak", "worker_rss_mib", "write_soak"]

_RSS = re.compile(r'^adapt_worker_rss_bytes\{worker="([^"]+)"\}\s+([0-9.eE+-]+)\s*$', re.MULTILINE)


def worker_rss_mib(metrics_text: str) -> dict[str, float]:
    """Each worker's RSS in MiB from a ``/metrics`` page (Prometheus text)."""
    return {w: round(float(v) / 2**20, 1) for w, v in _RSS.findall(metrics_text)}


def run_soak(url: str, floods: int, flood: Callable[[], dict[str, Any]], settle_s: float = 1.5,
             say: Callable[[str], None] = print) -> dict[str, Any]:
    """`floods` calls of `flood` (one load run each) against the server at `url`; see the module
    docstring. settle_s: the wait for the workers' next heartbeat after a flood."""
    import httpx

    rows = []
    for i in range(1, floods + 1):
        t0 = time.perf_counter()
        result = flood()
        wall = time.perf_counter() - t0
        time.sleep(settle_s)
        rss = worker_rss_mib(httpx.get(url + "/metrics", timeout=30).text)
        rows.append({"flood": i, "wall_s": round(wall, 2), "completed": result["completed"],
                     "errors": result["errors"], "rss_mib": rss})
        say(f"flood {i}/{floods}: {result['completed']} completed, {result['errors']} errors, {wall:.1f} s; RSS MiB "
            + ", ".join(f"{w}: {v}" for w, v in sorted(rss.items())))
    ref = rows[1]["rss_mib"] if len(rows) > 1 else rows[0]["rss_mib"]
    last = rows[-1]["rss_mib"]
    growth = {w: round(last[w] - ref[w], 1) for w in last if w in ref}
    return {"url": url, "floods": rows, "growth_from_second_mib": growth,
            "max_growth_from_second_mib": max(growth.values(), default=None)}


def write_soak(out: Path, result: dict[str, Any], command: str) -> None:
    """soak.json, soak.png and README.md under `out`."""
    from adapt.bench.report import commit, machine

    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "commit": commit(), "date": _dt.datetime.now(_dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), "machine": machine()}
    (out / "soak.json").write_text(json.dumps({**meta, **result}, indent=1) + "\n", encoding="utf-8")
    _plot(out / "soak.png", result)
    m = meta["machine"]
    lines = ["# `adapt bench load --soak`: decoder memory over repeated floods", "",
             f"- command: `{command}`", f"- commit: `{meta['commit']}`", f"- date: {meta['date']}",
             f"- machine: {m['cpu']}, {m['cores']} cores, flags {', '.join(m['flags']) or 'none'}", "",
             "| flood | wall s | completed | errors | " + " | ".join(
                 f"RSS MiB {w}" for w in sorted(result["floods"][0]["rss_mib"])) + " |",
             "|---|---|---|---|" + "---|" * len(result["floods"][0]["rss_mib"])]
    for row in result["floods"]:
        lines.append(f"| {row['flood']} | {row['wall_s']} | {row['completed']} | {row['errors']} | "
                     + " | ".join(str(row["rss_mib"].get(w, "")) for w in sorted(result["floods"][0]["rss_mib"]))
                     + " |")
    lines += ["", "Growth from the second flood to the last (MiB): " + ", ".join(
        f"{w}: {g:+.1f}" for w, g in sorted(result["growth_from_second_mib"].items())), ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")


def _plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    workers = sorted({w for row in result["floods"] for w in row["rss_mib"]})
    for w in workers:
        pts = [(row["flood"], row["rss_mib"][w]) for row in result["floods"] if w in row["rss_mib"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=w)
    ax.set_xlabel("flood")
    ax.set_ylabel("worker RSS (MiB)")
    ax.set_title("decoder memory over repeated floods")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def soak_command(args) -> str:
    """The ``adapt bench load --soak`` command line that `args` (parsed) stand for."""
    parts = ["adapt bench load", "--url", args.url, "--concurrency", str(args.concurrency), "--requests",
             str(args.requests), "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature)]
    for item in args.header:
        parts += ["--header", item]
    for prompt in args.prompt or ():
        parts += ["--prompt", json.dumps(prompt)]
    parts += ["--soak", str(args.soak)] + (["--soak-out", str(args.soak_out)] if args.soak_out else [])
    return " ".join(parts)


def soak_from_args(args, headers: dict[str, str], prompts: list[str]) -> int:
    """`adapt bench load --soak N` (the load options size each flood)."""
    import httpx

    from adapt.bench.load import run_load

    url = args.url.rstrip("/")
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    out = Path(args.soak_out or Path("results") / "load-soak" / model.removeprefix("adapt-"))

    def flood() -> dict[str, Any]:
        return asyncio.run(run_load(url, args.concurrency, args.requests, args.max_tokens, args.temperature, headers,
                                    prompts, warmup=0))

    result = run_soak(url, args.soak, flood)
    write_soak(out, result, soak_command(args))
    print(json.dumps({"out": str(out), "growth_from_second_mib": result["growth_from_second_mib"]}))
    return 0 if all(row["errors"] == 0 for row in result["floods"]) else 1
