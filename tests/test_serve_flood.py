"""The Ray Serve application under a request flood (issue #17): every answer is 200 or 429, never
a 5xx nor a hang; every 429 carries ``Retry-After`` and an OpenAI-shaped JSON error naming the
full queue; every accepted request completes. Real Ray, Serve's proxy, the tiny model pair, real
Redis and real HTTP, as tests/test_serving_deploy.py; the application is deployed with small
limits so that 40 requests overflow it:

- `test_a_flood_past_the_decoders_queue_gets_429_never_5xx`: the Decoder deployment runs 2 and
  queues 2 (``max_ongoing_requests`` / ``max_queued_requests``): Serve's ``BackPressureError``
  in the Ingress must become our 429 (it was a plain-text 503 before: Serve's own handler);
- `test_a_flood_past_the_ingress_own_limit_gets_429_never_5xx`: the Ingress replica's Serve limit
  is 4 (``max_ongoing_requests``): its own admission answers 429 at 3 requests held, and the
  proxy neither refuses nor queues for long.

`test_the_config_limits_are_the_code_defaults` needs no Ray: deploy/serve_config.yaml and the
deployments' code-level defaults set the same limits.
"""

from __future__ import annotations

import asyncio
import json
import time

from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

N_REQUESTS = 40
MAX_TOKENS = 12
CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "serve_config.yaml"


def test_the_config_limits_are_the_code_defaults():
    from adapt.serving import deployment as d

    raw = yaml.safe_load(CONFIG.read_text())
    app = raw["applications"][0]
    yaml_limits = {dep["name"]: (dep["max_ongoing_requests"], dep["max_queued_requests"])
                   for dep in app["deployments"] if dep["name"] in ("Decoder", "Ingress")}
    assert yaml_limits == {"Decoder": (d.DECODER_MAX_ONGOING, d.DECODER_MAX_QUEUED),
                           "Ingress": (d.INGRESS_MAX_ONGOING, d.INGRESS_MAX_QUEUED)}
    code_limits = {name: (dep._deployment_config.max_ongoing_requests, dep._deployment_config.max_queued_requests)
                   for name, dep in (("Decoder", d.Decoder), ("Ingress", d.Ingress))}
    assert code_limits == yaml_limits
    assert d.DECODER_MAX_ONGOING == app["args"]["engine_options"]["max_batch"]  # a replica runs one batch
    # the Ingress admits fewer generation requests than Serve lets in, and more than the decoders
    # hold for it (one Decoder's running requests plus the queue of its router)
    assert d.DECODER_MAX_ONGOING + d.DECODER_MAX_QUEUED < d.ingress_admission_limit(d.INGRESS_MAX_ONGOING) \
        < d.INGRESS_MAX_ONGOING
    assert [d.ingress_admission_limit(n) for n in (1, 2, 4, 10, 1000)] == [1, 1, 3, 9, 900]
    with pytest.raises(ValueError, match="ingress_max_requests"):
        d.app_builder({"target": "/t", "redis_url": "redis://x", "ingress_max_requests": 0})


@pytest.fixture(scope="module")
def serve_cluster(redis_server, tmp_path_factory):
    """A local Ray (never an existing cluster) with Serve's proxy on a free port; yields
    ``(url, deploy)``, where ``deploy(**args)`` (re)deploys the application with extra args."""
    import ray

    from adapt.serving.deployment import app_builder
    from tests.conftest import free_port
    from tests.tiny_models import make_tiny_pair

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("flood-models"))
    redis_server.flush()
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        def deploy(decoder_options: dict, **extra):
            args = {"target": str(target), "drafter": str(drafter), "redis_url": redis_server.url,
                    "num_threads": 1, "engine_options": {"max_batch": 4, "max_len": 256},
                    "default_max_tokens": MAX_TOKENS,
                    "decoder_options": {"ray_actor_options": {"num_gpus": 0, "num_cpus": 0.5}, **decoder_options},
                    **extra}
            args.setdefault("ingress_options", {}).setdefault("ray_actor_options", {"num_cpus": 0})
            serve.run(app_builder(args), name="adapt", route_prefix="/")

        yield f"http://127.0.0.1:{port}", deploy
    finally:
        serve.shutdown()
        ray.shutdown()


