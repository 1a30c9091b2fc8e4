"""The state store interface, in process and on a real redis-server: same behaviour from both."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from adapt.serving.store import InProcessStore, open_store


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        s = InProcessStore(trace_maxlen=50)
    else:
        server = request.getfixturevalue("redis_server")
        s = open_store(server.url, prefix=f"t{uuid.uuid4().hex[:8]}", trace_maxlen=50)
    yield s
    s.close()


def test_load_expires_after_ttl(store):
    store.put_load("w1", {"queue": 3, "running": 2}, ttl_s=0.3)
    store.put_load("w2", {"queue": 0, "running": 1}, ttl_s=5.0)
    assert store.loads() == {"w1": {"queue": 3, "running": 2}, "w2": {"queue": 0, "running": 1}}
    time.sleep(0.45)
    assert set(store.loads()) == {"w2"}
    store.put_load("w2", {"queue": 4, "running": 1}, ttl_s=5.0)  # refresh overwrites
    assert store.loads()["w2"]["queue"] == 4
    store.remove_worker("w2")
    assert store.loads() == {}


def test_policy_versions_and_notification(store):
    assert store.policy_version() == 0 and store.get_policy() is None
    seen: list[int] = []
    got = threading.Event()

    def on_version(v: int) -> None:
        seen.append(v)
        if v >= 2:
            got.set()

    sub = store.subscribe_policy(on_version)
    time.sleep(0.2)  # let the subscriber connect
    v1 = store.put_policy({"name": "a", "settings": {"x": 1}})
    v2 = store.put_policy({"name": "b", "settings": {"x": 2}})
    assert (v1, v2) == (1, 2)
    assert store.policy_version() == 2
    assert store.get_policy() == (2, {"name": "b", "settings": {"x": 2}})
    assert store.get_policy(1) == (1, {"name": "a", "settings": {"x": 1}})
    assert got.wait(5.0), f"no notification for version 2, saw {seen}"
    sub.close()
    with pytest.raises(TypeError, match="policy"):
        store.put_policy(["not", "a", "dict"])  # type: ignore[arg-type]


def _flaky_subscriber(fail_first: int):
    """A callback that raises on its first `fail_first` calls (as the worker's does when its read of
    the version times out), then records versions; returns (callback, seen, got_version_1)."""
    calls = {"n": 0}
    seen: list[int] = []
    got = threading.Event()

    def on_version(v: int) -> None:
        if v < 1:
            return
        calls["n"] += 1
        if calls["n"] <= fail_first:
            raise ConnectionError("store read timed out")
        seen.append(v)
        got.set()

    return on_version, seen, got


def test_a_version_whose_callback_raised_is_delivered_again(store):
    on_version, seen, got = _flaky_subscriber(fail_first=2)
    sub = store.subscribe_policy(on_version)
    time.sleep(0.2)  # let the subscriber connect
    store.put_policy({"name": "a", "settings": {}})
    assert got.wait(10.0), "a version whose callback raised was never delivered again"
    assert seen[0] == 1
    sub.close()


def test_the_controller_store_polls_a_failed_version_again():
    """`ControllerStoreClient` polls the Controller deployment; here its Serve handle is replaced by
    an object that answers its calls from a real in-process store, the same way `store_call` does."""
    from adapt.serving.controller_actor import ControllerStoreClient

    backing = InProcessStore()

    class Handle:
        class store_call:  # noqa: N801 - the deployment method's name
            @staticmethod
            def remote(method, *args):
                class Response:
                    @staticmethod
                    def result(timeout_s=None):
                        return getattr(backing, method)(*args)
                return Response

    client = ControllerStoreClient(Handle, poll_s=0.05)
    on_version, seen, got = _flaky_subscriber(fail_first=2)
    sub = client.subscribe_policy(on_version)
    backing.put_policy({"name": "a", "settings": {}})
    assert got.wait(5.0), "the poll never delivered the version again after its callback raised"
    assert seen == [1]
    sub.close()


def test_trace_stream_is_capped_and_ordered(store):
    store.add_traces([{"v": 1, "request_id": "r", "step": i} for i in range(120)])
    assert store.trace_len() == 50
    records = store.read_traces()
    assert [r["step"] for r in records] == list(range(70, 120))
    assert [r["step"] for r in store.read_traces(3)] == [117, 118, 119]
    assert store.read_traces(0) == []


def test_open_store_rejects_bad_urls():
    with pytest.raises(ValueError, match="redis_url"):
        open_store("http://localhost:6379")
    assert isinstance(open_store(None), InProcessStore)


def test_redis_store_survives_a_restart(redis_server):
    from adapt.serving.redis_store import StoreUnavailable

    store = open_store(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
    seen: list[int] = []
    sub = store.subscribe_policy(seen.append)
    time.sleep(0.2)
    store.put_policy({"n": 1})
    redis_server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            store.put_load("w", {"queue": 0}, ttl_s=1.0)
        assert store.ping() is False
    finally:
        redis_server.start()
    # a fresh server (no persistence) starts empty; the client reconnects by itself
    store.put_load("w", {"queue": 1}, ttl_s=5.0)
    assert store.loads() == {"w": {"queue": 1}}
    v = store.put_policy({"n": 2})
    deadline = time.monotonic() + 5.0
    while v not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert v in seen, f"subscriber did not resubscribe after the restart, saw {seen}"
    sub.close()
    store.close()


def test_a_missing_redis_server_fails_with_a_clear_message(monkeypatch):
    """The tests never install redis-server (.ci/run does): without it they fail saying so."""
    import os
    import shutil

    from tests import conftest

    monkeypatch.setattr(shutil, "which", lambda name: None)
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if str(p).endswith("redis-server") else real_exists(p))
    with pytest.raises(pytest.fail.Exception, match=r"redis-server not found.*\.ci/run does this"):
        conftest._redis_server_binary()
