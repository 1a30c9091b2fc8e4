"""`adapt serve` on its embedded defaults (own local Ray, in-process store in the controller) and
`adapt policy push` through the controller actor, as subprocesses a user would run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from tests.conftest import free_port  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.tiny_models import make_tiny_pair

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("cli-models"))
    port = free_port()
    log = tmp_path_factory.mktemp("cli-log") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "adapt.cli", "serve", "--target", str(target), "--drafter", str(drafter),
             "--port", str(port), "--num-workers", "1", "--max-batch", "4", "--max-len", "256",
             "--threads-per-worker", "1", "--default-max-tokens", "8",
             "--compile", "off"],  # compiled steps take minutes to warm up; tests/test_compiled.py covers them
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"adapt serve exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise AssertionError(f"adapt serve did not come up:\n{log.read_text()[-3000:]}")
    yield url, log
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_adapt_serve_prints_url_and_serves(server):
    url, log = server
    assert f"{url}/v1" in log.read_text()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    resp = client.completions.create(model="adapt-demo", prompt="def add(a, b):", temperature=0,
                                     extra_headers={"X-SLA-TPOT-Ms": "1000", "X-SLA-Quality": "tvd=0.05"})
    assert resp.usage.completion_tokens <= 8  # the --default-max-tokens
    assert resp.model_extra["adapt"]["targets"]["quality"] == "tvd=0.05"
    assert resp.model_extra["adapt"]["policy_version"] == 0


def test_policy_push_through_the_controller(server, tmp_path):
    from adapt import policy_file

    url, _ = server
    path = tmp_path / "policy.json"
    policy_file.save(policy_file.PolicyFile(), path)
    bad = tmp_path / "bad.json"
    bad.write_text(path.read_text().replace('"schema": "adapt-policy"', '"schema": "other"'))
    env = {**os.environ}
    run = lambda *a: subprocess.run([sys.executable, "-m", "adapt.cli", "policy", *a],  # noqa: E731
                                    capture_output=True, text=True, env=env, timeout=120)
    rejected = run("push", str(bad))
    assert rejected.returncode == 2 and "policy.schema" in rejected.stderr
    pushed = run("push", str(path))
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(pushed.stdout.strip().splitlines()[-1])["store_version"] == 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        body = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0},
                          timeout=60).json()
        if body["adapt"]["policy_version"] == 1:
            break
        time.sleep(0.5)
    assert body["adapt"]["policy_version"] == 1
