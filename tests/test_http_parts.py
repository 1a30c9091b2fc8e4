"""The serving parts that need no cluster: SLA header parsing, SLA verdicts, Prometheus text."""

from __future__ import annotations

import pytest

from adapt.serving.headers import ApiError, parse_targets
from adapt.serving.metrics import WorkerCounters, render_metrics
from adapt.serving.worker_plugin import sla_verdict
from adapt.targets import RequestTargets, ServerDefaults


def test_headers_and_body_fields_build_targets():
    t, explicit = parse_targets({"x-sla-tpot-ms": "40", "X-SLA-Quality": "tvd=0.05", "X-SLA-Priority": "low"}, None)
    assert explicit and t.tpot_ms == 40.0 and str(t.quality) == "tvd=0.05" and t.priority == -10
    t, _ = parse_targets({"X-SLA-Tokens-Per-S": "50"}, {"quality": "lossless", "tpot_ms": 100})
    assert t.effective_tpot_ms == 20.0 and t.lossless
    t, _ = parse_targets({"X-SLA-TPOT-Ms": "30"}, {"tpot_ms": 100})  # the header wins
    assert t.tpot_ms == 30.0
    t, explicit = parse_targets({}, None, ServerDefaults(tpot_ms=80, quality="tvd=0.1"))
    assert not explicit and t.tpot_ms == 80.0 and str(t.quality) == "tvd=0.1"


@pytest.mark.parametrize("headers,body,param", [
    ({"X-SLA-TPOT-Ms": "soon"}, None, "X-SLA-TPOT-Ms"),
    ({"X-SLA-TPOT-Ms": "0"}, None, "X-SLA-TPOT-Ms"),
    ({"X-SLA-TTFT-Ms": "nan"}, None, "X-SLA-TTFT-Ms"),
    ({"X-SLA-Quality": "tvd=0"}, None, "X-SLA-Quality"),
    ({"X-SLA-Priority": "500"}, None, "X-SLA-Priority"),
    ({"X-SLA-TVD-Budget": "1"}, None, "X-SLA-TVD-Budget"),  # a total budget needs tvd=E
    ({}, {"tpot_ms": "x"}, "sla.tpot_ms"),
    ({}, {"colour": "red"}, "sla.colour"),
    ({}, ["not", "an", "object"], "sla"),
])
def test_bad_targets_name_the_field(headers, body, param):
    with pytest.raises(ApiError) as info:
        parse_targets(headers, body)
    assert info.value.param == param and info.value.status == 400 and param in info.value.message
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_sla_verdict():
    t = RequestTargets(tpot_ms=10, quality="tvd=0.1", ttft_ms=100)
    timing = {"arrival": 0.0, "first": 0.05, "last": 0.131, "tokens": 10}
    v = sla_verdict(t, timing, {"tvd_spent": 0.5})
    assert v["tpot_ms"] == pytest.approx(9.0) and v["ttft_ms"] == pytest.approx(50.0)
    assert v["met"] and v["latency_met"] and v["quality_met"]
    v = sla_verdict(t, {**timing, "last": 0.5}, {"tvd_spent": 0.5})
    assert not v["met"] and v["latency_met"] is False
    v = sla_verdict(RequestTargets(), timing, {"tvd_spent": 0.01})
    assert v["latency_met"] is None and v["quality_met"] is False and not v["met"]


def test_metrics_render_as_prometheus_text():
    from prometheus_client.parser import text_string_to_metric_families

    c = WorkerCounters()
    c.observe_traces([
        {"steps": 2, "draft_len": 3, "accepted": 2, "accept_flags": [1, 1, 0], "rule": 1, "tvd_spent": 0.0},
        {"steps": 0, "draft_len": 0, "accepted": 0, "accept_flags": [], "rule": 0, "tvd_spent": 0.0},
        {"steps": 1, "draft_len": 2, "accepted": 2, "accept_flags": [1, 1], "rule": 3, "tvd_spent": 0.04},
        {"steps": -1, "draft_len": 4, "accepted": 1, "accept_flags": [1, 0, 0, 0], "rule": 0, "tvd_spent": 0.0,
         "source": "suffix", "suffix_match": 5},
    ])
    c.observe_step(7.5)
    c.observe_request("length", {"met": True, "latency_met": True, "quality_met": True})
    text = render_metrics({"w0": {"waiting": 2, "running": 3, "counters": c.snapshot()}})
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    value = lambda name, **labels: next(s.value for s in fams[name].samples  # noqa: E731
                                        if all(s.labels.get(k) == v for k, v in labels.items()))
    assert value("adapt_drafts") == 3 and value("adapt_draft_tokens") == 9 and value("adapt_accepted_tokens") == 5
    assert value("adapt_tau") == pytest.approx(9 / 4)
    assert value("adapt_decisions", lever="source", value="suffix") == 1
    assert value("adapt_accepted_per_position", position="0") == 3
    assert value("adapt_accepted_per_position", position="2") == 0
    assert value("adapt_decisions", lever="rule", value="eps_tvd") == 1
    assert value("adapt_tvd_spent") == pytest.approx(0.04)
    assert value("adapt_queue_depth") == 2 and value("adapt_sla_attainment") == 1.0
    assert value("adapt_step_time_ms", le="10.0") == 1 and value("adapt_step_time_ms", le="5.0") == 0
    assert value("adapt_workers_live") == 1
    assert {s.name: s.value for s in fams["adapt_step_time_ms"].samples
            if s.name != "adapt_step_time_ms_bucket"} == {"adapt_step_time_ms_count": 1, "adapt_step_time_ms_sum": 7.5}
    assert fams["adapt_drafts"].type == "counter" and fams["adapt_tau"].type == "gauge"


