"""`adapt bench load --soak N` against a real HTTP server (the serving front over one decoder worker
in this process, tiny pair, no Ray): N floods, each worker's RSS after each from ``/metrics``
(its heartbeat), and the soak's files; and the bound on the CPU math libraries' caches that keeps
that RSS flat (workers/native_caches.py)."""

from __future__ import annotations

import functools
import json
import os

import pytest


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    from adapt.serving.http_app import build_app
    from tests.local_backend import WorkerBackend
    from adapt.serving.launcher import HttpServer
    from adapt.serving.worker_plugin import ServingPlugin
    from tests.tiny_models import make_tiny_pair
    from workers.ray_worker import DecoderWorker

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("soak-models"))
    plugin = functools.partial(ServingPlugin, store=None, heartbeat_s=0.2)  # a private in-process store
    worker = DecoderWorker("w0", {"target": str(target), "drafter": str(drafter), "max_batch": 4, "max_len": 256},
                           plugin, num_threads=1)

    server = HttpServer(build_app(WorkerBackend(worker), model_name="adapt-tiny", default_max_tokens=16)).start()
    yield server.url
    server.stop()
    worker.shutdown()


def test_soak_records_each_workers_rss_after_each_flood(server_url, tmp_path):
    from adapt.bench.load import main

    out = tmp_path / "soak"
    assert main(["--url", server_url, "--concurrency", "4", "--requests", "8", "--max-tokens", "8",
                 "--soak", "3", "--soak-out", str(out)]) == 0
    result = json.loads((out / "soak.json").read_text())
    assert [row["flood"] for row in result["floods"]] == [1, 2, 3]
    assert all(row["completed"] == 8 and row["errors"] == 0 for row in result["floods"])
    rss = [row["rss_mib"]["w0"] for row in result["floods"]]
    own = 0  # this test process is the worker's: its RSS as /proc reports it, within what the floods added
    with open("/proc/self/statm") as f:
        own = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert all(100 < r < own + 200 for r in rss), (rss, own)
    assert result["growth_from_second_mib"] == {"w0": round(rss[2] - rss[1], 1)}
    assert result["machine"]["cores"] >= 1 and result["commit"] and result["command"].endswith(f"--soak-out {out}")
    assert (out / "soak.png").stat().st_size > 1000
    readme = (out / "README.md").read_text()
    assert "--soak 3" in readme and "| 3 |" in readme and "w0" in readme


def test_metrics_parse_each_workers_rss():
    from adapt.bench.load_soak import worker_rss_mib
    from adapt.serving.metrics import render_metrics

    text = render_metrics({"a": {"rss_bytes": 3 * 2**20, "counters": {}}, "b": {"counters": {}}})
    assert worker_rss_mib(text) == {"a": 3.0}  # a worker without the field has no sample


def test_native_caches_are_bounded_unless_the_environment_says_otherwise(server_url):
    from workers.native_caches import NATIVE_CACHE_ENV, bound_native_caches

    env: dict[str, str] = {"LRU_CACHE_CAPACITY": "512"}
    assert bound_native_caches(env) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "512"}
    assert set(NATIVE_CACHE_ENV) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"}
    # a DecoderWorker sets them before its first matmul (server_url made one in this process)
    assert all(os.environ.get(k) for k in NATIVE_CACHE_ENV)
