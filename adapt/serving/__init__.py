"""Serving: OpenAI-compatible HTTP on Ray, decoder workers, a central controller, shared state.

Modules (each imports Ray, Redis or FastAPI only where it is used, so `import adapt.serving` is light):

- `store`: the `StateStore` interface (worker load + heartbeats, versioned policies with change
  notification, a capped trace stream) and its in-process implementation.
- `redis_store`: the same interface on Redis (expiring keys, pub/sub, Redis Streams).
- `trace_sink`: a background `TraceSink` that feeds the trace stream and the worker's counters.
- `headers`: SLA headers and body fields -> `adapt.targets.RequestTargets`, with 4xx errors.
- `http_app`: the FastAPI app (OpenAI routes, SSE streaming, /health, /metrics).
- `metrics`: Prometheus exposition of the workers' counters.
- `router`: least-loaded choice of a decoder worker.
- `controller_actor`: the central controller (a Ray actor).
- `deployment`: Ray Serve deployments for `serve run` / `serve deploy`.
- `launcher`: starts Ray, the controller, the workers and the HTTP server (`adapt serve`).
"""
