"""`adapt bench flood`: a request flood against the Ray Serve application (`adapt.serving.deployment.app_builder`).

Starts a local Ray (``--num-cpus``), Serve's proxy on a free port and the application over a real
Redis (``--redis-url``, else a ``redis-server`` started here on a free port), then sends
``--requests`` requests to ``/v1/completions`` from one asyncio client (arrivals spread over
``--spread-s`` seconds; every second one streams), and prints one JSON line: statuses, 429s,
latency of the accepted ones, the peak RSS of this process and every process it started (Ray's
GCS, raylet, the Serve controller, proxy and replicas), and a request after the flood.

    adapt bench flood --requests 200                  # demo pair, CPU
    adapt bench flood --decoder-max-ongoing 8 --decoder-max-queued 16 --max-batch 8 --rounds 5

``--rounds N`` floods N times in a row against the same application, each round's memory growth
from its own start (a bounded server's later rounds grow ~0). docs/serving.md ("Back-pressure under
Ray Serve") has the numbers this printed; `python -m adapt.bench.flood` runs the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis() -> tuple[subprocess.Popen, str, str]:
    port, data = _free_port(), tempfile.mkdtemp(prefix="flood-redis-")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--dir", data, "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0", data


class RssSampler(threading.Thread):
    """Samples the RSS of this process and all its descendants every `period_s`: the peak of their
    sum, and each process's own growth (labelled by its title, e.g. ``ray::ServeReplica:adapt:Decoder``)."""

    def __init__(self, period_s: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.root, self.period_s = psutil.Process(), period_s
        self.stop_event = threading.Event()
        self.reset()

    def _label(self, p) -> str:
        if p.pid == self.root.pid:
            return "client+driver"
        try:
            cmd = p.cmdline()
        except Exception:  # noqa: BLE001 - gone
            return str(p.pid)
        head = " ".join(cmd[:1]) if cmd else p.name()
        return head.split("/")[-1][:60] if not head.startswith("ray::") else head.split(".")[0]

    def sample(self) -> int:
        import psutil

        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            key = (p.pid, self._label(p))
            self.first.setdefault(key, rss)
            self.peaks[key] = max(self.peaks.get(key, 0), rss)
        return total

    def reset(self) -> None:
        self.first: dict = {}
        self.peaks: dict = {}
        self.peak = self.base = self.sample()

    def growth_mib(self, at_least_mib: float = 5) -> dict[str, int]:
        out: dict[str, int] = {}
        for (pid, label), peak in self.peaks.items():
            grew = (peak - self.first[(pid, label)]) / 2**20
            if grew >= at_least_mib:
                out[f"{label} ({pid})"] = round(grew)
        return out

    def run(self):
        while not self.stop_event.wait(self.period_s):
            self.peak = max(self.peak, self.sample())


async def flood(url: str, n: int, spread_s: float, max_tokens: int, timeout_s: float) -> list[dict]:
    import httpx

    async def one(client, i: int) -> dict:
        await asyncio.sleep(spread_s * i / max(1, n))
        stream = i % 2 == 1
        body = {"prompt": f"def flood_{i}(x):", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        t0 = time.perf_counter()
        try:
            r = await client.post(url + "/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return {"status": type(exc).__name__, "latency_s": time.perf_counter() - t0}
        out = {"status": r.status_code, "latency_s": time.perf_counter() - t0,
               "retry_after": r.headers.get("retry-after"), "stream": stream}
        if r.status_code == 200:
            if stream:
                events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                out["complete"] = events[-1] == "[DONE]" and '"finish_reason":null' not in events[-2] \
                    and not any('"error"' in e for e in events)
            else:
                out["complete"] = r.json()["choices"][0]["finish_reason"] in ("length", "stop")
        else:
            try:
                out["code"] = r.json()["error"]["code"]
            except Exception:  # noqa: BLE001 - not our JSON error (Serve's proxy answered)
                out["code"] = "not-json: " + r.text[:80]
        return out

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def summary(results: list[dict], wall: float, sampler: RssSampler) -> dict:
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    ok = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] == 429]
    lat = sorted(r["latency_s"] for r in ok)
    lat429 = sorted(r["latency_s"] for r in rejected)
    pct = lambda xs, q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None  # noqa: E731
    return {
        "wall_s": round(wall, 2), "statuses": statuses,
        "accepted_complete": sum(bool(r.get("complete")) for r in ok),
        "429_ours": sum(r["retry_after"] is not None and r.get("code") == "queue_full" for r in rejected),
        "429_serve_proxy": sum(str(r.get("code")).startswith("not-json") for r in rejected),
        "429_without_retry_after": sum(r["retry_after"] is None for r in rejected),
        "other_codes": sorted({str(r.get("code")) for r in results if r["status"] not in (200, 429)}),
        "accepted_latency_s": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99)},
        "rejected_latency_s": {"p50": pct(lat429, 0.5), "p99": pct(lat429, 0.99)},
        "rss_mib": {"before": round(sampler.base / 2**20), "peak": round(sampler.peak / 2**20),
                    "growth": round((sampler.peak - sampler.base) / 2**20),
                    "growth_by_process": sampler.growth_mib()},
    }


