"""The Ray Serve application: the shipped config is valid for Serve, and the app serves end to end
(Serve controller + proxy, a Decoder replica without GPU, the Controller and Ingress deployments,
real Redis, real HTTP)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml
from ray import serve

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "serve_config.yaml"
AUTH = {"Authorization": "Bearer sk-serve-1"}


def test_serve_config_is_valid_and_builds_the_app():
    from ray.serve.schema import ServeDeploySchema

    from adapt.serving.deployment import app_builder

    raw = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(raw)
    app_cfg = schema.applications[0]
    assert app_cfg.import_path == "adapt.serving.deployment:app_builder"
    decoder = next(d for d in app_cfg.deployments if d.name == "Decoder")
    get = lambda obj, key: obj[key] if isinstance(obj, dict) else getattr(obj, key)  # noqa: E731
    assert get(decoder.ray_actor_options, "num_gpus") == 1 and get(decoder.autoscaling_config, "max_replicas") >= 2
    args = raw["applications"][0]["args"]
    app = app_builder(args)
    # the graph Serve will deploy (Serve keeps it in private attributes; no public accessor):
    # the Ingress over a Decoder with the config's model and engine options, both on its Redis
    ingress = app._bound_deployment
    decoder = ingress.init_args[0]._bound_deployment
    assert (ingress.name, decoder.name) == ("Ingress", "Decoder") and ingress.init_args[2] == args["redis_url"]
    assert decoder.init_args[:3] == (args["target"], args["drafter"], args["redis_url"])
    assert decoder.init_args[4] == args["engine_options"] and decoder.init_args[4]["max_batch"] == 64
    with pytest.raises(ValueError, match="target: required"):
        app_builder({"redis_url": args["redis_url"]})
    # without a redis_url (`adapt serve`'s default) the Controller hosts the store: the Decoder and
    # the Ingress are handed its handle
    local = app_builder({"target": "/models/t"})._bound_deployment
    local_decoder = local.init_args[0]._bound_deployment
    assert local.init_args[2] is None and local_decoder.init_args[2] is None
    assert local_decoder.init_args[8]._bound_deployment.name == local.init_args[1]._bound_deployment.name == "Controller"


def test_app_builder_takes_adapt_serve_options(tmp_path):
    """What `adapt serve` hands the application: --max-queue beyond what the Decoder replicas run
    (the Ingress's admission; the Decoder's own queue unbounded), and a start policy file checked
    (naming the field) before anything is deployed, then given to the Controller."""
    from adapt import policy_file
    from adapt.serving.deployment import app_builder

    args = {"target": "/models/t", "max_queue": 2, "decoder_options": {"num_replicas": 2, "max_ongoing_requests": 4}}
    ingress = app_builder(args)._bound_deployment
    decoder = ingress.init_args[0]._bound_deployment
    assert ingress.init_args[-2:] == (10, 8)  # admits 2 x 4 running + 2 waiting
    assert decoder._deployment_config.max_queued_requests == -1 and decoder._deployment_config.num_replicas == 2
    assert ingress._deployment_config.max_ongoing_requests > 10
    with pytest.raises(ValueError, match="max_queue: needs a fixed number of Decoder replicas"):
        app_builder({"target": "/models/t", "max_queue": 2})
    good = tmp_path / "policy.json"
    policy_file.save(policy_file.PolicyFile(), good)
    controller = app_builder({"target": "/models/t", "policy_file": str(good)})._bound_deployment.init_args[1]
    assert controller._bound_deployment.init_args[1] == json.loads(good.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(good.read_text().replace('"schema": "adapt-policy"', '"schema": "other"'))
    with pytest.raises(policy_file.PolicyFileError, match="policy.schema"):
        app_builder({"target": "/models/t", "policy_file": str(bad)})


@pytest.fixture(scope="module")
def serve_app(redis_server, tmp_path_factory):
    import ray

    from adapt.serving.deployment import app_builder
    from tests.conftest import free_port
    from tests.tiny_models import make_tiny_pair

    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("serve-models"))
    redis_server.flush()
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = app_builder({"target": str(target), "drafter": str(drafter), "redis_url": redis_server.url,
                       "num_threads": 1, "engine_options": {"max_batch": 4, "max_len": 256},
                       "default_max_tokens": 8, "api_keys": ["sk-serve-1"],
                       "decoder_options": {"ray_actor_options": {"num_gpus": 0, "num_cpus": 0.5}}})
    serve.run(app, name="adapt", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_serve_app_serves_with_sla_headers(serve_app):
    url = serve_app
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=120).status_code == 401
    r = httpx.post(url + "/v1/completions", json={"prompt": "def add(a, b):", "temperature": 0},
                   headers={"X-SLA-TPOT-Ms": "1000", "X-SLA-Quality": "lossless", **AUTH}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] <= 8
    assert body["adapt"]["targets"]["tpot_ms"] == 1000.0 and body["adapt"]["worker"].startswith("decoder-")
    # greedy and lossless (no TVD), one second per token allowed: the tiny model meets it, and the
    # header says what the body says
    assert body["adapt"]["sla"]["quality_met"] is True and body["adapt"]["stats"]["tvd_spent"] == 0.0
    assert body["adapt"]["sla"]["met"] is True and r.headers["x-sla-met"] == "true"
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, headers=AUTH,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop") and "adapt" in events[-1]
    bad = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"X-SLA-Priority": "soon", **AUTH})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-SLA-Priority"
    assert httpx.get(url + "/health", timeout=30).json()["workers"] == 1
