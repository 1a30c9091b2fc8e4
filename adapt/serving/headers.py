"""SLA headers and body fields -> `adapt.targets.RequestTargets`, and the API's error type.

A request states its service-level targets (SLA) in HTTP headers or in an ``sla`` body object;
a header wins over the body field it duplicates, and the server defaults fill the rest:

| header | body field (``"sla": {...}``) | meaning |
|---|---|---|
| ``X-SLA-TPOT-Ms: 40`` | ``tpot_ms`` | ceiling on mean time per output token (ms) |
| ``X-SLA-Tokens-Per-S: 25`` | ``tokens_per_s`` | floor on decode speed (TPOT = 1000 / it) |
| ``X-SLA-TTFT-Ms: 500`` | ``ttft_ms`` | ceiling on time to first token (ms) |
| ``X-SLA-Quality: lossless`` / ``tvd=0.05`` | ``quality`` | exact output, or per-token TVD budget |
| ``X-SLA-TVD-Budget: 0.5`` | ``tvd_budget_total`` | total TVD budget of the request |
| ``X-SLA-Priority: 5`` (or ``high``/``normal``/``low``) | ``priority`` | -100..100, higher first |

Invalid values raise `ApiError` (HTTP 400) whose ``param`` names the header or body field.
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import ValidationError

from adapt.targets import RequestTargets, ServerDefaults

__all__ = ["ApiError", "SLA_HEADERS", "parse_targets", "error_body", "validation_error"]

# RequestTargets field -> header name (as documented; matched case-insensitively)
SLA_HEADERS = {
    "tpot_ms": "X-SLA-TPOT-Ms",
    "tokens_per_s": "X-SLA-Tokens-Per-S",
    "ttft_ms": "X-SLA-TTFT-Ms",
    "quality": "X-SLA-Quality",
    "tvd_budget_total": "X-SLA-TVD-Budget",
    "priority": "X-SLA-Priority",
}
PRIORITY_NAMES = {"high": 10, "normal": 0, "low": -10}
_NUMERIC = ("tpot_ms", "tokens_per_s", "ttft_ms", "tvd_budget_total")


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers  # extra response headers (e.g. Retry-After of a 429)
        self.message = message
        self.param = param
        self.status = status
        self.type = type_
        self.code = code or ("invalid_value" if status == 400 else None)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.param, self.type, self.code)


def error_body(message: str, param: str | None, type_: str, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(exc: ValidationError, prefix: str = "") -> ApiError:
    """The first pydantic error as an `ApiError` naming the (dotted) field."""
    err = exc.errors()[0]
    loc = ".".join(_field_path(err.get("loc", ())))
    param = f"{prefix}{loc}" if loc else (prefix.rstrip(".") or None)
    message = str(err.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if err.get("type") == "extra_forbidden":
        message = "unknown field"
    return ApiError(f"{param}: {message}" if param and not message.startswith(param) else message, param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _field_path(loc) -> list[str]:
    """A pydantic error location without its union-member tags (``prompt.str`` -> ``prompt``)."""
    out: list[str] = []
    for part in loc:
        text = str(part)
        if text in ("__root__", "body") and not out:
            continue
        if "[" in text or text.lower() in _TYPE_TAGS:
            break
        out.append(text)
    return out


def _header_value(field: str, raw: str) -> object:
    """Header text -> the value RequestTargets expects (numbers parsed here to name the header)."""
    text = raw.strip()
    header = SLA_HEADERS[field]
    if field == "priority":
        if text.lower() in PRIORITY_NAMES:
            return PRIORITY_NAMES[text.lower()]
        try:
            return int(text)
        except ValueError:
            raise ApiError(f"{header}: expected an integer in -100..100 or high/normal/low, got {raw!r}",
                           param=header) from None
    if field in _NUMERIC:
        try:
            return float(text)
        except ValueError:
            raise ApiError(f"{header}: expected a number, got {raw!r}", param=header) from None
    return text


def parse_targets(headers: Mapping[str, str], body_sla: Mapping[str, Any] | None,
                  defaults: ServerDefaults | None = None) -> tuple[RequestTargets, bool]:
    """Merge SLA headers over the body's ``sla`` object, validate, fill server defaults.

    Returns ``(targets, explicit)`` where `explicit` says whether the request set any target.
    Raises `ApiError` (400) naming the header (e.g. ``X-SLA-TPOT-Ms``) or body field
    (e.g. ``sla.quality``).
    """
    lower = {k.lower(): v for k, v in headers.items()}
    values: dict[str, object] = {}
    source: dict[str, str] = {}
    if body_sla is not None:
        if not isinstance(body_sla, Mapping):
            raise ApiError("sla: expected an object", param="sla")
        for key, value in body_sla.items():
            if key not in SLA_HEADERS:
                raise ApiError(f"sla.{key}: unknown SLA field (known: {', '.join(SLA_HEADERS)})",
                               param=f"sla.{key}")
            if key == "priority" and isinstance(value, str) and value.lower() in PRIORITY_NAMES:
                value = PRIORITY_NAMES[value.lower()]
            values[key] = value
            source[key] = f"sla.{key}"
    for field, header in SLA_HEADERS.items():
        raw = lower.get(header.lower())
        if raw is not None:
            values[field] = _header_value(field, raw)
            source[field] = header
    try:
        targets = RequestTargets.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        field = loc[0] if loc else message.split(":", 1)[0].split(".", 1)[0].strip()
        param = source.get(field, field or None)
        text = message.split(":", 1)[1].strip() if message.startswith(field + ":") or \
            message.startswith(f"{field}.") else message
        raise ApiError(f"{param}: {text}", param=param) from None
    explicit = bool(values)
    if defaults is not None:
        targets = targets.with_defaults(defaults)
    return targets, explicit
