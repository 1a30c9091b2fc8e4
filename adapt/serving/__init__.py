"""Serving: OpenAI-compatible HTTP on Ray, decoder workers, a central controller, shared state.

Modules (each imports Ray, Redis or FastAPI only where it is used, so `import adapt.serving` is light):

- `store`: the `StateStore` interface (worker load + heartbeats, versioned policies with change
  notification, a capped trace stream) and its in-process implementation.
- `redis_store`: the same interface on Redis (expiring keys, pub/sub, Redis Streams).
- `trace_sink`: a background `TraceSink` that feeds the trace stream and the worker's counters.
- `headers`: SLA headers and body fields -> `adapt.targets.RequestTargets`, with 4xx errors.
- `schemas`: OpenAI request bodies (pydantic).
- `http_app`: the FastAPI app (OpenAI routes, SSE streaming, /health, /metrics).
- `metrics`: the workers' counters and their Prometheus exposition.
- `worker_plugin`: what serving adds to a decoder worker (`workers.ray_worker`): heartbeats,
  policy hot reload, traces, SLA verdicts.
- `controller_actor`: the central controller and the store client over its Serve handle.
- `deployment`: the serving application, Ray Serve deployments (Decoder, Controller, Ingress) built
  by `app_builder`, for `adapt serve` and for `serve run` / `serve deploy` (deploy/serve_config.yaml).
- `launcher`: runs that application on local (or joined) Ray (`adapt serve`); `HttpServer` (uvicorn
  on a thread, for in-process tests).
- `policy_commands`: `adapt policy push|status` and `adapt policy fit --from-redis`.
"""
