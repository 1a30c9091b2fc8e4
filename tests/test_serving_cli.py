"""`adapt serve` on its embedded defaults (own local Ray, the Serve application with the in-process
store in its Controller) and `adapt policy push` through that Controller, as subprocesses a user
would run. The server
requires API keys (one from --api-key, one from ADAPT_API_KEY) and has a small request queue
(--max-queue 2 beyond --max-batch 4), so a flood of clients meets 429s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import free_port

CLI_KEY, ENV_KEY = "sk-cli-0c7d1e", "sk-env-5b2a90"
AUTH = {"Authorization": f"Bearer {CLI_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.tiny_models import make_tiny_pair

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("cli-models"))
    port = free_port()
    log = tmp_path_factory.mktemp("cli-log") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ADAPT_API_KEY": ENV_KEY}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "adapt.cli", "serve", "--pair", "demo",  # model id adapt-demo, as the tests ask
             "--target", str(target), "--drafter", str(drafter),
             "--port", str(port), "--num-workers", "1", "--max-batch", "4", "--max-len", "256",
             "--threads-per-worker", "1", "--default-max-tokens", "8", "--api-key", CLI_KEY, "--max-queue", "2",
             "--compile", "off"],  # compiled steps take minutes to warm up; tests/test_compiled.py covers them
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"adapt serve exited:\n{log.read_text()[-3000:]}")
        try:  # Serve's proxy may answer a moment before `adapt serve` has printed its line
            if httpx.get(url + "/health", timeout=2).status_code == 200 and "adapt serving" in log.read_text():
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise AssertionError(f"adapt serve did not come up:\n{log.read_text()[-3000:]}")
    yield url, log, proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_adapt_serve_prints_url_and_serves(server):
    url, log, _ = server
    assert f"{url}/v1" in log.read_text()
    client = openai.OpenAI(base_url=url + "/v1", api_key=CLI_KEY, max_retries=0, timeout=60)
    resp = client.completions.create(model="adapt-demo", prompt="def add(a, b):", temperature=0,
                                     extra_headers={"X-SLA-TPOT-Ms": "1000", "X-SLA-Quality": "tvd=0.05"})
    assert resp.usage.completion_tokens <= 8  # the --default-max-tokens
    assert resp.model_extra["adapt"]["targets"]["quality"] == "tvd=0.05"
    assert resp.model_extra["adapt"]["policy_version"] == 0


def test_policy_push_through_the_controller(server, tmp_path):
    from adapt import policy_file

    url, _, _ = server
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
                          headers=AUTH, timeout=60).json()
        if body["adapt"]["policy_version"] == 1:
            break
        time.sleep(0.5)
    assert body["adapt"]["policy_version"] == 1


def test_adapt_serve_requires_a_key_and_never_logs_it(server):
    url, log, _ = server
    body = {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-cli-0c7d1f"}, timeout=60)
    assert r.status_code == 401
    for key in (CLI_KEY, ENV_KEY):  # --api-key and ADAPT_API_KEY
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # open
    text = log.read_text()
    assert "2 API key(s) required" in text and CLI_KEY not in text and ENV_KEY not in text


def test_a_flood_on_ray_gets_429s_and_the_accepted_requests_complete(server):
    """64 clients at once against 4 running + 2 queued: 429 with Retry-After, no 5xx, all
    accepted requests finish; the process tree's memory is sampled throughout."""
    import asyncio

    import psutil

    url, _, proc = server
    tree = psutil.Process(proc.pid)

    def rss() -> int:
        total = 0
        for p in [tree, *tree.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    rss0 = rss()
    peak = [rss0]

    async def one(client: httpx.AsyncClient, i: int):
        t0 = time.perf_counter()
        r = await client.post(url + "/v1/completions", headers=AUTH,
                              json={"prompt": f"def flood_{i}(x):", "max_tokens": 32, "temperature": 0})
        peak[0] = max(peak[0], rss())
        return r, time.perf_counter() - t0

    async def flood():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(flood())
    statuses = [r.status_code for r, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    accepted = sorted(dt for r, dt in results if r.status_code == 200)
    rejected = [r for r, _ in results if r.status_code == 429]
    assert rejected and len(accepted) >= 6
    assert all(r.headers["retry-after"] == "1" for r in rejected)
    assert all(r.json()["choices"][0]["finish_reason"] in ("length", "stop") for r, _ in results if r.status_code == 200)
    p99 = accepted[min(len(accepted) - 1, int(0.99 * len(accepted)))]
    print(f"\nflood on Ray: 64 requests, {len(rejected)} answered 429, {len(accepted)} accepted, p99 latency of "
          f"accepted {p99 * 1e3:.0f} ms, process tree RSS {rss0 / 2**20:.0f} -> peak {peak[0] / 2**20:.0f} MiB")
    health = httpx.get(url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["ingress"]["capacity"] == 6
    assert httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, headers=AUTH,
                      timeout=60).status_code == 200


def test_killing_the_controller_leaves_the_workers_on_their_policy(server):
    """Runs last. Without --redis-url the Controller replica hosts the state store: SIGKILL it and the
    store's contents (load records, traces, policy history) are gone (Serve starts a new, empty
    one), but the workers keep decoding under the policy they run and Serve keeps routing."""
    import psutil

    url, _, proc = server
    ask = lambda: httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0},  # noqa: E731
                             headers=AUTH, timeout=60)
    version = ask().json()["adapt"]["policy_version"]
    assert version >= 1  # pushed by test_policy_push_through_the_controller
    controllers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if any(part.startswith("ray::ServeReplica:adapt:Controller") for part in p.cmdline())]
    assert len(controllers) == 1, [p.cmdline() for p in psutil.Process(proc.pid).children(recursive=True)]
    controllers[0].kill()
    controllers[0].wait(10)
    for _ in range(3):
        r = ask()
        assert r.status_code == 200 and r.json()["adapt"]["policy_version"] == version, r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # the last view of the workers
