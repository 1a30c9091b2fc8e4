"""What the HTTP front refuses before any decoding: unauthenticated calls, a full queue, huge bodies.

`Guard` is an ASGI middleware in front of the FastAPI app. On every ``/v1`` route it checks, in
this order, and answers in OpenAI's error shape:

1. **401** ``invalid_api_key``: API keys are configured (`adapt.serving.auth.ApiKeys`) and the
   request has no ``Authorization: Bearer KEY`` with one of them (``WWW-Authenticate: Bearer``).
2. **413** ``body_too_large``: a generation route's ``Content-Length`` exceeds
   ``Limits.max_body_bytes`` (checked before the body is read).
3. **429** ``queue_full``, with ``Retry-After``: the ingress already holds ``max_running +
   max_queue`` generation requests (``max_running``: what the workers decode at once, workers ×
   ``max_batch``; ``max_queue``: how many may wait beyond that). Refused before the body is read,
   so a flood costs a header parse per request and memory stays bounded.
4. **413** again while reading a body sent without ``Content-Length`` (chunked) that grows past
   the limit; the body is read whole (at most the limit) before the app sees it.

An admitted request holds its place until its response has been sent in full (a stream until
its last event, or until the client disconnects). The ingress's own counts appear in
``/health`` (``ingress``) and ``/metrics`` (`adapt.serving.metrics.IngressCollector`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from adapt.serving.auth import ApiKeys, unauthorized_body
from adapt.serving.headers import error_body

__all__ = ["Limits", "Admission", "Guard", "GENERATE_PATHS", "DEFAULT_MAX_QUEUE", "DEFAULT_MAX_BODY_BYTES"]

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250k tokens of text, ~140k token ids as JSON


@dataclass(frozen=True)
class Limits:
    """Ingress limits. max_running: generation requests the workers run at once (None = unknown:
    no queue limit); max_queue: requests allowed to wait beyond those; max_body_bytes: largest
    request body; retry_after_s: the ``Retry-After`` of a 429."""

    max_running: int | None = None
    max_queue: int | None = DEFAULT_MAX_QUEUE
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("max_running", "max_queue"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if self.max_running == 0:
            raise ValueError("max_running must be >= 1")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        if not isinstance(self.retry_after_s, int) or self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be a non-negative integer, got {self.retry_after_s!r}")

    @property
    def capacity(self) -> int | None:
        """Generation requests the ingress holds at most (None = unbounded)."""
        if self.max_running is None or self.max_queue is None:
            return None
        return self.max_running + self.max_queue


class Admission:
    """Counts the generation requests this ingress holds and admits up to `Limits.capacity`."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.capacity = limits.capacity
        self.in_flight = 0
        self.peak = 0
        self.admitted = 0
        self.rejected = {"unauthorized": 0, "queue_full": 0, "body_too_large": 0}
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.capacity is not None and self.in_flight >= self.capacity:
                self.rejected["queue_full"] += 1
                return False
            self.in_flight += 1
            self.admitted += 1
            self.peak = max(self.peak, self.in_flight)
            return True

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    @property
    def waiting(self) -> int:
        """Held requests beyond the running capacity (the ingress's view of the queue)."""
        running = self.limits.max_running
        return self.in_flight if running is None else max(0, self.in_flight - running)

    def snapshot(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "waiting": self.waiting, "capacity": self.capacity,
                "max_queue": self.limits.max_queue, "peak": self.peak, "admitted": self.admitted,
                "rejected": dict(self.rejected)}


async def _send_json(send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


def _too_large(limit: int) -> dict[str, Any]:
    return error_body(f"body: request body exceeds {limit} bytes (the server's --max-body-bytes)", "body",
                      "invalid_request_error", "body_too_large")


class Guard:
    """ASGI middleware: authentication, body size and admission in front of ``app`` (see the
    module docstring)."""

    def __init__(self, app, keys: ApiKeys, admission: Admission):
        self.app = app
        self.keys = keys
        self.admission = admission
        self.limit = admission.limits.max_body_bytes

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a prefix (a Serve route_prefix): match the app's own path
            path = path[len(root):] or "/"
        if scope["type"] != "http" or not (path == "/v1" or path.startswith("/v1/")):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.keys:
            raw = headers.get(b"authorization")
            if not self.keys.check(raw.decode("latin-1") if raw is not None else None):
                self.admission.reject("unauthorized")
                return await _send_json(send, 401, unauthorized_body(raw is not None),
                                        [(b"www-authenticate", b"Bearer")])
        if scope.get("method") != "POST" or path not in GENERATE_PATHS:
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.limit:
                self.admission.reject("body_too_large")
                return await _send_json(send, 413, _too_large(self.limit))
        if not self.admission.try_enter():
            limits = self.admission.limits
            body = error_body(f"server busy: {self.admission.in_flight} requests held (running up to "
                              f"{limits.max_running}, queue limit {limits.max_queue}); retry after "
                              f"{limits.retry_after_s} s", None, "rate_limit_error", "queue_full")
            return await _send_json(send, 429, body, [(b"retry-after", str(limits.retry_after_s).encode())])
        try:
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left before sending its body
                part = message.get("body", b"")
                size += len(part)
                if size > self.limit:
                    self.admission.reject("body_too_large")
                    return await _send_json(send, 413, _too_large(self.limit))
                chunks.append(part)
                more = message.get("more_body", False)
            body_bytes = b"".join(chunks)
            sent = False

            async def replay():
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body_bytes, "more_body": False}
                return await receive()  # then the client's disconnect, if it leaves

            await self.app(scope, replay, send)
        finally:
            self.admission.leave()
