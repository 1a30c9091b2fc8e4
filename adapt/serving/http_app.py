"""The OpenAI-compatible HTTP front: FastAPI routes over a decoding backend.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

A *backend* turns one request into a stream of chunks from a decoder worker: the Decoder
deployment's Serve handle (`adapt.serving.deployment.ServeBackend`, what ``adapt serve`` and a
cluster run), or one worker in this process (the in-process tests). Each chunk is a dict ``{"text", "token_ids", "finished",
"finish_reason", "stats", "sla", "usage", "worker"}``, or ``{"error": {...}}``.

Every response carries the request's decoding stats and its SLA verdict in an ``adapt`` object
(the last SSE chunk when streaming) and, for JSON responses, in ``X-Adapt-*`` / ``X-SLA-Met``
headers. Errors follow OpenAI's shape and name the offending field in ``param``. API keys, the
request queue limit (429) and the body size limit (413) are enforced in front of the routes by
`adapt.serving.limits.Guard`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapt.serving.auth import ApiKeys

from adapt.serving.headers import ApiError, _field_path, parse_targets, validation_error
from adapt.serving.limits import Admission, Guard, Limits
from adapt.serving.metrics import MetricsExporter
from adapt.serving.schemas import ChatRequest, CompletionRequest
from adapt.targets import ServerDefaults

__all__ = ["Backend", "build_app"]

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What the HTTP front needs from the decoding side."""

    def stream(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Chunks of one request from the worker chosen for it (raises `ApiError` on failures)."""

    async def loads(self) -> dict[str, dict[str, Any]]:
        """Live workers' load records (with their counters)."""


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _verdict_headers(final: dict[str, Any]) -> dict[str, str]:
    stats, sla = final.get("stats") or {}, final.get("sla") or {}
    headers = {"X-Adapt-Worker": str(final.get("worker", ""))}
    if "tau" in stats:
        headers["X-Adapt-Tau"] = f"{float(stats['tau']):.4f}"
    if "tvd_spent" in stats:
        headers["X-Adapt-TVD-Spent"] = f"{float(stats['tvd_spent']):.6g}"
    if sla:
        headers["X-SLA-Met"] = "true" if sla.get("met") else "false"
    return headers


def build_app(backend: Backend, model_name: str = "adapt-demo",
              defaults: ServerDefaults | None = None, default_max_tokens: int = 64,
              api_keys: ApiKeys | None = None, limits: Limits | None = None) -> FastAPI:
    """The FastAPI app over `backend` (see the module docstring). api_keys: keys every ``/v1``
    route requires (none: open); limits: queue and body limits (default: 1 MiB bodies, no queue
    limit, since the running capacity is unknown here)."""
    defaults = defaults or ServerDefaults()
    app = FastAPI(title="adapt", description="OpenAI-compatible adaptive speculative decoding")
    app.state.backend = backend
    admission = Admission(limits or Limits())
    app.state.admission = admission
    exporter = MetricsExporter(admission)  # this app's own CollectorRegistry
    app.state.metrics = exporter
    app.add_middleware(Guard, keys=api_keys or ApiKeys(), admission=admission)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):  # unknown route, wrong method
        return _error_response(ApiError(str(exc.detail), status=exc.status_code,
                                        code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        param = ".".join(_field_path(err.get("loc", ()))) or None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        return _error_response(ApiError(f"{param}: {msg}" if param else msg, param=param))

    async def _parse(request: Request, model: type[CompletionRequest] | type[ChatRequest]):
        raw = await request.body()
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"body: not valid JSON ({exc})", param="body") from None
        if not isinstance(body, dict):
            raise ApiError("body: expected a JSON object", param="body")
        try:
            parsed = model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if parsed.model is not None and parsed.model != model_name:
            raise ApiError(f"model: unknown model {parsed.model!r} (serving {model_name!r})",
                           param="model", status=404, code="model_not_found")
        targets, explicit = parse_targets(request.headers, parsed.sla, defaults)
        return parsed, targets, explicit

    def _worker_request(parsed, targets, explicit, kind: str) -> dict[str, Any]:
        req: dict[str, Any] = {
            "request_id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "sampling": parsed.sampling(default_max_tokens),
            "stop": parsed.stop_list(),
            "targets": targets.model_dump(mode="json"),
            "explicit_targets": explicit,
            "decode": parsed.decode.model_dump(exclude_none=True) if parsed.decode else {},
            "arrival": time.time(),
        }
        if kind == "chat":
            req["messages"] = [m.model_dump(exclude_none=True) for m in parsed.messages]
        elif isinstance(parsed.prompt, list):
            req["prompt_token_ids"] = list(parsed.prompt)
        else:
            req["prompt"] = parsed.prompt
        return req

    async def _serve(request: Request, kind: str):
        parsed, targets, explicit = await _parse(request, ChatRequest if kind == "chat" else CompletionRequest)
        req = _worker_request(parsed, targets, explicit, kind)
        rid, created = req["request_id"], int(time.time())
        chunks = backend.stream(req)
        try:
            first = await _next(chunks)  # errors before any output become a JSON error response
        except ApiError as err:
            await chunks.aclose()
            if kind == "chat" and err.param == "prompt":  # the prompt built from the messages
                err.param = "messages"
            raise
        except BaseException:
            await chunks.aclose()
            raise
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            return StreamingResponse(_sse_events(kind, rid, created, first, chunks, include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid,
                                              "X-Adapt-Worker": str(first.get("worker", ""))})
        text, final = first.get("text", ""), first
        try:
            async for chunk in _checked(chunks):
                text += chunk.get("text", "")
                final = chunk
        finally:
            await chunks.aclose()
        body = _final_body(kind, rid, created, text, final)
        return JSONResponse(body, headers={**_verdict_headers(final), "X-Request-Id": rid})

    async def _next(chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            raise ApiError("worker ended the request without output", status=502, type_="server_error") from None
        _raise_if_error(chunk)
        return chunk

    async def _checked(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in chunks:
            _raise_if_error(chunk)
            yield chunk

    def _choice(kind: str, text: str, finish_reason: str | None, delta: bool, first: bool = False) -> dict:
        if kind == "chat":
            if delta:
                d: dict[str, Any] = {"content": text}
                if first:
                    d["role"] = "assistant"
                return {"index": 0, "delta": d, "finish_reason": finish_reason, "logprobs": None}
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "finish_reason": finish_reason, "logprobs": None}
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}

    def _final_body(kind: str, rid: str, created: int, text: str, final: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model_name,
            "choices": [_choice(kind, text, final.get("finish_reason"), delta=False)],
            "usage": final.get("usage"),
            "adapt": _adapt_object(final),
        }

    async def _sse_events(kind, rid, created, first, chunks, include_usage) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        is_first = True
        try:
            chunk = first
            while True:
                finished = bool(chunk.get("finished"))
                event = {"id": rid, "object": obj, "created": created, "model": model_name,
                         "choices": [_choice(kind, chunk.get("text", ""),
                                             chunk.get("finish_reason") if finished else None, True, is_first)]}
                if finished:
                    event["adapt"] = _adapt_object(chunk)
                    if include_usage:
                        event["usage"] = chunk.get("usage")
                is_first = False
                yield _sse(event)
                if finished:
                    break
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    raise ApiError("worker ended the stream before the request finished", status=502,
                                   type_="server_error") from None
                _raise_if_error(chunk)
        except ApiError as err:
            yield _sse(err.body())
        except Exception as exc:  # noqa: BLE001 - a worker died mid-stream: end this stream with an error
            log.warning("stream %s failed: %s", rid, exc)
            yield _sse({"error": {"message": f"stream failed: {exc}", "type": "server_error", "param": None,
                                  "code": "worker_failed"}})
        finally:
            await chunks.aclose()
        yield _sse("[DONE]")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "adapt"}]}

    @app.get("/health")
    async def health():
        try:
            loads = await backend.loads()
        except Exception as exc:  # noqa: BLE001
            return JSONResponse({"status": "error", "error": str(exc)}, status_code=503)
        ok = len(loads) > 0
        dtypes = {v["dtype"]: v.get("dtype_reason") for v in loads.values() if v.get("dtype")}
        return JSONResponse({"status": "ok" if ok else "no_workers", "workers": len(loads), "dtypes": dtypes,
                             "waiting": sum(int(v.get("waiting", 0)) for v in loads.values()),
                             "running": sum(int(v.get("running", 0)) for v in loads.values()),
                             "ingress": admission.snapshot()},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        body, content_type = exporter.render(await backend.loads(), request.headers.get("accept"))
        return Response(body, media_type=content_type)

    return app


def _adapt_object(final: dict[str, Any]) -> dict[str, Any]:
    """The request's decoding stats, targets and SLA verdict, as returned to the client."""
    return {"worker": final.get("worker"), "policy_version": final.get("policy_version"),
            "stats": final.get("stats"), "targets": final.get("targets"), "sla": final.get("sla")}


def _raise_if_error(chunk: dict[str, Any]) -> None:
    err = chunk.get("error")
    if err:
        raise ApiError(str(err.get("message", "error")), param=err.get("param"),
                       status=int(err.get("status", 500)),
                       type_=err.get("type") or ("invalid_request_error" if int(err.get("status", 500)) < 500
                                                 else "server_error"),
                       code=err.get("code"))
