"""Shared test fixtures: a real redis-server started by the test run, and small helpers.

`redis_server` starts `redis-server` (Debian's package, which .ci/run installs; a test that needs it
fails with a message saying so when it is missing) on a free port in a temporary directory, and
stops it after the session. Tests that restart it use
`redis_server.stop()` / `redis_server.start()` (same port, so clients reconnect).
"""

from __future__ import annotations

import os

# Triton decides interpreter mode when a kernel is decorated, so it must be set before anything
# (torch included) imports triton. No test needs compiled Triton on this CPU-only path; the one
# test that compiles for a GPU target does so in a subprocess without this variable.
os.environ.setdefault("TRITON_INTERPRET", "1")
import shutil
import socket
import subprocess
import tempfile
import time

# Engine cost profiles and dtype choices (adapt.profile_cache) go to a folder of this test run, not
# the user's cache: a test never reuses a profile timed outside it, nor leaves one behind. Processes
# the tests start (Ray workers, CLI subprocesses) inherit it.
if "ADAPT_PROFILE_DIR" not in os.environ:
    import atexit

    os.environ["ADAPT_PROFILE_DIR"] = tempfile.mkdtemp(prefix="adapt-test-profiles-")
    atexit.register(shutil.rmtree, os.environ["ADAPT_PROFILE_DIR"], ignore_errors=True)

import pytest


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refit_from_redis(redis_url: str, out) -> int:
    """`adapt policy fit --from-redis URL --out OUT --push`, as the CLI runs it: the exit status."""
    import argparse

    from adapt.serving.policy_commands import run_fit_from_redis

    return run_fit_from_redis(argparse.Namespace(from_redis=redis_url, count=None, push=True, out=str(out)))


def _redis_server_binary() -> str:
    """The redis-server binary; the tests never install it (.ci/run does, from Debian's packages)."""
    path = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if path is None:
        pytest.fail("redis-server not found on PATH (nor /usr/bin/redis-server): the serving tests start their own "
                    "instance. Install it first, e.g. `apt-get install redis-server` (.ci/run does this), then rerun.",
                    pytrace=False)
    return path


class RedisServer:
    """A redis-server process on 127.0.0.1:`port`, with its data in `dir`."""

    def __init__(self) -> None:
        self.binary = _redis_server_binary()
        self.dir = tempfile.mkdtemp(prefix="adapt-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {self.proc.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def flush(self) -> None:
        import redis

        redis.Redis.from_url(self.url).flushall()


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
