"""Serving end to end: real Ray (a two-node local cluster), real Serve, real Redis, real HTTP, tiny
real models.

One application is shared by the module (Ray and Serve start-ups are slow), started by
`start_stack` as ``adapt serve`` starts it: two Decoder replicas, one per node (each node offers
one ``decoder_slot``), heartbeating into a redis-server the test run started, behind Serve's
router and proxy and the Ingress's FastAPI app. The worker-kill test runs last.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import ray


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from tests.tiny_models import make_tiny_pair

    return make_tiny_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"decoder_slot": 1},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, resources={"decoder_slot": 1})
    ray.init(address=c.address, namespace="adapt", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def stack(cluster, redis_server, tiny_pair):
    from adapt.serving.launcher import start_stack

    redis_server.flush()
    target, drafter = tiny_pair
    s = start_stack(str(target), str(drafter), num_workers=2, redis_url=redis_server.url,
                    engine_options={"max_batch": 8, "max_len": 512}, worker_resources={"decoder_slot": 1},
                    num_threads=1, heartbeat_s=0.2, ttl_s=1.5, default_max_tokens=16)
    _wait(lambda: len(s.store.loads()) == 2, 30, "both workers heartbeating")
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _wait(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception:  # noqa: BLE001 - e.g. store restarting
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


SLA = {"X-SLA-TPOT-Ms": "500", "X-SLA-Quality": "lossless", "X-SLA-Priority": "high"}


def test_models_health_and_completion_with_sla_headers(stack, client):
    server = stack
    assert [m.id for m in client.models.list().data] == ["adapt-demo"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["workers"] == 2

    raw = client.completions.with_raw_response.create(model="adapt-demo", prompt="def add(a, b):", max_tokens=12,
                                                      temperature=0, extra_headers=SLA)
    resp = raw.parse()
    assert float(raw.headers["x-adapt-tau"]) >= 1.0
    assert isinstance(resp.choices[0].text, str)
    assert 1 <= resp.usage.completion_tokens <= 12
    adapt = resp.model_extra["adapt"]
    assert adapt["targets"] == {"tpot_ms": 500.0, "ttft_ms": None, "quality": "lossless", "priority": 10,
                                "tvd_budget_total": None}
    stats = adapt["stats"]
    assert stats["tau"] >= 1.0 and stats["tvd_spent"] == 0.0 and isinstance(stats["accept_per_position"], list)
    for key in ("steps_used", "draft_len_used", "rules_used"):
        assert key in stats
    sla = adapt["sla"]
    assert sla["quality_met"] is True and sla["met"] is (sla["tpot_ms"] is None or sla["tpot_ms"] <= 500.0)
    assert raw.headers["x-sla-met"] == ("true" if sla["met"] else "false")  # the header says what the body says

    # the same targets as body fields
    resp2 = client.completions.create(model="adapt-demo", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                      extra_body={"sla": {"tpot_ms": 500, "quality": "lossless", "priority": "high"}})
    assert resp2.model_extra["adapt"]["targets"] == adapt["targets"]
    assert resp2.choices[0].text == resp.choices[0].text  # greedy: same tokens on either worker


def test_workers_load_the_dtype_measured_for_this_machine(stack, tiny_pair):
    """`dtype: auto` (the engine options' default) on a CPU: each replica loads the dtype measured
    fastest here (adapt/dtype_choice.py), measured once for both replicas and kept; /health says
    which and why."""
    import torch

    from adapt.dtype_choice import resolve_engine_dtype

    health = httpx.get(stack.url + "/health").json()
    assert len(health["dtypes"]) == 1, health  # both replicas: one choice
    (dtype, reason), = health["dtypes"].items()
    assert dtype in ("bfloat16", "float32") and reason.startswith(f"measured on this machine, {dtype} is faster")
    assert {load["dtype"] for load in stack.store.loads().values()} == {dtype}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the replicas' thread count, part of the choice's key
    try:  # read back from the cache the replicas wrote: nothing is timed here
        config, choice = resolve_engine_dtype({"target": str(tiny_pair[0]), "drafter": str(tiny_pair[1]),
                                               "max_batch": 8, "max_len": 512})
    finally:
        torch.set_num_threads(threads)
    assert choice["cached"] and config["dtype"] == choice["dtype"] == dtype and choice["reason"] == reason


def test_chat_and_streaming(client):
    kwargs = dict(model="adapt-demo", messages=[{"role": "user", "content": "print a square"}], max_tokens=10,
                  temperature=0)
    full = client.chat.completions.create(**kwargs, extra_headers=SLA)
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    pieces, final = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, extra_headers=SLA,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].finish_reason:
                final = chunk
    assert final is not None and "".join(pieces) == text
    assert final.model_extra["adapt"]["sla"]["quality_met"] is True
    assert final.usage.completion_tokens == full.usage.completion_tokens

    stream = client.completions.create(model="adapt-demo", prompt="for i in range(10):", max_tokens=8,
                                       temperature=0, stream=True, extra_headers={"X-SLA-TPOT-Ms": "1000"})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].model_extra["adapt"]["targets"]["tpot_ms"] == 1000.0


def test_headers_change_the_decisions(stack, client, redis_server):
    """The quality header decides the acceptance rule: exact rules only for lossless, ε-TVD otherwise."""
    from adapt.serving.redis_store import RedisStore

    ids = {}
    for quality in ("lossless", "tvd=0.5"):
        resp = client.completions.create(model="adapt-demo", prompt="class Point:", max_tokens=24, temperature=1.0,
                                         seed=7, extra_headers={"X-SLA-Quality": quality})
        ids[quality] = resp.id
        stats = resp.model_extra["adapt"]["stats"]
        if quality == "lossless":
            assert stats["tvd_spent"] == 0.0
    store = RedisStore(redis_server.url)
    rules: dict[str, set] = {}

    def collected() -> bool:
        for r in store.read_traces():
            if r["request_id"] in ids.values():
                rules.setdefault(r["request_id"], set()).add(r["rule"])
        return all(i in rules for i in ids.values())

    _wait(collected, 10, "trace records of both requests in the Redis stream")
    assert rules[ids["lossless"]] <= {0, 1, 2}, rules
    assert 3 in rules[ids["tvd=0.5"]], rules  # EPS_TVD


@pytest.mark.parametrize("headers,body,param", [
    ({"X-SLA-TPOT-Ms": "fast"}, {}, "X-SLA-TPOT-Ms"),
    ({"X-SLA-TPOT-Ms": "-5"}, {}, "X-SLA-TPOT-Ms"),
    ({"X-SLA-Quality": "tvd=2"}, {}, "X-SLA-Quality"),
    ({"X-SLA-Priority": "urgent"}, {}, "X-SLA-Priority"),
    ({}, {"sla": {"quality": "bogus"}}, "sla.quality"),
    ({}, {"sla": {"deadline": 3}}, "sla.deadline"),
    ({}, {"max_tokens": -1}, "max_tokens"),
    ({}, {"temperature": "hot"}, "temperature"),
    ({}, {"n": 2}, "n"),
    ({}, {"prompt": None}, "prompt"),
    ({}, {"decode": {"steps": 99}}, "decode.steps"),
])
def test_malformed_requests_get_4xx_naming_the_field(stack, headers, body, param):
    server = stack
    payload = {"model": "adapt-demo", "prompt": "hi", "max_tokens": 4, **body}
    r = httpx.post(server.url + "/v1/completions", json=payload, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_bad_bodies_and_server_keeps_serving(stack, client):
    server = stack
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 10**9]}, timeout=30)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="adapt-demo", prompt="x", max_tokens=4, extra_headers={"X-SLA-Quality": "x"})
    assert info.value.body["param"] == "X-SLA-Quality"
    ok = client.completions.create(model="adapt-demo", prompt="still serving", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_metrics_expose_the_decoder_counters(stack, client):
    from prometheus_client.parser import text_string_to_metric_families

    server = stack
    client.completions.create(model="adapt-demo", prompt="import os", max_tokens=16, temperature=1.0, seed=3,
                              extra_headers={"X-SLA-Quality": "tvd=0.5"})
    time.sleep(0.8)  # a heartbeat and a trace flush after the request
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("adapt_drafts", "adapt_draft_tokens", "adapt_accepted_tokens", "adapt_accepted_per_position",
                 "adapt_tau", "adapt_sla_attainment", "adapt_decisions", "adapt_tvd_spent", "adapt_queue_depth",
                 "adapt_step_time_ms"):
        assert name in families, name
    drafts = sum(s.value for s in families["adapt_drafts"].samples)
    assert drafts > 0
    levers = {s.labels["lever"] for s in families["adapt_decisions"].samples}
    assert levers == {"steps", "draft_len", "rule", "source"}
    assert sum(s.value for s in families["adapt_tvd_spent"].samples) > 0  # the tvd=0.5 request spent some


def _stream_request(url: str, max_tokens: int, out: dict, key: str, started: threading.Event | None = None):
    """POST a streaming completion, record worker, finish reason, error and chunk count."""
    rec = out.setdefault(key, {"chunks": 0, "finish": None, "error": None, "worker": None})
    payload = {"model": "adapt-demo", "prompt": f"import os {key}", "max_tokens": max_tokens, "temperature": 0,
               "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=120) as r:
        rec["worker"] = r.headers.get("x-adapt-worker")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                rec["error"], rec["error_at"] = event["error"], time.monotonic()
                continue
            rec["chunks"] += 1
            if started is not None and rec["chunks"] >= 2:
                started.set()
            if event["choices"][0]["finish_reason"]:
                rec["finish"] = event["choices"][0]["finish_reason"]


def _warm_router(url: str) -> None:
    """Serve's router places a request on the less loaded of two replicas by its counts of what it
    sent (and asks a replica it has no fresh count of). Requests that arrive in the same instant
    are placed on the same view, so the split of a burst is random (six at once: 5 + 1 seen); a
    few milliseconds apart, each sees the ones before it. One request first, and a moment for the
    router's questions to both replicas to be answered, then the tests send theirs 50 ms apart."""
    r = httpx.post(url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    time.sleep(0.5)


def test_two_workers_share_load_through_redis(stack, redis_server):
    from collections import Counter

    from adapt.serving.redis_store import RedisStore

    s = stack
    loads = RedisStore(redis_server.url).loads()
    workers, nodes = set(loads), {load["node"] for load in loads.values()}
    assert len(workers) == 2 and len(nodes) == 2  # one worker per node of the cluster
    out: dict = {}
    _warm_router(s.url)
    threads = [threading.Thread(target=_stream_request, args=(s.url, 24, out, f"r{i}")) for i in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=120)
    assert all(rec["finish"] in ("length", "stop") and rec["error"] is None for rec in out.values()), out
    routed = Counter(rec["worker"] for rec in out.values())  # Serve's router: the less loaded of two replicas
    assert set(routed) == workers and all(n >= 2 for n in routed.values()), routed
    loads = RedisStore(redis_server.url).loads()
    assert set(loads) == workers
    assert all(load["counters"]["passes"] > 0 for load in loads.values())
    cluster = s.controller.cluster_load.remote().result(timeout_s=30)  # the controller's aggregate of the same heartbeats
    assert cluster["num_workers"] == 2 and set(cluster["workers"]) == workers and cluster["store_ok"]


def test_redis_restart_does_not_stop_serving(stack, client, redis_server):
    s = server = stack
    redis_server.stop()
    try:
        for _ in range(2):
            resp = client.completions.create(model="adapt-demo", prompt="while Redis is down", max_tokens=6,
                                             temperature=0)
            assert resp.usage.completion_tokens >= 1
        assert httpx.get(server.url + "/health").json()["workers"] == 2  # last known view
        chunks = list(client.completions.create(model="adapt-demo", prompt="streaming too", max_tokens=6,
                                                temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    finally:
        redis_server.start()
    _wait(lambda: len(s.store.loads()) == 2, 15, "heartbeats to resume after the restart")
    assert client.completions.create(model="adapt-demo", prompt="back", max_tokens=4, temperature=0).usage


def test_pinned_decode_knobs_hold_under_each_pushed_policy(stack, redis_server, tmp_path):
    """Through Ray Serve: one batch mixing pinned and unpinned requests, under the static and the
    adaptive policy in turn (pushed to both workers); the pins hold on every decode step and the
    stats say so (tests/test_pins.py checks the same in-process, and the sampled law)."""
    from concurrent.futures import ThreadPoolExecutor

    from adapt import policy_file
    from adapt.serving.policy_commands import run_push
    from adapt.serving.redis_store import RedisStore

    store = RedisStore(redis_server.url)
    pins = {"off": {"steps": 0, "draft_len": 0}, "fixed": {"steps": 2, "draft_len": 4},
            "suffix": {"source": "suffix", "draft_len": 3}, "policy": None}
    for name in ("static", "adaptive"):
        path = tmp_path / f"{name}.json"
        policy_file.save(policy_file.PolicyFile(policy=name, settings={}), path)
        assert run_push(type("Args", (), {"policy": str(path), "redis_url": redis_server.url, "ray_address": None})) == 0
        version = store.policy_version()
        _wait(lambda: all(v.get("policy_version") == version for v in store.loads().values()), 15,
              f"both workers on the {name} policy")
        base = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}

        def post(pin):
            r = httpx.post(stack.url + "/v1/completions", json=dict(base, **({"decode": pin} if pin else {})), timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["adapt"]["stats"]

        with ThreadPoolExecutor(len(pins)) as pool:
            stats = dict(zip(pins, pool.map(post, pins.values())))
        off, fixed, suffix = stats["off"]["decode_stats"], stats["fixed"]["decode_stats"], stats["suffix"]["decode_stats"]
        assert stats["off"]["verified"] == 0 and off["source"] == {"none": off["steps"]}, (name, stats["off"])
        assert fixed["pins"] == {"steps": 2, "draft_len": 4} and set(fixed["diffusion_steps"]) == {"2"}, (name, fixed)
        assert fixed["draft_len"].get("4", 0) + fixed["pin_clamps"]["tokens_left"] == fixed["steps"], (name, fixed)
        assert fixed["pin_clamps"]["tokens_left"] <= 4 and fixed["verified"].get("suffix", 0) == 0
        assert suffix["verified"].get("diffusion", 0) == 0 and max(int(k) for k in suffix["draft_len"]) <= 3
        assert stats["policy"]["decode_stats"]["pins"] == {}


def test_policy_push_hot_reloads_and_corrupt_push_is_rejected(stack, redis_server, tmp_path):
    from adapt import policy_file
    from adapt.serving.policy_commands import run_push
    from adapt.serving.redis_store import RedisStore

    s = stack
    store = RedisStore(redis_server.url)
    good = policy_file.PolicyFile(settings={})
    path = tmp_path / "good.json"
    policy_file.save(good, path)
    args = type("Args", (), {"policy": str(path), "redis_url": redis_server.url, "ray_address": None})
    assert run_push(args) == 0
    version = store.policy_version()
    _wait(lambda: all(v.get("policy_version") == version for v in store.loads().values()) and len(store.loads()) == 2,
          15, f"both workers on policy version {version}")

    # a corrupt file is rejected by the CLI, naming the field; nothing is published
    doc = json.loads(path.read_text())
    doc["predictor"]["draft"]["weight"] = "oops"
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(json.dumps(doc))
    bad_args = type("Args", (), {"policy": str(bad_path), "redis_url": redis_server.url, "ray_address": None})
    assert run_push(bad_args) == 2
    assert store.policy_version() == version
    # also through the Controller deployment
    with pytest.raises(Exception, match="checksum"):
        s.controller.push_policy.remote(doc).result(timeout_s=30)
    # a corrupt document written past validation: workers reject it and keep the old policy
    bad_version = store.put_policy(doc)
    _wait(lambda: all(str(bad_version) in v.get("rejected_policies", {}) for v in store.loads().values()), 15,
          "workers to reject the corrupt version")
    assert all(v.get("policy_version") == version for v in store.loads().values())
    resp = httpx.post(s.url + "/v1/completions",
                      json={"prompt": "after the bad push", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert resp.status_code == 200 and resp.json()["adapt"]["policy_version"] == version

    # refit from the Redis trace stream and publish. The adaptive policy rarely drafts with the
    # barely trained tiny drafter, so log exploration traces first (the `explore` policy drafts
    # the full block with varied steps), as one would before a refit on a live cluster.
    from tests.conftest import refit_from_redis

    explore_path = tmp_path / "explore.json"
    policy_file.save(policy_file.PolicyFile(policy="explore", settings={}), explore_path)
    assert run_push(type("Args", (), {"policy": str(explore_path), "redis_url": redis_server.url,
                                      "ray_address": None})) == 0
    explore_version = store.policy_version()
    _wait(lambda: all(v.get("policy_version") == explore_version for v in store.loads().values()), 15,
          f"both workers on the explore policy {explore_version}")

    def drafted_exact() -> int:
        return sum(1 for r in store.read_traces()
                   if r.get("steps", 0) > 0 and r.get("draft_len", 0) > 0 and r.get("rule") in (0, 1, 2))

    for i in range(12):
        if drafted_exact() >= 30:
            break
        resp = httpx.post(s.url + "/v1/completions",
                          json={"prompt": f"more traces {i}", "max_tokens": 32, "temperature": 0}, timeout=60)
        assert resp.status_code == 200
    _wait(lambda: drafted_exact() >= 30, 15, "the trace stream to hold 30 drafted exact-rule records")
    assert refit_from_redis(redis_server.url, tmp_path / "refit.json") == 0
    refit = policy_file.load(tmp_path / "refit.json")
    assert refit.report["source"] == "trace stream" and refit.report["exact_records"] >= 20
    new_version = store.policy_version()
    assert new_version == explore_version + 1
    _wait(lambda: all(v.get("policy_version") == new_version for v in store.loads().values()), 15,
          f"both workers on the refitted version {new_version}")


def test_client_disconnect_aborts_the_request(stack, redis_server):
    from adapt.serving.redis_store import RedisStore

    server = stack
    store = RedisStore(redis_server.url)
    aborts = lambda: {w: v["counters"]["requests"].get("abort", 0) for w, v in store.loads().items()}  # noqa: E731
    before = aborts()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "disconnect me", "max_tokens": 450, "temperature": 0, "stream": True}) as r:
        wid = r.headers["x-adapt-worker"]
        for n, _ in enumerate(r.iter_lines()):
            if n >= 6:
                break  # leave mid-stream
    _wait(lambda: aborts().get(wid, 0) == before.get(wid, 0) + 1, 20, "the worker to abort the request")
    _wait(lambda: store.loads()[wid]["requests"] == 0, 10, "the engine slot to be freed")


def test_sigkilled_worker_mid_stream_is_replaced(stack, redis_server):
    """Runs last. SIGKILL a worker's process mid-stream: its streams end with an error event within
    seconds, the other worker's streams complete, requests keep being served by the survivor, and
    Serve replaces the worker with a new replica that serves."""
    import os
    import signal

    from adapt.serving.redis_store import RedisStore

    s = stack
    store = RedisStore(redis_server.url)
    out: dict = {}
    started = {f"s{i}": threading.Event() for i in range(4)}
    _warm_router(s.url)
    threads = [threading.Thread(target=_stream_request, args=(s.url, 300, out, k, started[k])) for k in started]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for ev in started.values():
        assert ev.wait(60)
    workers = set(store.loads())
    assert {rec["worker"] for rec in out.values()} == workers, out
    victim = sorted(workers)[0]
    old_pid = store.loads()[victim]["pid"]
    killed = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=120)
    for key, rec in out.items():
        if rec["worker"] == victim:
            assert rec["error"] is not None and rec["error"]["code"] == "worker_died" and rec["finish"] is None, rec
            assert rec["error_at"] - killed < 10, rec
        else:
            assert rec["error"] is None and rec["finish"] in ("length", "stop"), (key, rec)
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "after", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["adapt"]["worker"] != victim, r.text
    replacement: set = set()

    def replaced() -> bool:
        replacement.update(set(store.loads()) - workers)
        return bool(replacement)

    _wait(replaced, 90, "a replacement replica heartbeating")
    replaced_after = time.monotonic() - killed
    served = set()
    deadline = time.monotonic() + 30
    while not served & replacement and time.monotonic() < deadline:  # Serve's router takes it in
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "again", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        served.add(r.json()["adapt"]["worker"])
        time.sleep(0.2)
    assert served & replacement and victim not in served, (served, replacement)
    errors = [rec["error_at"] - killed for rec in out.values() if rec["worker"] == victim]
    print(f"\nSIGKILL mid-stream: {len(errors)} stream(s) ended with an error event after {max(errors):.2f} s, "
          f"{len(out) - len(errors)} completed; replacement heartbeating after {replaced_after:.1f} s, serving "
          f"after {time.monotonic() - killed:.1f} s")
