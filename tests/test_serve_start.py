"""`adapt serve` starts serving fast on its defaults (a built package or eager steps: docs/serving.md, "Start-up"),
and chat requests are rendered with the target's template and stop at its end-of-turn token."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import free_port
from tests.tiny_models import single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def test_serve_auto_means_a_built_package_or_eager():
    from adapt.cli import build_parser
    from workers.backends import resolve_backend

    args = build_parser().parse_args(["serve"])
    backend = resolve_backend(args.compile, "cpu")  # what each worker's engine makes of the default
    assert args.compile == "auto" and backend.name == "aot"
    assert not backend.builds and not backend.needs_warm_up  # never builds or compiles before serving


def test_adapt_serve_demo_pair_is_healthy_within_60_s(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    t0 = time.monotonic()
    with open(log, "w") as out:  # default --compile: the point is how soon it serves
        proc = subprocess.Popen([sys.executable, "-m", "adapt.cli", "serve", "--pair", "demo", "--port", str(port),
                                 "--threads-per-worker", "1", "--max-batch", "4", "--max-len", "256"],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        healthy = None
        while time.monotonic() - t0 < 90 and healthy is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    healthy = time.monotonic() - t0
            except httpx.HTTPError:
                time.sleep(0.5)
        assert healthy is not None and healthy < 60, f"healthy after {healthy} s:\n{log.read_text()[-3000:]}"
        resp = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "adapt-demo", "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8,
            "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
        # Serve's proxy may answer before `adapt serve` has seen its application running and printed its line
        while "adapt serving adapt-demo" not in log.read_text() and time.monotonic() - t0 < 60:
            time.sleep(0.2)
        assert "adapt serving adapt-demo" in log.read_text(), log.read_text()[-3000:]
        print(f"\nadapt serve --pair demo: healthy after {healthy:.1f} s, start-up line after "
              f"{time.monotonic() - t0:.1f} s")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_worker_chat_uses_the_template_and_stops_at_im_end():
    from workers.pull import pull
    from workers.ray_worker import DecoderWorker

    target = pull("smollm2", progress=False)
    worker = DecoderWorker("w", {"target": str(target), "drafter": None, "dtype": "float32", "max_batch": 2,
                                 "max_len": 256, "compile": "off"}, num_threads=1)

    async def run(request):
        return [chunk async for chunk in worker.generate(request)]

    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = asyncio.run(run({"request_id": "c", "messages": messages, "sampling": {"max_tokens": 24}}))
        ids = [t for c in chunks for t in c["token_ids"]]
        last = chunks[-1]
        assert last["finish_reason"] == "stop" and ids[-1] == 2 and 2 not in ids[:-1]  # <|im_end|>
        text = "".join(c["text"] for c in chunks)
        assert "Paris" in text and "<|im_end|>" not in text and "im_start" not in text
        assert last["usage"]["prompt_tokens"] == len(worker.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True)["input_ids"])
        # the same prompt as plain text has no end of turn to stop at: only EOS stops it
        chunks = asyncio.run(run({"request_id": "p", "prompt": "The capital of France is",
                                  "sampling": {"max_tokens": 6, "ignore_eos": True}}))
        assert sum(len(c["token_ids"]) for c in chunks) == 6
    finally:
        worker.shutdown()
