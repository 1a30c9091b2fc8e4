"""`adapt bench load` against a real HTTP server: the serving front over one decoder worker in this
process (the same worker, plugin and FastAPI app as in serving, on uvicorn; tiny pair, no Ray)."""

from __future__ import annotations

import functools
import json

import pytest


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    from adapt.serving.http_app import build_app
    from tests.local_backend import WorkerBackend
    from adapt.serving.launcher import HttpServer
    from adapt.serving.worker_plugin import ServingPlugin
    from tests.tiny_models import make_tiny_pair
    from workers.ray_worker import DecoderWorker

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("load-models"))
    plugin = functools.partial(ServingPlugin, store=None, heartbeat_s=0.2)  # a private in-process store
    worker = DecoderWorker("w0", {"target": str(target), "drafter": str(drafter), "max_batch": 4, "max_len": 256},
                           plugin, num_threads=1)

    server = HttpServer(build_app(WorkerBackend(worker), default_max_tokens=16)).start()
    yield server.url
    server.stop()
    worker.shutdown()


def test_load_measures_every_request_from_the_client_side(server_url, tmp_path):
    from adapt.bench.load import main

    out = tmp_path / "load.json"
    assert main(["--url", server_url, "--concurrency", "2", "--requests", "6", "--max-tokens", "8",
                 "--warmup", "1", "--header", "X-SLA-TPOT-Ms=10000", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["errors"] == 0
    assert result["output_tokens_per_s"] > 0 and result["requests_per_s"] > 0
    assert result["ttft_ms"]["p50"] > 0 and result["ttft_ms"]["p99"] >= result["ttft_ms"]["p50"]
    assert result["sla_attainment"] is not None and result["mean_tau"] >= 1.0
    assert result["headers"] == {"X-SLA-TPOT-Ms": "10000"} and sum(result["requests_per_worker"].values()) == 6


def test_a_header_without_a_value_is_refused_by_name(capsys):
    from adapt.bench.load import main

    with pytest.raises(SystemExit) as exc:
        main(["--header", "X-SLA-TPOT-Ms"])
    assert exc.value.code == 2 and "--header" in capsys.readouterr().err


def test_every_benchmark_is_an_adapt_bench_subcommand():
    from adapt.cli import build_parser

    parser = build_parser()
    for argv in (["bench", "ab", "--policy-file", "p.json", "--out", "o.json"], ["bench", "forward", "widths"],
                 ["bench", "forward", "variants", "--linears"], ["bench", "load"], ["bench", "flood", "--rounds", "2"]):
        args = parser.parse_args(argv)
        assert callable(args.run), argv
