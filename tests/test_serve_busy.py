"""`adapt serve` starts on a machine whose cores another process keeps busy, and a start that
cannot succeed ends in one line (the cause and the fix) with no Ray process left behind
(adapt/serving/startup.py; docs/serving.md, "Start-up on a busy machine").

Each `adapt serve` here runs with its own ``RAY_TMPDIR``: every Ray process it starts (GCS,
raylet, workers) carries that directory in its command line, which is how the tests find the
ones it left behind without touching another Ray on this machine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.conftest import free_port
from tests.ray_processes import processes_under

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_tmpdir():
    """A short RAY_TMPDIR of the test's own (Ray's socket paths live under it), removed after."""
    path = tempfile.mkdtemp(prefix="adapt-ray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ray_processes(tmpdir: str) -> list[str]:
    """Command lines of the processes that run under the Ray temp directory `tmpdir`, and of
    their children (Ray's workers name themselves ``ray::...``)."""
    out = []
    for proc in processes_under(tmpdir):
        try:
            out.append(" ".join(proc.cmdline())[:200])
        except psutil.NoSuchProcess:
            pass
    return out


def _no_ray_left(tmpdir: str, wait_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + wait_s
    while (left := _ray_processes(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _serve(port: int, tmpdir: str, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_TMPDIR": tmpdir}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "adapt.cli", "serve", "--pair", "demo", "--compile", "off",
                                 "--port", str(port), "--threads-per-worker", "1", "--max-batch", "4",
                                 "--max-len", "256", *extra],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("adapt serve: error:")]


def test_serve_timeouts_in_code_equal_the_shipped_config_and_env_overrides_them():
    from adapt.serving import deployment
    from adapt.serving.startup import SERVE_CONTROLLER_ENV, serve_controller_env

    raw = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    assert raw["controller_options"]["runtime_env"]["env_vars"] == SERVE_CONTROLLER_ENV
    assert float(SERVE_CONTROLLER_ENV["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) >= 60  # Serve's 5 s failed here
    for dep in raw["applications"][0]["deployments"]:
        assert (dep["health_check_period_s"], dep["health_check_timeout_s"]) == (
            deployment.HEALTH_CHECK_PERIOD_S, deployment.HEALTH_CHECK_TIMEOUT_S), dep["name"]
    for dep in (deployment.Decoder, deployment.Ingress, deployment.ControllerDeployment):
        cfg = dep._deployment_config  # Serve keeps a deployment's options there (no public accessor)
        assert (cfg.health_check_period_s, cfg.health_check_timeout_s) == (10, 60), dep.name
    env = serve_controller_env({"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120"})
    assert env == {**SERVE_CONTROLLER_ENV, "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120"}


@pytest.mark.slow
def test_adapt_serve_starts_while_another_process_keeps_both_cores_busy(tmp_path, ray_tmpdir):
    """Both cores burnt by other processes the whole time: healthy within 180 s, one completion."""
    burn = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 2))]
    tmpdir = ray_tmpdir
    port, log = free_port(), tmp_path / "serve.log"
    t0 = time.monotonic()
    proc = _serve(port, tmpdir, log)
    url = f"http://127.0.0.1:{port}"
    try:
        healthy = None
        while healthy is None and time.monotonic() - t0 < 180:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    healthy = time.monotonic() - t0
            except httpx.HTTPError:
                time.sleep(1)
        assert healthy is not None, f"not healthy after 180 s:\n{log.read_text()[-3000:]}"
        resp = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "adapt-demo", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
        # Serve's proxy may answer before `adapt serve` has seen its application running
        while "adapt serving adapt-demo" not in log.read_text() and time.monotonic() - t0 < 180:
            time.sleep(0.5)
        text = log.read_text()
        assert "adapt serving adapt-demo" in text, text[-3000:]
        # a line per stage, and Serve's proxy never killed for missing its readiness check
        for stage in ("starting Ray", "Ray is up", "starting Serve", "Serve is up; deploying application", "replicas:"):
            assert f"adapt serve: {stage}" in text, text[-3000:]
        assert "didn't complete in" not in text and not _error_lines(text), text[-3000:]
        print(f"\nadapt serve --pair demo with {len(burn)} CPU burners: healthy after {healthy:.1f} s")
    finally:
        for b in burn:
            b.kill()
            b.wait()
        _stop(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert not _no_ray_left(tmpdir)


def test_a_start_that_cannot_succeed_says_why_in_one_line_and_stops_ray(tmp_path, ray_tmpdir):
    """A Decoder replica no node can hold (64 CPUs on this machine): Ray starts, the start is
    refused with one line naming the cause and the fix, and Ray's processes are gone."""
    tmpdir = ray_tmpdir
    log = tmp_path / "serve.log"
    proc = _serve(free_port(), tmpdir, log, "--worker-cpus", "64")
    try:
        proc.wait(timeout=240)
    finally:
        _stop(proc)
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    assert "adapt serve: Ray is up" in text, text[-3000:]  # Ray did start: there was something to stop
    [line] = _error_lines(text)
    assert "no Ray node can hold a Decoder replica" in line and "CPU=64" in line and "fix: lower --worker-cpus" in line
    assert "Traceback" not in text, text[-3000:]
    assert not _no_ray_left(tmpdir)


def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path, ray_tmpdir):
    tmpdir = ray_tmpdir
    log = tmp_path / "serve.log"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        proc = _serve(port, tmpdir, log)
        try:
            proc.wait(timeout=120)
        finally:
            _stop(proc)
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    [line] = _error_lines(text)
    assert f"port {port} on 127.0.0.1 is in use" in line and "fix: pass another --port" in line
    assert "starting Ray" not in text and not _ray_processes(tmpdir)


def test_a_stop_during_start_up_stops_ray_too(tmp_path, ray_tmpdir):
    """SIGTERM while the replicas load (as a supervisor stops a start that takes too long): exit
    status 130, one line, no Ray process left."""
    log = tmp_path / "serve.log"
    proc = _serve(free_port(), ray_tmpdir, log)
    try:
        deadline = time.monotonic() + 120
        while "adapt serve: Serve is up" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert _ray_processes(ray_tmpdir), log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        _stop(proc)
    text = log.read_text()
    assert proc.returncode == 130, text[-3000:]
    assert "adapt serve: stopped during start-up" in text and "Traceback" not in text, text[-3000:]
    assert not _no_ray_left(ray_tmpdir)