def test_metrics_route_per_app_registry_and_openmetrics():
    """Each app renders /metrics from its own registry (two apps in one process do not mix, and
    prometheus-client's global registry stays untouched); an OpenMetrics scraper gets OpenMetrics."""
    from fastapi.testclient import TestClient
    from prometheus_client import REGISTRY
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
    from prometheus_client.parser import text_string_to_metric_families

    from adapt.serving.http_app import build_app
    from adapt.serving.limits import Limits

    class Loads:
        def __init__(self, loads):
            self._loads = loads

        async def loads(self):
            return self._loads

        def stream(self, request):
            raise AssertionError("no generation in this test")

    c = WorkerCounters()
    c.observe_traces([{"steps": 1, "draft_len": 2, "accepted": 1, "accept_flags": [1, 0], "rule": 0}])
    one = TestClient(build_app(Loads({"w0": {"waiting": 1, "running": 0, "counters": c.snapshot()}}),
                               limits=Limits(max_running=2, max_queue=1)))
    two = TestClient(build_app(Loads({})))

    def values(client, **headers):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 200
        return r, {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(r.text) for s in f.samples}

    r1, v1 = values(one)
    _, v2 = values(two)
    assert r1.headers["content-type"].startswith("text/plain")
    assert v1[("adapt_workers_live", ())] == 1 and v2[("adapt_workers_live", ())] == 0
    assert v1[("adapt_drafts_total", (("worker", "w0"),))] == 1 and ("adapt_drafts_total", (("worker", "w0"),)) not in v2
    assert v1[("adapt_ingress_capacity", ())] == 3 and v2[("adapt_ingress_capacity", ())] == -1
    assert v1[("adapt_ingress_rejected_total", (("reason", "queue_full"),))] == 0
    assert not any(name.startswith("adapt_") for name in REGISTRY._names_to_collectors)

    r = one.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text") and r.text.endswith("# EOF\n")
    fams = {f.name: f for f in parse_openmetrics(r.text)}
    assert fams["adapt_drafts"].type == "counter" and fams["adapt_step_time_ms"].type == "histogram"


def test_serve_backend_loads_keep_the_last_view_through_a_store_restart():
    """/health's view of the workers (`ServeBackend.loads`): the last view while the store is
    unreachable, and for the heartbeats' TTL when it answers empty after holding workers (a
    Controller or Redis restarted empty), then empty."""
    import asyncio
    import time

    from adapt.serving.deployment import ServeBackend
    from adapt.serving.store import InProcessStore

    class Restarting(InProcessStore):
        down = False

        def loads(self):
            if self.down:
                raise ConnectionError("controller store unreachable")
            return super().loads()

    store = Restarting()
    backend = ServeBackend(decoder=None, store=store, empty_grace_s=0.3)
    loads = lambda: asyncio.run(backend.loads())  # noqa: E731
    assert loads() == {}
    store.put_load("w0", {"requests": 1}, ttl_s=10)
    assert set(loads()) == {"w0"}
    store.down = True
    assert set(loads()) == {"w0"}  # unreachable: the last view
    store.down = False
    store.remove_worker("w0")  # back, but empty: the last view for the grace
    assert set(loads()) == {"w0"}
    store.put_load("w1", {"requests": 0}, ttl_s=10)  # a heartbeat in the new store
    assert set(loads()) == {"w1"}
    store.remove_worker("w1")
    assert set(loads()) == {"w1"}
    time.sleep(0.35)
    assert loads() == {}  # still empty after the grace: no workers


def test_the_guard_checks_keys_under_a_route_prefix_too():
    """Mounted under a prefix (Serve's route_prefix sets root_path and keeps it in path), /v1
    routes still need the key."""
    import asyncio

    from adapt.serving.auth import ApiKeys
    from adapt.serving.limits import Admission, Guard, Limits

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    guard = Guard(app, ApiKeys(["k1"]), Admission(Limits()))
    scope = {"type": "http", "method": "GET", "path": "/api/v1/models", "root_path": "/api", "headers": []}
    asyncio.run(guard(scope, receive, send))
    assert not reached and sent[0]["status"] == 401
    ok = dict(scope, headers=[(b"authorization", b"Bearer k1")])
    asyncio.run(guard(ok, receive, send))
    assert reached == ["/api/v1/models"]
    asyncio.run(guard(dict(scope, path="/api/health"), receive, send))  # /health stays open
    assert reached[-1] == "/api/health"
