"""`adapt serve`: the OpenAI-compatible server, the serving application on Ray Serve.

It runs the same application a cluster runs from `deploy/serve_config.yaml`
(`adapt.serving.deployment.app_builder`: Decoder replicas, a Controller, the Ingress behind
Serve's HTTP proxy). Defaults run everything on this machine: a local Ray, the `smollm2` pair
(SmolLM2-135M-Instruct, pulled into the cache on first use; `--pair demo` for the pair in
`models/demo/`), one decoder worker, and an in-process state store (hosted by the controller)
unless `--redis-url` is given. `--ray-address auto` runs it on an existing Ray cluster
(docs/serving.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from adapt.serving.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
from adapt.commands import add_pair_arguments
from workers.admission import ADMISSION_MODES
from workers.request import COMPILE_CHOICES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API (Ray Serve: decoder workers + controller)")
    add_pair_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-workers", type=int, default=1, help="decoder workers (Decoder replicas)")
    p.add_argument("--redis-url", default=None, help="Redis for load, policies and traces (default: in-process)")
    p.add_argument("--ray-address", default=None, help="join a running Ray cluster (e.g. 'auto')")
    p.add_argument("--policy", default="adaptive",
                   help="policy from the registry (default: adaptive; 'engine' = each request's own knobs)")
    p.add_argument("--policy-file", default=None,
                   help="policy JSON to publish at start (adapt.policy_file; default with the pair's own models: "
                        "the pair's policy file, e.g. models/demo/policy.json, fitted on its traces; 'none' = no file)")
    p.add_argument("--threads-per-worker", type=int, default=None, help="torch threads per worker (cores/workers)")
    p.add_argument("--worker-cpus", type=float, default=1.0, help="Ray CPUs reserved per worker")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = on a CPU, the faster of bfloat16 and float32 for this machine's decode steps, as "
                        "`adapt generate` measures it (once per machine and model, kept in the cache directory: "
                        "adapt/dtype_choice.py); each worker loads it and /health reports it; on a GPU bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", default="auto", choices=COMPILE_CHOICES,
                   help="compiled decode steps: auto = the package `adapt compile` built for this model and "
                        "--max-batch (workers/aot.py; loaded in a second), else eager, so workers serve within "
                        "seconds; aot = the package, built at start when missing (minutes); on = torch.compile at "
                        "start in every worker (minutes: docs/serving.md, 'Start-up'); off = eager")
    p.add_argument("--admission", default="all", choices=ADMISSION_MODES,
                   help="which waiting requests a worker prefills (workers/admission.py): all = every one there is "
                        "a slot for; sla = defer one while its prefill would push a running request off its TPOT "
                        "target, for at most --admission-max-wait-ms or its own TTFT target")
    p.add_argument("--admission-max-wait-ms", type=float, default=1000.0)
    p.add_argument("--default-max-tokens", type=int, default=64)
    p.add_argument("--default-tpot-ms", type=float, default=None, help="TPOT target of requests that set none")
    p.add_argument("--default-quality", default="lossless", help="'lossless' or 'tvd=E' for requests that set none")
    p.add_argument("--model-name", default=None, help="the model id the API reports (default: adapt-PAIR)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 route (repeatable; also "
                        "ADAPT_API_KEY, comma-separated, which keeps keys out of the process list)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="generation requests allowed to wait beyond workers x max-batch running ones; "
                        f"more are answered 429 with Retry-After (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body; larger ones are answered 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--start-timeout-s", type=float, default=600.0,
                   help="how long the replicas may take to come up before the start fails (default 600; Serve's "
                        "proxy readiness timeout is RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S: docs/serving.md, 'Start-up')")
    p.set_defaults(run=run)


def default_policy(policy: str | None, policy_file: str | None, shipped: Path | None,
                   drafter: Path | None = Path("drafter")) -> tuple[str | None, str | None]:
    """(policy name, policy file) to start with: 'engine' means none (each request's own knobs),
    and so does an engine without a drafter (a policy has nothing to choose); without a file, the
    pair's shipped policy file (`shipped`, None when the models are not the pair's own)."""
    name = None if policy in (None, "", "engine") or drafter is None else policy
    if policy_file == "none":
        return name, None
    if policy_file is None and name is not None and shipped is not None and Path(shipped).is_file():
        return name, str(shipped)
    return name, policy_file


def run(args) -> int:
    import logging
    import time

    from adapt.serving.launcher import start_stack
    from adapt.serving.startup import Progress, StartupError, one_line_cause
    from adapt.targets import ServerDefaults

    from workers.pairs import resolve_models
    from workers.pull import PullError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        target, drafter, shipped = resolve_models(args.pair, args.target, args.drafter, args.cache_dir)
    except PullError as exc:  # one line, exit status 2, as `adapt pull`
        print(f"adapt serve: error: {exc}", file=sys.stderr)
        return 2
    for path, what in ((target, "--target"), (drafter, "--drafter")):
        if path and not os.path.isdir(path):
            raise SystemExit(f"{what}: no such model directory: {path}")
    model_name = args.model_name or f"adapt-{args.pair}"
    if args.num_workers < 1:
        raise SystemExit("--num-workers: must be >= 1")
    if not args.admission_max_wait_ms >= 0:
        raise SystemExit("--admission-max-wait-ms: must be >= 0")
    if args.max_queue < 0:
        raise SystemExit("--max-queue: must be >= 0")
    if args.max_body_bytes < 1:
        raise SystemExit("--max-body-bytes: must be >= 1")
    if not args.start_timeout_s > 0:
        raise SystemExit("--start-timeout-s: must be > 0")
    from adapt.serving.auth import ApiKeys

    api_keys = ApiKeys.from_sources(args.api_key)
    defaults = ServerDefaults(tpot_ms=args.default_tpot_ms, quality=args.default_quality)
    policy, policy_file = default_policy(args.policy, args.policy_file, shipped, drafter)
    # SIGINT too (a shell that starts `adapt serve &` has it ignored), and from here on, so that a stop
    # during start-up stops what had started
    _stop_on_signals()
    try:
        stack = _start(start_stack, target, drafter, args, policy, policy_file, model_name, defaults, api_keys,
                       Progress("adapt serve"))
    except StartupError as exc:  # one line, the cause and the fix; Serve and Ray already stopped
        print(f"adapt serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # start_stack stopped what it had started
        print("adapt serve: stopped during start-up", file=sys.stderr, flush=True)
        return 130
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - an unforeseen cause: still one line, the logs for the rest
        print(f"adapt serve: error: start-up failed ({one_line_cause(exc)}); fix: see the error it names (Ray's logs "
              "are under /tmp/ray/session_latest/logs)", file=sys.stderr, flush=True)
        return 1
    url = stack.url
    store = args.redis_url or "in-process (controller)"
    auth = f"{len(api_keys)} API key(s) required" if api_keys else "no API key required"
    print(f"adapt serving {model_name} on {url}/v1  ({args.num_workers} worker(s), state store: {store}, "
          f"{auth}, queue limit {args.max_queue})", flush=True)
    try:
        while True:  # serving happens in Serve's proxy and replicas
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stack.shutdown()
    return 0


def _start(start_stack, target, drafter, args, policy, policy_file, model_name, defaults, api_keys, progress):
    """`start_stack` with the command line's options."""
    return start_stack(
        str(target), None if drafter is None else str(drafter), num_workers=args.num_workers,
        redis_url=args.redis_url, policy=policy, policy_file=policy_file, model_name=model_name, defaults=defaults,
        engine_options={"max_batch": args.max_batch, "max_len": args.max_len, "dtype": args.dtype,
                        "device": args.device, "compile": args.compile, "admission": args.admission,
                        "admission_max_wait_ms": args.admission_max_wait_ms},
        ray_address=args.ray_address, worker_cpus=args.worker_cpus, num_threads=args.threads_per_worker,
        default_max_tokens=args.default_max_tokens, api_keys=api_keys, max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes, host=args.host, port=args.port, progress=progress,
        start_timeout_s=args.start_timeout_s, on_ray_started=_stop_on_signals,
    )


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM stop as Ctrl-C does: Serve and Ray are shut down."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
