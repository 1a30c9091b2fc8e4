"""Derive a CPU-only Serve config from deploy/serve_config.yaml (nodes without GPUs, a try-out cluster).

    python deploy/cpu_config.py --models models/demo --redis-url redis://HEAD:6379/0 > serve_cpu.yaml
    serve deploy serve_cpu.yaml

What it changes (everything else is the shipped file's): the model paths; ``redis_url``; engine
options for CPU workers (``device: cpu``, eager steps unless ``--compile``, a small batch);
``--decoders`` fixed ``Decoder`` replicas (no autoscaling) with no GPU and no reserved CPU, each
taking one unit of ``--decoder-resource`` when given (``ray start --resources
'{"decoder_slot": 1}'`` on a node: at most one replica per slot); the ``Controller`` and one
``Ingress`` pinned to the node that offers ``--head-resource`` when given; the proxies'
``--proxy-location`` and HTTP ``--host`` / ``--port``. tests/test_cluster_ray_start.py deploys
its output onto two ``ray start`` nodes (docs/deployment.md, "Deploying on a Ray cluster").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parent / "serve_config.yaml"


def derive(raw: dict[str, Any], *, models: str, redis_url: str, decoders: int = 2, max_batch: int = 8,
           max_len: int = 512, compile: str = "off", threads: int = 1, decoder_resource: str | None = None,
           head_resource: str | None = None, proxy_location: str = "EveryNode", host: str = "0.0.0.0",
           port: int = 8000, default_max_tokens: int = 64) -> dict[str, Any]:
    """The CPU config (a new dict) from the shipped config `raw`; see the module docstring."""
    cfg = yaml.safe_load(yaml.safe_dump(raw))  # a deep copy
    cfg["proxy_location"] = proxy_location
    cfg["http_options"].update({"host": host, "port": port})
    app = cfg["applications"][0]
    models_dir = Path(models).resolve()
    app["args"].update({"target": str(models_dir / "target"), "drafter": str(models_dir / "drafter"),
                        "redis_url": redis_url, "num_threads": threads, "default_max_tokens": default_max_tokens,
                        "model_name": f"adapt-{models_dir.name}"})
    app["args"]["engine_options"] = {"max_batch": max_batch, "max_len": max_len, "dtype": "auto", "device": "cpu",
                                     "compile": compile}
    pin = {"resources": {head_resource: 0.01}} if head_resource else {}
    for dep in app["deployments"]:
        if dep["name"] == "Decoder":
            dep.pop("autoscaling_config", None)
            dep["num_replicas"] = decoders
            dep["max_ongoing_requests"] = max_batch
            dep["ray_actor_options"] = {"num_gpus": 0, "num_cpus": 0,
                                        **({"resources": {decoder_resource: 1}} if decoder_resource else {})}
            dep["graceful_shutdown_timeout_s"] = 5
        elif dep["name"] == "Controller":
            dep["ray_actor_options"] = {"num_cpus": 0, **pin}
        elif dep["name"] == "Ingress":
            dep["num_replicas"] = 1
            dep["ray_actor_options"] = {"num_cpus": 0, **pin}
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python deploy/cpu_config.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(SHIPPED), help="the config to derive from (default: the shipped one)")
    p.add_argument("--models", required=True, help="directory with target/ and drafter/ (e.g. models/demo)")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--compile", default="off", choices=("auto", "aot", "on", "off"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per Decoder replica")
    p.add_argument("--decoder-resource", default=None, help="custom Ray resource each Decoder replica takes one of")
    p.add_argument("--head-resource", default=None, help="custom Ray resource of the node for Controller and Ingress")
    p.add_argument("--proxy-location", default="EveryNode", choices=("EveryNode", "HeadOnly"))
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--default-max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    raw = yaml.safe_load(Path(args.config).read_text())
    cfg = derive(raw, models=args.models, redis_url=args.redis_url, decoders=args.decoders, max_batch=args.max_batch,
                 max_len=args.max_len, compile=args.compile, threads=args.threads,
                 decoder_resource=args.decoder_resource, head_resource=args.head_resource,
                 proxy_location=args.proxy_location, host=args.host, port=args.port,
                 default_max_tokens=args.default_max_tokens)
    sys.stdout.write(yaml.safe_dump(cfg, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
