"""Per-request decode pins through real HTTP: whatever the server's policy, a request's pinned
`decode` knobs are what its rows draft and verify with, and its stats say what each step did.

Servers: the decoder worker, its serving plugin (the named registry policy, no policy file) and
the FastAPI app on uvicorn in this process (tests/test_http_inprocess.py's path, without Ray).
The contract test runs the demo pair (greedy "def fibonacci(n):", whose repeats suffix drafts
copy); the goodness-of-fit test runs the vocabulary-8 pair of tests/test_engine_sampling.py
(with a word-level tokenizer, and no EOS so that every sample has its three tokens) and tests
the law of three sampled tokens at T = 1 against the target's own, as the engine-level test does.
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.test_engine_sampling import PROMPT, V, chi2_pvalue, exact_law
from tests.tiny_models import make_tiny_drafter, make_tiny_target, single_thread
from workers.engine import DEMO_DRAFTER, DEMO_TARGET

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

FIB = "def fibonacci(n):"
TOKENS = 48


def _serve(target: Path, drafter: Path, policy: str, max_batch: int):
    from adapt.serving.http_app import build_app
    from tests.local_backend import WorkerBackend
    from adapt.serving.launcher import HttpServer
    from adapt.serving.worker_plugin import ServingPlugin
    from workers.ray_worker import DecoderWorker

    plugin = functools.partial(ServingPlugin, store=None, policy=policy, profile_cost=False, heartbeat_s=0.5)
    worker = DecoderWorker("w0", {"target": str(target), "drafter": str(drafter), "dtype": "float32",
                                  "max_batch": max_batch, "max_len": 256}, plugin, num_threads=1)

    server = HttpServer(build_app(WorkerBackend(worker), default_max_tokens=16)).start()
    return server, worker


@pytest.fixture(scope="module", params=["static", "adaptive"])
def demo_server(request):
    server, worker = _serve(DEMO_TARGET, DEMO_DRAFTER, request.param, max_batch=8)
    yield server.url, request.param
    server.stop()
    worker.shutdown()


def _post_all(url: str, bodies: list[dict], workers: int) -> list[dict]:
    """POST every body to /v1/completions at once (they share the engine's batches). Each request
    has a client and a connection of its own: a kept-alive connection that sat idle past uvicorn's
    keep-alive timeout (5 s, reached on a slow machine) may be closed by the server as the client
    reuses it, and one client's pool shared by the threads failed a POST with ``httpx.ReadError:
    [Errno 9] Bad file descriptor`` (a read on a socket the pool had already closed) in 2 of some
    30 full runs; either way the server did nothing wrong."""
    def post(body):
        with httpx.Client(timeout=120) as client:
            r = client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(post, bodies))


def _consistent(st: dict) -> dict:
    """The request's per-step stats, checked to add up; returns them."""
    d = st["decode_stats"]
    n = d["steps"]
    assert n == st["target_passes"] - 1  # every pass after the prefill is a decode step
    for hist in ("draft_len", "source"):
        assert sum(d[hist].values()) == n, (hist, d)
    assert sum(d["diffusion_steps"].values()) <= n and sum(d["rules"].values()) <= n
    assert sum(d["verified"].values()) == st["verified"] and sum(d["accepted"].values()) == st["accepted"]
    assert st["verified"] == sum(int(k) * c for k, c in d["draft_len"].items())
    assert d["source"].get("none", 0) == d["draft_len"].get("0", 0)
    return d


def test_pins_hold_under_the_server_policy(demo_server):
    url, policy = demo_server
    base = {"prompt": FIB, "max_tokens": TOKENS, "temperature": 0}
    pins = {"off": {"steps": 0, "draft_len": 0}, "none": {"source": "none"}, "fixed": {"steps": 2, "draft_len": 4},
            "suffix": {"source": "suffix", "draft_len": 3}, "policy": None}
    bodies = [dict(base, **({"decode": p} if p is not None else {})) for p in pins.values()]
    out = dict(zip(pins, _post_all(url, bodies, len(bodies))))
    text = {name: r["choices"][0]["text"] for name, r in out.items()}
    stats = {name: r["adapt"]["stats"] for name, r in out.items()}
    log = {name: _consistent(st) for name, st in stats.items()}

    # greedy and lossless: every request's text is the target's own
    assert len(set(text.values())) == 1, text

    for name in ("off", "none"):  # speculation off: no drafted token of any source verified
        st, d = stats[name], log[name]
        assert st["verified"] == 0 and st["accepted"] == 0, (policy, name, st)
        assert d["source"] == {"none": d["steps"]} and d["diffusion_steps"] == {}
        assert st["source_used"] == "none" and st["tau"] == 1.0
        assert d["pins"] == pins[name]

    st, d = stats["fixed"], log["fixed"]  # steps 2, draft length 4 on every step with >= 5 tokens left
    assert d["pins"] == {"steps": 2, "draft_len": 4}
    assert set(d["diffusion_steps"]) <= {"2"} and set(d["draft_len"]) <= {"0", "1", "2", "3", "4"}
    assert d["verified"].get("suffix", 0) == 0
    short = d["pin_clamps"]["tokens_left"]  # steps with fewer than 5 tokens left (at most 4 of them)
    assert d["draft_len"].get("4", 0) + short == d["steps"] and short <= 4
    assert d["pin_clamps"]["draft"] == 0 and d["draft_len"]["4"] >= 1
    assert d["diffusion_steps"].get("2", 0) >= d["draft_len"]["4"]
    assert (st["steps_used"], st["draft_len_used"], st["source_used"]) == (2, 4, "diffusion")

    st, d = stats["suffix"], log["suffix"]  # suffix drafts only, at most 3 tokens
    assert d["verified"].get("diffusion", 0) == 0 and d["diffusion_steps"] == {}
    assert set(d["source"]) <= {"suffix", "none"} and d["verified"]["suffix"] > 0
    assert max(int(k) for k in d["draft_len"]) <= 3
    assert st["source_used"] == "suffix" and st["tau"] > 1.0

    assert log["policy"]["pins"] == {}  # left to the policy: nothing pinned, nothing clamped
    assert log["policy"]["pin_clamps"] == {"tokens_left": 0, "draft": 0, "block": 0}


def test_pinned_values_beyond_the_block_are_clamped_and_reported(demo_server):
    url, _ = demo_server
    body = {"prompt": FIB, "max_tokens": 12, "temperature": 0, "decode": {"steps": 40, "draft_len": 30}}
    st = _post_all(url, [body], 1)[0]["adapt"]["stats"]
    d = _consistent(st)
    assert d["pins"] == {"steps": 16, "draft_len": 16} and d["pin_clamps"]["block"] == 2
    assert set(d["diffusion_steps"]) == {"16"}


@pytest.fixture(scope="module")
def law_server(tmp_path_factory):
    """The vocabulary-8 pair of tests/test_engine_sampling.py with a word-level tokenizer and no
    EOS (the HTTP API has no ignore_eos: each sample then has its three tokens), under the
    adaptive policy."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tmp = tmp_path_factory.mktemp("pins-law")
    target = make_tiny_target(tmp / "target", vocab=V, seed=2, hidden=32, heads=2, kv_heads=1, intermediate=64,
                              init_std=0.5)
    drafter = make_tiny_drafter(tmp / "drafter", target, seed=2)
    cfg = json.loads((target / "config.json").read_text())
    cfg["eos_token_id"] = None
    (target / "config.json").write_text(json.dumps(cfg))
    words = {f"w{i}": i for i in range(V)} | {"<eos>": V}  # the tokenizer's EOS lies outside the model's vocabulary
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<eos>")),
                                   eos_token="<eos>")
    fast.save_pretrained(target)
    server, worker = _serve(target, drafter, "adaptive", max_batch=64)
    yield server.url, target
    server.stop()
    worker.shutdown()


N = 1000  # samples per pinned configuration
LAW_PINS = {"s1": ({"steps": 1, "draft_len": 4}, "REJECTION"), "s2": ({"steps": 2, "draft_len": 4}, "MATCH")}


def test_sampled_law_through_the_api_with_speculation_pinned_on(law_server):
    """Both pinned configurations in one stream of requests (their rows share batches, under the
    adaptive policy): each one's law of tokens 2..4 at T = 1 is the target's own."""
    url, target = law_server
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0}
    bodies = [dict(body, seed=i, decode=pin) for i in range(N) for pin, _ in LAW_PINS.values()]
    out = _post_all(url, bodies, 32)
    law, wrong = exact_law(target, 1.0, 0, 1.0), exact_law(target, 0.7, 0, 1.0)
    for j, (name, (pin, rule)) in enumerate(LAW_PINS.items()):
        mine = out[j :: len(LAW_PINS)]
        stats = [r["adapt"]["stats"] for r in mine]
        samples = []
        for r, st in zip(mine, stats):
            words = r["choices"][0]["text"].split()
            assert len(words) == 4, r["choices"][0]["text"]
            samples.append(tuple(int(w[1:]) for w in words[1:4]))
            d = _consistent(st)
            assert d["pins"] == pin and set(d["diffusion_steps"]) <= {str(pin["steps"])}
            assert d["verified"].get("suffix", 0) == 0 and set(d["rules"]) <= {rule}
            assert d["draft_len"].get("2") == 1  # the first decode step had 3 tokens left: 2 drafts verified
        assert sum(st["accepted"] for st in stats) > N // 8, name  # verification really ran
        p = chi2_pvalue(samples, law)
        assert p > 1e-3, f"{name}: the API's sampled law departs from the target's (chi-square p = {p:.2e})"
        assert chi2_pvalue(samples, wrong) < 1e-3, name  # the test has power: T = 0.7's law is rejected


def test_cli_pins_hold_under_the_adaptive_policy(capsys, tmp_path):
    """`adapt generate --policy adaptive --steps 2 --draft-len 4`: the policy decides nothing the
    flags pinned; its --json stats are the engine's (the same fields as the HTTP API's)."""
    from adapt.cli import main

    rc = main(["generate", FIB, "--pair", "demo", "--policy", "adaptive", "--steps", "2", "--draft-len", "4",
               "--temperature", "1", "--seed", "1", "--max-tokens", "24", "--ignore-eos", "--dtype", "float32",
               "--compile", "off", "--cache-dir", str(tmp_path), "--json"])
    assert rc == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    assert st["policy"] == "adaptive"
    d = _consistent(st)
    assert d["pins"] == {"steps": 2, "draft_len": 4} and set(d["diffusion_steps"]) == {"2"}
    assert d["draft_len"].get("4", 0) + d["pin_clamps"]["tokens_left"] == d["steps"]
    assert d["pin_clamps"]["tokens_left"] <= 4 and d["verified"].get("suffix", 0) == 0
    assert st["last_step"]["source"] in ("diffusion", "none")


@pytest.mark.parametrize("policy", ["static", "adaptive"])
def test_engine_api_pins_of_each_kind(policy):
    """The Python engine API (`DecodeKnobs.pin`), with a registry policy deciding: each kind of
    pin (a draft length alone, a source alone, steps alone, speculation off) holds, and greedy
    output stays the target's own."""
    from adapt.controller import build_policy
    from tests.tiny_models import run_to_completion
    from workers.engine import Engine, EngineConfig
    from workers.request import DecodeKnobs, SamplingParams

    engine = Engine(EngineConfig(target=DEMO_TARGET, drafter=DEMO_DRAFTER, dtype="float32", max_batch=8, max_len=256),
                    decisions=build_policy(policy))
    pins = {"k2": {"draft_len": 2}, "diffusion": {"source": "diffusion"}, "s3": {"steps": 3},
            "suffix": {"source": "suffix"}, "none": {"source": "none"}, "policy": {}}
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    knobs = {name: DecodeKnobs.pin(**p) if p else DecodeKnobs(draft_len=engine.block) for name, p in pins.items()}
    out = run_to_completion(engine, [(name, FIB, params, knobs[name]) for name in pins])
    assert len({tuple(out[name]) for name in pins}) == 1  # greedy: the target's own tokens, whatever the pins
    log = {name: _consistent(out[f"{name}:stats"]) for name in pins}
    for name, p in pins.items():
        assert log[name]["pins"] == p

    d = log["k2"]  # 2 drafts verified on every step, from whichever source the policy (or the knobs) chose
    assert d["draft_len"].get("2", 0) + d["pin_clamps"]["tokens_left"] + d["pin_clamps"]["draft"] == d["steps"]
    assert d["pin_clamps"]["tokens_left"] <= 2 and max(int(k) for k in d["draft_len"]) <= 2
    d = log["diffusion"]  # diffusion drafts only, on every step with 2 or more tokens left
    assert d["verified"].get("suffix", 0) == 0 and sum(d["diffusion_steps"].values()) >= d["steps"] - 1
    d = log["s3"]
    assert set(d["diffusion_steps"]) == {"3"} and d["diffusion_steps"]["3"] >= d["steps"] - 1
    assert d["verified"].get("suffix", 0) == 0
    d = log["suffix"]
    assert d["verified"].get("diffusion", 0) == 0 and d["diffusion_steps"] == {} and d["verified"]["suffix"] > 0
    assert out["none:stats"]["verified"] == 0 and log["none"]["source"] == {"none": log["none"]["steps"]}


def test_bad_pins_name_the_field(demo_server):
    from workers.request import DecodeKnobs, EngineInputError

    url, _ = demo_server
    for decode, param in (({"draft_len": 65}, "decode.draft_len"), ({"source": "copy"}, "decode.source"),
                          ({"steps": -1}, "decode.steps"), ({"rule": "GREEDY"}, "decode.rule")):
        r = httpx.post(url + "/v1/completions", json={"prompt": FIB, "max_tokens": 2, "decode": decode}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (decode, r.text)
    with pytest.raises(EngineInputError, match="pinned"):
        DecodeKnobs(pinned={"quality"})
