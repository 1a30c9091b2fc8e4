"""The HTTP front over one decoder worker in this process (no Ray): the same worker class, plugin,
Redis store and FastAPI app as in serving, on uvicorn, driven by the openai client and httpx.

Covers the paths the Ray tests reach less directly: engine-side input errors before any output,
client disconnects freeing the engine slot, and a refit from the Redis trace stream hot-reloaded
by the running worker.
"""

from __future__ import annotations

import functools
import time

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def local(redis_server, tmp_path_factory):
    from adapt.serving.http_app import build_app
    from tests.local_backend import WorkerBackend
    from adapt.serving.launcher import HttpServer
    from adapt.serving.redis_store import RedisStore
    from adapt.serving.worker_plugin import ServingPlugin
    from tests.tiny_models import make_tiny_pair
    from workers.ray_worker import DecoderWorker

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("inproc-models"))
    redis_server.flush()
    store = RedisStore(redis_server.url)
    plugin = functools.partial(ServingPlugin, store=redis_server.url, heartbeat_s=0.2)
    worker = DecoderWorker("w0", {"target": str(target), "drafter": str(drafter), "max_batch": 8, "max_len": 256},
                           plugin, num_threads=1)

    server = HttpServer(build_app(WorkerBackend(worker, store), default_max_tokens=16)).start()
    yield server.url, worker, store
    server.stop()
    worker.shutdown()


def test_completions_and_engine_errors(local):
    url, worker, _ = local
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reported = 0
    for i in range(6):
        resp = client.completions.create(model="adapt-demo", prompt=f"def f{i}(x):", max_tokens=24,
                                         temperature=0.8, seed=i, extra_headers={"X-SLA-TPOT-Ms": "1000"})
        assert resp.usage.completion_tokens >= 1
        # TPOT (time per output token after the first) exists from the second token on; a sampled
        # completion may stop at its first token
        tpot = resp.model_extra["adapt"]["sla"]["tpot_ms"]
        assert (tpot is not None) == (resp.usage.completion_tokens >= 2)
        reported += tpot is not None
    assert reported >= 3
    aborted = worker.plugin.counters.snapshot()["requests"].get("abort", 0)
    r = httpx.post(url + "/v1/completions", json={"prompt": list(range(300)), "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "max_len" in r.json()["error"]["message"]
    assert worker.plugin.counters.snapshot()["requests"].get("abort", 0) == aborted  # nothing to abort


def test_disconnect_frees_the_slot(local):
    url, worker, _ = local
    aborted = worker.plugin.counters.snapshot()["requests"].get("abort", 0)
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"prompt": "x", "max_tokens": 200, "temperature": 0, "stream": True}) as s:
        for n, _ in enumerate(s.iter_lines()):
            if n > 4:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and worker.load()["requests"]:
        time.sleep(0.05)
    assert worker.load()["requests"] == 0
    assert worker.plugin.counters.snapshot()["requests"].get("abort", 0) == aborted + 1


def test_refit_from_the_trace_stream_is_hot_reloaded(local, redis_server, tmp_path):
    from adapt import policy_file
    from tests.conftest import refit_from_redis

    url, worker, store = local
    time.sleep(0.5)  # the trace sink flushes every 0.2 s
    assert store.trace_len() >= 50
    assert refit_from_redis(redis_server.url, tmp_path / "refit.json") == 0
    refit = policy_file.load(tmp_path / "refit.json")
    assert refit.report["source"] == "trace stream" and refit.report["records_used"] >= 50
    version = store.policy_version()
    assert version == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and worker.loop.policy_version != version:
        time.sleep(0.1)
    r = httpx.post(url + "/v1/completions", json={"prompt": "after refit", "max_tokens": 4, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["adapt"]["policy_version"] == version
    assert type(worker.engine.decisions).__name__ == refit.policy.title().replace("-", "") + "Policy"
