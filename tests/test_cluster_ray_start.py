"""A real two-node Ray cluster, as an operator runs one (docs/deployment.md, "Deploying on a Ray
cluster", runs these same commands): a head node and a second node started with ``ray start``
(separate GCS-connected raylets on this machine, each with its own ports), a real redis-server,
``serve deploy`` of the shipped deploy/serve_config.yaml made CPU-only by deploy/cpu_config.py,
requests with SLA headers through Serve's HTTP proxy; then the second node is stopped
mid-stream: the streams on its Decoder replica end with an error event, the others finish, new
requests are served, and the Controller and the published policy survive.

On one machine two things differ from two machines: every ``ray start`` gets its own ports, and
the proxy runs on the head only (``--proxy-location HeadOnly``: a proxy per node would bind the
same port twice). ``ray stop`` on the second machine stops every Ray process there; here it
would stop the head too (and any other Ray on this machine), so the test stops what ``ray stop``
would stop on that node, the second raylet and every process under it, by process id, and the
teardown kills every process of this cluster the same way (``ray stop --force`` for this cluster
only). Every process of the cluster carries its own ``RAY_TMPDIR`` in its command line or
descends from one that does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.conftest import free_port
from tests.ray_processes import processes_under, with_descendants

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SLA = {"X-SLA-TPOT-Ms": "500", "X-SLA-Quality": "lossless", "X-SLA-Priority": "high"}
pytestmark = pytest.mark.slow


def _kill(procs, sig=signal.SIGKILL) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _ports(*names: str) -> dict[str, int]:
    return {name: free_port() for name in names}


def _node_ports() -> list[str]:
    p = _ports("nm", "om", "agent", "agent_grpc", "runtime_env", "metrics")
    return ["--node-ip-address", "127.0.0.1", "--node-manager-port", str(p["nm"]), "--object-manager-port", str(p["om"]),
            "--dashboard-agent-listen-port", str(p["agent"]), "--dashboard-agent-grpc-port", str(p["agent_grpc"]),
            "--runtime-env-agent-port", str(p["runtime_env"]), "--metrics-export-port", str(p["metrics"]),
            "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats"]


class RayCluster:
    """Two ``ray start`` nodes on this machine: the head (``head`` and one ``decoder_slot``
    resource, the dashboard that ``serve deploy`` talks to) and a second node (one
    ``decoder_slot``); ``env`` is what every command of the cluster runs with."""

    def __init__(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Ray's socket paths live under it
        # token authentication, as Ray's own `ray start --head` sets up: the same token on every node
        self.env = {**os.environ, "RAY_TMPDIR": self.tmpdir, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": uuid.uuid4().hex, "PYTHONUNBUFFERED": "1"}
        ports = _ports("gcs", "dashboard", "client")
        self.address = f"127.0.0.1:{ports['gcs']}"
        self.dashboard = f"http://127.0.0.1:{ports['dashboard']}"
        self.head_cmd = ["ray", "start", "--head", "--port", str(ports["gcs"]), "--num-cpus", "1",
                         "--resources", '{"head": 1, "decoder_slot": 1}', "--include-dashboard", "true",
                         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports["dashboard"]),
                         "--ray-client-server-port", str(ports["client"]), *_node_ports()]
        self.node_cmd = ["ray", "start", "--address", self.address, "--num-cpus", "1",
                         "--resources", '{"decoder_slot": 1}', *_node_ports()]
        self.node_manager_port = self.node_cmd[self.node_cmd.index("--node-manager-port") + 1]

    def run(self, cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
        exe = str(BIN / cmd[0]) if (BIN / cmd[0]).exists() else cmd[0]
        result = subprocess.run([exe, *cmd[1:]], env=self.env, capture_output=True, text=True, timeout=timeout,
                                cwd=ROOT)
        assert result.returncode == 0, f"{' '.join(cmd)}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        return result

    def second_node(self) -> set[psutil.Process]:
        """The second node's raylet and everything under it (its workers, its agents)."""
        raylets = [p for p in psutil.process_iter(["cmdline"])
                   if self.tmpdir in " ".join(p.info["cmdline"] or [])
                   and f"--node_manager_port={self.node_manager_port}" in (p.info["cmdline"] or [])]
        assert len(raylets) == 1, raylets
        return with_descendants(raylets)

    def stop(self) -> None:
        _kill(processes_under(self.tmpdir))
        shutil.rmtree(self.tmpdir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster()
    try:
        c.run(c.head_cmd)
        c.run(c.node_cmd)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def deployed(cluster, redis_server, tmp_path_factory):
    """`serve deploy` of the CPU config derived from the shipped one; the proxy's URL once both
    Decoder replicas heartbeat."""
    redis_server.flush()
    port = free_port()
    config = tmp_path_factory.mktemp("deploy") / "serve_cpu.yaml"
    derived = cluster.run(["python", "deploy/cpu_config.py", "--models", "models/demo", "--redis-url", redis_server.url,
                           "--decoders", "2", "--max-batch", "4", "--max-len", "256", "--decoder-resource",
                           "decoder_slot", "--head-resource", "head", "--proxy-location", "HeadOnly",
                           "--host", "127.0.0.1", "--port", str(port)])
    config.write_text(derived.stdout)
    cluster.run(["adapt", "policy", "push", "models/demo/policy.json", "--redis-url", redis_server.url])
    cluster.run(["serve", "deploy", str(config), "--address", cluster.dashboard])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    health = None
    while time.monotonic() < deadline:
        try:
            health = httpx.get(url + "/health", timeout=5).json()
            if health.get("workers") == 2:
                return url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    status = cluster.run(["serve", "status", "--address", cluster.dashboard]).stdout
    raise AssertionError(f"both Decoder replicas not heartbeating after 300 s: {health}\n{status[-3000:]}")


def _loads(redis_url: str) -> dict:
    from adapt.serving.redis_store import RedisStore

    store = RedisStore(redis_url)
    try:
        return store.loads()
    finally:
        store.close()


def _stream(url: str, key: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    rec = out.setdefault(key, {"chunks": 0, "finish": None, "error": None, "worker": None})
    payload = {"model": "adapt-demo", "prompt": f"import os {key}", "max_tokens": max_tokens, "temperature": 0,
               "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=payload, headers=SLA, timeout=180) as r:
            rec["worker"] = r.headers.get("x-adapt-worker")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["error"], rec["error_at"] = event["error"], time.monotonic()
                    continue
                rec["chunks"] += 1
                if rec["chunks"] >= 2:
                    started.set()
                if event["choices"][0]["finish_reason"]:
                    rec["finish"], rec["done_at"] = event["choices"][0]["finish_reason"], time.monotonic()
    except httpx.HTTPError as exc:  # the test asserts on it: a broken stream is not an error event
        rec["transport_error"] = repr(exc)
    finally:
        started.set()


def test_serve_deploy_on_two_ray_start_nodes_serves_with_sla_headers(cluster, deployed, redis_server):
    loads = _loads(redis_server.url)
    assert len(loads) == 2 and len({rec["node"] for rec in loads.values()}) == 2, loads  # a replica per node
    second = {p.pid for p in cluster.second_node()}
    assert sum(rec["pid"] in second for rec in loads.values()) == 1, (loads, second)
    assert all(rec["policy_version"] >= 1 for rec in loads.values()), loads  # the pushed policy file
    r = httpx.post(deployed + "/v1/completions", headers=SLA, timeout=120,
                   json={"model": "adapt-demo", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    adapt = r.json()["adapt"]
    assert adapt["targets"]["tpot_ms"] == 500.0 and adapt["targets"]["quality"] == "lossless"
    assert r.headers["x-sla-met"] in ("true", "false") and adapt["worker"] in loads


def test_second_node_stopped_mid_stream(cluster, deployed, redis_server):
    url = deployed
    loads = _loads(redis_server.url)
    second = {p.pid for p in cluster.second_node()}
    victim = next(w for w, rec in loads.items() if rec["pid"] in second)
    survivor = next(w for w in loads if w != victim)
    httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=60)
    time.sleep(0.5)  # the router's queue-length answers from both replicas (tests/test_serving.py, _warm_router)
    out: dict = {}
    threads: list[threading.Thread] = []
    while len(threads) < 8 and not ({rec["worker"] for rec in out.values()} >= {victim, survivor}):
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(url, f"s{len(threads)}", 240, out, started), daemon=True)
        t.start()
        threads.append(t)
        assert started.wait(120), out
    on_victim = [k for k, rec in out.items() if rec["worker"] == victim]
    assert on_victim and len(on_victim) < len(out), out  # streams on both replicas
    stopped = time.monotonic()
    _kill(cluster.second_node(), signal.SIGTERM)  # `ray stop` on that node
    for t in threads:
        t.join(timeout=180)
    for key, rec in out.items():
        assert "transport_error" not in rec, (key, rec)
        if rec["worker"] == victim and rec.get("done_at", stopped) >= stopped:  # still running at the stop
            assert rec["error"] is not None and rec["finish"] is None, (key, rec)
            assert rec["error"]["code"] == "worker_died" and rec["error_at"] - stopped < 30, (key, rec)
        else:
            assert rec["error"] is None and rec["finish"] in ("length", "stop"), (key, rec)
    on_victim = [k for k in on_victim if out[k]["error"] is not None]
    assert on_victim, out  # at least one stream was cut by the stop
    # new requests are served (by the survivor), the Controller answers, the policy is still published
    for i in range(3):
        r = httpx.post(url + "/v1/completions", headers=SLA, timeout=120,
                       json={"prompt": f"after {i}", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["adapt"]["worker"] == survivor, r.text
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    cluster.run(["adapt", "policy", "push", "models/demo/policy.json", "--redis-url", redis_server.url])
    deadline = time.monotonic() + 30
    while _loads(redis_server.url).get(survivor, {}).get("policy_version", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _loads(redis_server.url)[survivor]["policy_version"] >= 2  # a push after the stop reaches the survivor
    status = yaml.safe_load(cluster.run(["serve", "status", "--address", cluster.dashboard]).stdout)
    deployments = status["applications"]["adapt"]["deployments"]
    assert deployments["Controller"]["status"] == deployments["Ingress"]["status"] == "HEALTHY", deployments
    errors = [out[k]["error_at"] - stopped for k in on_victim]
    print(f"\nsecond node stopped: {len(errors)} stream(s) ended with an error event after {max(errors):.1f} s "
          f"({out[on_victim[0]]['error']['message']}), {len(out) - len(errors)} finished; Decoder "
          f"{deployments['Decoder']['replica_states']}")