def add_parser(subparsers) -> None:
    ap = subparsers.add_parser("flood", help="flood a Ray Serve application it starts: 429s, latency, RSS (JSON lines)",
                               description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="adapt bench flood", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--target", default=str(ROOT / "models/demo/target"))
    ap.add_argument("--drafter", default=str(ROOT / "models/demo/drafter"))
    ap.add_argument("--redis-url")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--spread-s", type=float, default=1.0, help="arrivals spread evenly over this many seconds")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8, help="engine max_batch of the Decoder replica")
    ap.add_argument("--decoder-max-ongoing", type=int, default=8)
    ap.add_argument("--decoder-max-queued", type=int, default=16)
    ap.add_argument("--ingress-max-ongoing", type=int, help="default: the deployment's (deploy/serve_config.yaml)")
    ap.add_argument("--ingress-max-queued", type=int, help="default: the deployment's (deploy/serve_config.yaml)")
    ap.add_argument("--ingress-max-requests", type=int, help="the Ingress's own admission limit (app arg)")
    ap.add_argument("--rounds", type=int, default=1, help="floods in a row against the same application")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=300)


def run(args) -> int:

    import httpx
    import ray
    from ray import serve

    from adapt.serving.deployment import app_builder

    redis = None
    if args.redis_url is None:
        redis, args.redis_url, redis_dir = _start_redis()
    sampler = RssSampler()
    port = _free_port()
    try:
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args = {"target": args.target, "drafter": args.drafter, "redis_url": args.redis_url,
                    "num_threads": 1, "engine_options": {"max_batch": args.max_batch, "max_len": 512},
                    "default_max_tokens": args.max_tokens,
                    "decoder_options": {"ray_actor_options": {"num_gpus": 0, "num_cpus": 1},
                                        "max_ongoing_requests": args.decoder_max_ongoing,
                                        "max_queued_requests": args.decoder_max_queued}}
        ingress = {"max_ongoing_requests": args.ingress_max_ongoing, "max_queued_requests": args.ingress_max_queued}
        app_args["ingress_options"] = {k: v for k, v in ingress.items() if v is not None}
        if args.ingress_max_requests:
            app_args["ingress_max_requests"] = args.ingress_max_requests
        serve.run(app_builder(app_args), name="adapt", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        warm = httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=120)
        assert warm.status_code == 200, warm.text
        sampler.start()
        for round_ in range(1, args.rounds + 1):
            sampler.reset()  # each round's growth is from its own start: a bounded server's later rounds grow ~0
            t0 = time.perf_counter()
            results = asyncio.run(flood(url, args.requests, args.spread_s, args.max_tokens, args.timeout_s))
            wall = time.perf_counter() - t0
            after = httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=120)
            options = {k: v for k, v in vars(args).items() if not callable(v)}
            print(json.dumps({"round": round_, **options, **summary(results, wall, sampler),
                              "after_flood_status": after.status_code}), flush=True)
        sampler.stop_event.set()
        return 0
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        if redis is not None:
            redis.terminate()
            redis.wait(10)
            shutil.rmtree(redis_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
