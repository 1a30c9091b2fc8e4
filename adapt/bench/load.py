"""`adapt bench load`: a short load run against a running ``adapt serve`` (or any OpenAI-compatible server).

    adapt bench load --url http://127.0.0.1:8000 --concurrency 8 --requests 64 \\
        --max-tokens 64 --header X-SLA-TPOT-Ms=50 --out runs/load.json

`concurrency` clients each send streaming completions back to back until `requests` are done.
Per request it measures, from the client's side, *TTFT* (time to the first token) and *TPOT*
(time per output token after the first: ``(t_last - t_first) / (tokens - 1)``), and reads the
server's SLA verdict and τ from the final chunk. It prints and writes requests/s, output
tokens/s, p50/p99 of TPOT and TTFT, SLA attainment and mean τ (`python -m adapt.bench.load` runs the
same). `adapt bench flood` (adapt/bench/flood.py) starts its own Ray Serve application instead and
floods it past its queues.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

DEFAULT_PROMPTS = (
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(x):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "def read_json(path):",
    "# sort a list of tuples by the second item\n",
)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _one(client, url: str, payload: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = last = None
    tokens, final, error = 0, None, None
    async with client.stream("POST", url + "/v1/completions", json=payload, headers=headers) as resp:
        if resp.status_code != 200:
            body = await resp.aread()
            return {"error": f"HTTP {resp.status_code}: {body[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"].get("message")
                continue
            now = time.perf_counter()
            if event["choices"][0].get("text"):
                first = first if first is not None else now
                last = now
            if event["choices"][0].get("finish_reason"):
                final = event
    if final is None:
        return {"error": error or "stream ended without a final chunk"}
    tokens = (final.get("usage") or {}).get("completion_tokens", 0)
    adapt = final.get("adapt") or {}
    ttft = (first - t0) * 1e3 if first is not None else None
    tpot = (last - first) * 1e3 / (tokens - 1) if first is not None and tokens > 1 else None
    return {"tokens": tokens, "ttft_ms": ttft, "tpot_ms": tpot, "e2e_ms": (time.perf_counter() - t0) * 1e3,
            "sla_met": (adapt.get("sla") or {}).get("met"), "tau": (adapt.get("stats") or {}).get("tau"),
            "worker": adapt.get("worker")}


async def run_load(url: str, concurrency: int, requests: int, max_tokens: int, temperature: float,
                   headers: dict[str, str], prompts: list[str], warmup: int = 2) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        def payload(i: int) -> dict[str, Any]:
            return {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": temperature,
                    "seed": i, "stream": True, "stream_options": {"include_usage": True}}

        for i in range(warmup):
            await _one(client, url, payload(i), headers)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)
        results: list[dict[str, Any]] = []

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await _one(client, url, payload(i), headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    tpots = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    ttfts = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    met = [r["sla_met"] for r in ok if r["sla_met"] is not None]
    taus = [r["tau"] for r in ok if r["tau"] is not None]
    workers: dict[str, int] = {}
    for r in ok:
        workers[str(r["worker"])] = workers.get(str(r["worker"]), 0) + 1
    return {
        "url": url, "concurrency": concurrency, "requests": requests, "max_tokens": max_tokens,
        "temperature": temperature, "headers": headers, "wall_s": round(wall, 3),
        "completed": len(ok), "errors": len(results) - len(ok),
        "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 1),
        "tpot_ms": {"p50": percentile(tpots, 50), "p99": percentile(tpots, 99),
                    "mean": statistics.fmean(tpots) if tpots else None},
        "ttft_ms": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
        "sla_attainment": (sum(bool(m) for m in met) / len(met)) if met else None,
        "mean_tau": statistics.fmean(taus) if taus else None,
        "requests_per_worker": workers,
        "error_samples": [r["error"] for r in results if "error" in r][:3],
    }


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("load", help="closed-loop load against a running server: TPOT, TTFT, SLA (JSON)",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(run=lambda args: run(args, p))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--header", action="append", default=[], metavar="NAME=VALUE",
                   help="an SLA header for every request, e.g. X-SLA-TPOT-Ms=50 (repeatable)")
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeatable; default: code prompts)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--soak", type=int, default=None, metavar="N",
                   help="N floods in a row (each: --concurrency clients, --requests requests), each worker's RSS "
                        "after each (adapt/bench/load_soak.py)")
    p.add_argument("--soak-out", default=None, help="the soak's folder (default results/load-soak/PAIR)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="adapt bench load", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv), p)


def run(args, p: argparse.ArgumentParser) -> int:
    headers = {}
    for item in args.header:
        name, sep, value = item.partition("=")
        if not sep:
            p.error(f"--header: expected NAME=VALUE, got {item!r}")
        headers[name.strip()] = value.strip()
    if args.soak is not None:
        from adapt.bench.load_soak import soak_from_args

        if args.soak < 1:
            p.error("--soak: must be >= 1")
        return soak_from_args(args, headers, args.prompt or list(DEFAULT_PROMPTS))
    result = asyncio.run(run_load(args.url.rstrip("/"), args.concurrency, args.requests, args.max_tokens,
                                  args.temperature, headers, args.prompt or list(DEFAULT_PROMPTS), args.warmup))
    head = "adapt" if sys.argv[1:3] == ["bench", "load"] else "python -m adapt.bench.load"
    result["command"] = " ".join([head, *sys.argv[1:]])
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