async def _one(client: httpx.AsyncClient, url: str, i: int) -> dict:
    stream = i % 2 == 1
    body = {"prompt": f"def flood_{i}(x):", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/completions", json=body)
    return {"i": i, "stream": stream, "response": r, "latency_s": time.perf_counter() - t0}


def _flood(url: str, n: int = N_REQUESTS) -> list[dict]:
    async def run():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:  # a hang fails with ReadTimeout
            return await asyncio.gather(*(_one(client, url, i) for i in range(n)))

    return asyncio.run(run())


def _check(results: list[dict]) -> tuple[list[dict], list[dict]]:
    """Every answer 200 or 429; every 429 ours (JSON, Retry-After); every 200 complete with tokens."""
    statuses = sorted(r["response"].status_code for r in results)
    assert set(statuses) <= {200, 429}, statuses
    accepted = [r for r in results if r["response"].status_code == 200]
    rejected = [r for r in results if r["response"].status_code == 429]
    assert accepted and rejected, statuses
    for r in rejected:
        resp = r["response"]
        assert resp.headers.get("retry-after") == "1", resp.headers
        assert resp.headers["content-type"].startswith("application/json"), resp.text
        err = resp.json()["error"]
        assert err["code"] == "queue_full" and err["type"] == "rate_limit_error", err
        assert "retry after 1 s" in err["message"], err
    for r in accepted:
        resp = r["response"]
        if r["stream"]:
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
            chunks = [json.loads(e) for e in events[:-1]]
            finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] in ("length", "stop"), chunks
            usage = [c["usage"] for c in chunks if c.get("usage")]
            assert usage and 1 <= usage[-1]["completion_tokens"] <= MAX_TOKENS, chunks
        else:
            body = resp.json()
            assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
            assert 1 <= body["usage"]["completion_tokens"] <= MAX_TOKENS, body
    return accepted, rejected


def _after_the_flood(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "def after(x):", "max_tokens": 4, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    health = httpx.get(url + "/health", timeout=30)
    assert health.status_code == 200 and health.json()["workers"] >= 1, health.text


def _report(name: str, results: list[dict], wall: float) -> None:
    accepted = sorted(r["latency_s"] for r in results if r["response"].status_code == 200)
    print(f"\n{name}: {len(results)} requests in {wall:.2f} s, {len(results) - len(accepted)} x 429, "
          f"{len(accepted)} x 200 (slowest {accepted[-1]:.2f} s)")


def test_a_flood_past_the_decoders_queue_gets_429_never_5xx(serve_cluster):
    url, deploy = serve_cluster
    deploy({"max_ongoing_requests": 2, "max_queued_requests": 2})
    t0 = time.perf_counter()
    results = _flood(url)
    _report("decoder queue", results, time.perf_counter() - t0)
    _, rejected = _check(results)
    assert any("decoders' queue is full" in r["response"].json()["error"]["message"] for r in rejected)
    _after_the_flood(url)


def test_a_flood_past_the_ingress_own_limit_gets_429_never_5xx(serve_cluster):
    url, deploy = serve_cluster
    # the Ingress's own admission (3 of its 4 Serve slots) binds before the decoders' 8 + 32
    deploy({"max_ongoing_requests": 8, "max_queued_requests": 32},
           ingress_options={"max_ongoing_requests": 4, "ray_actor_options": {"num_cpus": 0}})
    t0 = time.perf_counter()
    results = _flood(url)
    _report("ingress limit", results, time.perf_counter() - t0)
    _, rejected = _check(results)
    assert all("requests held" in r["response"].json()["error"]["message"] for r in rejected)
    health = httpx.get(url + "/health", timeout=30).json()
    assert health["ingress"]["capacity"] == 3 and health["ingress"]["peak"] <= 3, health
    _after_the_flood(url)
