"""API keys: ``Authorization: Bearer KEY`` on every ``/v1`` route.

`ApiKeys` holds the keys a server accepts (``adapt serve --api-key KEY``, repeatable, and/or the
``ADAPT_API_KEY`` environment variable, several keys separated by commas). A presented key is
checked against *every* stored key by comparing SHA-256 digests with `hmac.compare_digest`, so
the time taken depends neither on how much of a key matched nor on which key it was. Keys are
never logged and never repeated in an error; `ApiKeys` prints as the number of keys it holds.

``/health`` stays open (load balancers probe it), and so does ``/metrics`` (Prometheus scrapers;
it shows counters, never request contents).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Iterable, Mapping

from adapt.serving.headers import error_body

__all__ = ["ApiKeys", "ENV_VAR", "unauthorized_body"]

ENV_VAR = "ADAPT_API_KEY"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The accepted keys (only their digests are kept); empty = no authentication."""

    def __init__(self, keys: Iterable[str] = ()):
        cleaned = [k.strip() for k in keys if k and k.strip()]
        self._digests = tuple(dict.fromkeys(_digest(k) for k in cleaned))

    @classmethod
    def from_sources(cls, cli_keys: Iterable[str] | None = None,
                     env: Mapping[str, str] | None = None) -> "ApiKeys":
        """Keys from ``--api-key`` values plus ``ADAPT_API_KEY`` (comma-separated) in `env`."""
        env = os.environ if env is None else env
        keys = list(cli_keys or [])
        keys += [k for k in env.get(ENV_VAR, "").split(",") if k.strip()]
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} key{'s' if len(self) != 1 else ''})"

    def check(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value carries an accepted key (always True when
        no key is configured)."""
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        presented = _digest(token.strip())
        ok = False
        for stored in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(presented, stored)
        return ok and scheme.lower() == "bearer"


def unauthorized_body(has_header: bool) -> dict:
    """The 401 body in OpenAI's error shape (the key presented, if any, is not repeated)."""
    message = ("invalid API key" if has_header else
               "missing API key: send 'Authorization: Bearer KEY'")
    return error_body(message, None, "invalid_request_error", "invalid_api_key")
