"""The HTTP front under abuse: API keys, body limits, unsupported OpenAI fields, a request flood.

One real decoder worker in this process (no Ray; the same worker class, plugin and FastAPI app as
``adapt serve``) on uvicorn, driven over real HTTP by httpx and the openai client. The app
requires API keys and has a small queue (4 running + 4 waiting) and body limit (64 KiB), so that
the limits are reached quickly. The same flags through ``adapt serve`` on Ray are covered in
tests/test_serving_cli.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import Counter

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

KEYS = ("sk-first-4f1c", "sk-second-9a2e")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
MAX_BODY = 64 * 1024
MAX_RUNNING, MAX_QUEUE, MAX_LEN = 4, 4, 64


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    from adapt.serving.auth import ApiKeys
    from adapt.serving.http_app import build_app
    from tests.local_backend import WorkerBackend
    from adapt.serving.launcher import HttpServer
    from adapt.serving.limits import Limits
    from adapt.serving.worker_plugin import ServingPlugin
    from tests.tiny_models import make_tiny_pair
    from workers.ray_worker import DecoderWorker

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("abuse-models"))
    plugin = functools.partial(ServingPlugin, store=None, heartbeat_s=0.2)  # a private in-process store
    worker = DecoderWorker("w0", {"target": str(target), "drafter": str(drafter), "max_batch": MAX_RUNNING,
                                  "max_len": MAX_LEN}, plugin, num_threads=1)

    app = build_app(WorkerBackend(worker), default_max_tokens=4, api_keys=ApiKeys(KEYS),
                    limits=Limits(max_running=MAX_RUNNING, max_queue=MAX_QUEUE, max_body_bytes=MAX_BODY))
    server = HttpServer(app).start()
    deadline = time.monotonic() + 10
    while not worker.plugin.store.loads() and time.monotonic() < deadline:
        time.sleep(0.05)  # the first heartbeat
    yield server.url, worker, app
    server.stop()
    worker.shutdown()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    return r.json()["error"]


def test_api_keys_guard_every_v1_route(guarded):
    url, _, app = guarded
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    for route, method in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
                          ("/v1/nowhere", "GET")):
        r = httpx.request(method, url + route, json=body if method == "POST" else None)
        err = _error(r, 401)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    wrong = ["Bearer sk-first-4f1d", f"Basic {KEYS[0]}", KEYS[0], "Bearer", f"Bearer {KEYS[0]}x"]
    for value in wrong:
        r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": value})
        err = _error(r, 401)
        assert KEYS[0] not in r.text and err["message"] == "invalid API key"  # the key is never echoed
    for key in KEYS:  # every configured key works, with the openai client too
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        assert client.completions.create(model="adapt-demo", **body).usage.completion_tokens >= 1
        assert [m.id for m in client.models.list().data] == ["adapt-demo"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="sk-guess", max_retries=0).models.list()
    # /health and /metrics stay open; an unknown /v1 route behind a good key is a JSON 404
    assert httpx.get(url + "/health").status_code == 200
    assert "adapt_ingress_rejected_total" in httpx.get(url + "/metrics").text
    assert _error(httpx.get(url + "/v1/nowhere", headers=AUTH), 404)["code"] == "not_found"
    assert app.state.admission.rejected["unauthorized"] >= 9


def test_api_keys_from_flags_and_environment():
    from adapt.serving.auth import ApiKeys

    keys = ApiKeys.from_sources(["a-key"], env={"ADAPT_API_KEY": "b-key, c-key"})
    assert len(keys) == 3 and all(keys.check(f"Bearer {k}") for k in ("a-key", "b-key", "c-key"))
    assert not keys.check(None) and not keys.check("Bearer d-key") and not keys.check("bearer")
    assert "key" not in repr(keys).replace("keys", "")  # prints as a count, never the keys
    assert not ApiKeys.from_sources([], env={}) and ApiKeys().check(None)  # no keys: open


def test_body_limits_and_context_length(guarded):
    url, worker, app = guarded
    big = {"prompt": "x" * (MAX_BODY + 10), "max_tokens": 2}
    err = _error(httpx.post(url + "/v1/completions", json=big, headers=AUTH), 413)
    assert err["param"] == "body" and str(MAX_BODY) in err["message"] and err["code"] == "body_too_large"

    def chunked():  # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunked(), headers={**AUTH, "content-type": "application/json"})
    assert _error(r, 413)["param"] == "body"
    # prompts longer than the context: 400 naming the limit
    err = _error(httpx.post(url + "/v1/completions", json={"prompt": list(range(2, 2 + MAX_LEN))}, headers=AUTH),
                 400)
    assert err["param"] == "prompt" and f"{MAX_LEN} (max_len)" in err["message"]
    long_chat = {"messages": [{"role": "user", "content": "word " * 200}]}
    err = _error(httpx.post(url + "/v1/chat/completions", json=long_chat, headers=AUTH), 400)
    assert err["param"] == "messages" and "max_len" in err["message"]
    assert app.state.admission.in_flight == 0 and worker.load()["requests"] == 0


@pytest.mark.parametrize("route,field,value", [
    ("completions", "n", 2),
    ("completions", "logprobs", 2),
    ("completions", "echo", True),
    ("completions", "best_of", 3),
    ("completions", "logit_bias", {"5": 10}),
    ("completions", "suffix", "tail"),
    ("completions", "presence_penalty", 0.5),
    ("completions", "repetition_penalty", 1.1),  # not an OpenAI field
    ("chat/completions", "logprobs", True),
    ("chat/completions", "top_logprobs", 3),
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat/completions", "tool_choice", "auto"),
    ("chat/completions", "response_format", {"type": "json_object"}),
    ("chat/completions", "n", 3),
    ("chat/completions", "stop", ["a", "b", "c", "d", "e"]),
])
def test_unsupported_openai_fields_are_named(guarded, route, field, value):
    url, _, _ = guarded
    base = {"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    err = _error(httpx.post(f"{url}/v1/{route}", json={**base, "max_tokens": 2, field: value}, headers=AUTH), 400)
    assert err["param"] == field and err["message"].startswith(field), err


def test_neutral_values_of_unsupported_fields_and_stop_work(guarded):
    url, _, _ = guarded
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[1], max_retries=0, timeout=60)
    neutral = {"logit_bias": {}, "best_of": 1, "suffix": None, "logprobs": None, "n": 1, "presence_penalty": 0}
    full = client.completions.create(model="adapt-demo", prompt="class Point:", max_tokens=24, temperature=0,
                                     **neutral)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and len(text) > 4
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = client.completions.create(model="adapt-demo", prompt="class Point:", max_tokens=24, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    chat = client.chat.completions.create(model="adapt-demo", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, tools=[], response_format={"type": "text"}, n=1,
                                          logprobs=False)
    assert chat.usage.completion_tokens >= 1


def test_a_flood_gets_429_with_retry_after_and_every_accepted_request_completes(guarded):
    import psutil

    url, worker, app = guarded
    n_requests, max_tokens = 256, 16
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    peak = [rss0]

    async def one(client: httpx.AsyncClient, i: int):
        await asyncio.sleep(0.004 * i)  # arrivals over ~1 s: slots free up and are taken again
        t0 = time.perf_counter()
        stream = i % 2 == 1
        body = {"prompt": f"def flood_{i}(x):", "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        r = await client.post(url + "/v1/completions", json=body, headers=AUTH)
        events = [line for line in r.text.splitlines() if line.startswith("data: ")] if stream else []
        peak[0] = max(peak[0], proc.memory_info().rss)
        return r, events, time.perf_counter() - t0

    async def flood():
        limits = httpx.Limits(max_connections=n_requests, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n_requests)))

    t0 = time.perf_counter()
    results = asyncio.run(flood())
    wall = time.perf_counter() - t0
    statuses = [r.status_code for r, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    rejected = [r for r, _, _ in results if r.status_code == 429]
    accepted = [(r, ev, dt) for r, ev, dt in results if r.status_code == 200]
    assert rejected and len(accepted) >= MAX_RUNNING + MAX_QUEUE
    for r in rejected:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    for r, events, _ in accepted:  # every accepted request completes
        if events:
            assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
            assert '"finish_reason":"length"' in events[-2] or '"finish_reason":"stop"' in events[-2]
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    lat = sorted(dt for _, _, dt in accepted)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(f"\nflood: {n_requests} requests in {wall:.2f} s, {len(rejected)} answered 429, {len(accepted)} accepted, "
          f"p99 latency of accepted {p99 * 1e3:.0f} ms, peak ingress {app.state.admission.peak}, "
          f"RSS {rss0 / 2**20:.0f} -> peak {peak[0] / 2**20:.0f} MiB")
    assert app.state.admission.peak <= MAX_RUNNING + MAX_QUEUE
    assert peak[0] - rss0 < 200 * 2**20
    deadline = time.monotonic() + 10  # a stream leaves the ingress just after its last event is sent
    while (worker.load()["requests"] or app.state.admission.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.admission.in_flight == 0
    assert worker.load()["requests"] == 0
    r = httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and httpx.get(url + "/health").json()["ingress"]["in_flight"] == 0


# -- fuzzing: generated bodies and headers, every answer 2xx or a 4xx JSON error -----------------

FUZZ = settings(max_examples=500, deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=list(HealthCheck))
SLA_NAMES = ["X-SLA-TPOT-Ms", "X-SLA-Tokens-Per-S", "X-SLA-TTFT-Ms", "X-SLA-Quality", "X-SLA-TVD-Budget",
             "X-SLA-Priority"]

def _weighted(*options):
    """One of the strategies, picked with the given weights (``st.one_of`` merges duplicates)."""
    table = [strategy for weight, strategy in options for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=8)
_header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255, blacklist_characters="\x7f"),
                       max_size=16).map(str.strip)  # HTTP forbids surrounding whitespace in a value
_fuzzed_headers = st.fixed_dictionaries(
    {"Authorization": _weighted((9, st.just(AUTH["Authorization"])),
                                (1, _header_text.map(lambda t: f"Bearer {t}".strip())))},
    optional={
        **{name: _weighted((1, _header_text), (3, st.sampled_from(["lossless", "tvd=0.05", "tvd=2", "high", "40", "-1",
                                                                   "nan", "1e309", "0", "25", "500"])))
           for name in SLA_NAMES},
        "Content-Type": st.one_of(st.just("text/plain"), _header_text),
        "X-Request-Id": _header_text,
    })
_valid_headers = st.fixed_dictionaries({"Authorization": st.just(AUTH["Authorization"])}, optional={
    "X-SLA-TPOT-Ms": st.sampled_from(["40", "500", "1000.5"]), "X-SLA-TTFT-Ms": st.sampled_from(["100", "5000"]),
    "X-SLA-Quality": st.sampled_from(["lossless", "tvd=0.05"]), "X-SLA-Priority": st.sampled_from(["high", "-3"])})
_headers = _weighted((2, _valid_headers), (1, _fuzzed_headers)).map(
    lambda h: {k: v.encode("latin-1") for k, v in h.items()})  # bytes: non-ASCII values go out as sent
# Valid bodies first (so that decoding is reached), then 0-2 mutations: a field set to an edge or
# random JSON value, or removed; plus top-level JSON that is not an object, and raw bytes.
_edge = st.one_of(st.sampled_from([-1, 0, 1, 2**63, 2**64, 1e309, -1e309, 0.5, "", "x", [], {}, None, True, False,
                                   [1, 2], {"a": 1}]), _json)
_valid_common = {
    "model": st.just("adapt-demo"),
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1),
    "user": st.text(max_size=8),
    "sla": st.fixed_dictionaries({}, optional={
        "tpot_ms": st.floats(1, 1000), "ttft_ms": st.floats(1, 10000), "priority": st.integers(-100, 100),
        "quality": st.sampled_from(["lossless", "tvd=0.05", "tvd=0.5"])}),
    "decode": st.fixed_dictionaries({}, optional={
        "steps": st.integers(0, 64), "draft_len": st.integers(0, 16),
        "commit_order": st.sampled_from(["confidence", "left-to-right"])}),
    "logit_bias": st.just({}),
    "response_format": st.just({"type": "text"}),
}
_valid_prompt = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 511), min_size=1, max_size=40))
_valid_completion = st.fixed_dictionaries({"prompt": _valid_prompt}, optional={
    **_valid_common, "echo": st.just(False), "logprobs": st.sampled_from([None, 0])})
_valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                        "content": st.text(max_size=30)})
_valid_chat = st.fixed_dictionaries({"messages": st.lists(_valid_message, min_size=1, max_size=3)}, optional={
    **_valid_common, "max_completion_tokens": st.integers(1, 4), "logprobs": st.just(False)})
_FIELDS = sorted({*_valid_common, "prompt", "messages", "echo", "logprobs", "max_completion_tokens", "best_of",
                  "tools", "tool_choice", "presence_penalty", "frequency_penalty", "suffix", "top_logprobs",
                  "unknown_field"})


def _mutated(valid):
    mutation = st.tuples(st.sampled_from(_FIELDS), st.one_of(_edge, st.just("<delete>")))

    def apply(body, mutations):
        out = dict(body)
        for name, value in mutations:
            if value == "<delete>":
                out.pop(name, None)
            else:
                out[name] = value
        return out

    return st.builds(apply, valid, st.lists(mutation, max_size=2))


_completion = _mutated(_valid_completion)
_chat = _mutated(_valid_chat)


def _body_bytes(body) -> st.SearchStrategy[bytes]:
    return _weighted((8, body.map(lambda b: json.dumps(b).encode())),  # NaN/Infinity included, as Python writes them
                     (1, _json.map(lambda b: json.dumps(b).encode())), (1, st.binary(max_size=64)))


def _check_answer(r: httpx.Response, stream_ok: bool = True) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]  # a JSON error in OpenAI's shape
        assert isinstance(err["message"], str) and err["message"] and err["type"]
        if r.status_code == 400:
            assert err["param"] is None or err["param"] in err["message"] or err["param"] == "messages", err
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        assert stream_ok
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    elif stream_ok:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    else:
        assert r.json()["data"][0]["id"] == "adapt-demo"


FUZZ_COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def fuzz_client(guarded):
    with httpx.Client(base_url=guarded[0], timeout=60) as client:
        yield client


@FUZZ
@given(body=_body_bytes(_completion), headers=_headers)
def test_fuzz_completions(fuzz_client, body, headers):
    r = fuzz_client.post("/v1/completions", content=body, headers={"Content-Type": b"application/json", **headers})
    FUZZ_COUNTS["/v1/completions", r.status_code // 100] += 1
    _check_answer(r)


@FUZZ
@given(body=_body_bytes(_chat), headers=_headers)
def test_fuzz_chat_completions(fuzz_client, body, headers):
    r = fuzz_client.post("/v1/chat/completions", content=body,
                         headers={"Content-Type": b"application/json", **headers})
    FUZZ_COUNTS["/v1/chat/completions", r.status_code // 100] += 1
    _check_answer(r)


@FUZZ
@given(headers=_headers, method=st.sampled_from(["GET", "GET", "POST", "DELETE"]), query=st.text(max_size=10))
def test_fuzz_models(fuzz_client, headers, method, query):
    r = fuzz_client.request(method, "/v1/models", params={"q": query} if query else None, headers=headers)
    FUZZ_COUNTS["/v1/models", r.status_code // 100] += 1
    _check_answer(r, stream_ok=False)


def test_fuzzed_server_stays_healthy(guarded):
    url, worker, app = guarded
    print("\nfuzz answers by route and status class:", dict(sorted(FUZZ_COUNTS.items())))
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert sum(n for (r, _), n in FUZZ_COUNTS.items() if r == route) >= 500, FUZZ_COUNTS
        assert FUZZ_COUNTS[route, 2] > 0 and FUZZ_COUNTS[route, 4] > 0  # both kinds were reached
    assert not any(cls == 5 for _, cls in FUZZ_COUNTS)
    assert httpx.get(url + "/health").json()["status"] == "ok"
    r = httpx.post(url + "/v1/completions", json={"prompt": "still here", "max_tokens": 4}, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    deadline = time.monotonic() + 10
    while (worker.load()["requests"] or app.state.admission.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.load()["requests"] == 0 and app.state.admission.in_flight == 0
