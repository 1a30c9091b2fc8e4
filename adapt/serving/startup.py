"""Start-up of the serving application on a loaded machine: Serve's timeouts, progress, one-line errors.

*Readiness check*: Serve's controller asks each HTTP proxy actor it starts whether it is ready and
kills it when the answer takes longer than ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`` (Serve: 5 s,
then 10 s, 15 s as it restarts it). *Health check*: once up, the controller asks every proxy
every ``RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S`` and every replica every ``health_check_period_s``
whether it is alive, and replaces one that misses ``..._TIMEOUT_S`` three times in a row.

On a 2-core machine whose cores another process keeps busy, a proxy process needs more than 5 s
to import Serve and bind its port: Serve killed it three times and ``adapt serve`` ended in
``ActorDiedError`` after 66 s. `SERVE_CONTROLLER_ENV` holds the values such a machine
needs; they reach Serve's controller as its ``runtime_env`` (``controller_options``, where Serve
reads them: ray/serve/_private/constants.py), and an operator's own environment variable of the
same name wins. ``deploy/serve_config.yaml`` sets the same under ``controller_options``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

__all__ = ["SERVE_CONTROLLER_ENV", "serve_controller_env", "StartupError", "Progress", "one_line_cause"]

# Serve's controller settings (its defaults in the comments); an environment variable of the same
# name in `adapt serve`'s environment overrides each.
SERVE_CONTROLLER_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",   # Serve: 5; a loaded 2-core machine needs > 5 s
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",  # Serve: 10
    "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "10",   # Serve: 10
}


def serve_controller_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`SERVE_CONTROLLER_ENV` with the values `environ` (default: this process's) sets instead."""
    environ = os.environ if environ is None else environ
    return {name: str(environ.get(name, default)) for name, default in SERVE_CONTROLLER_ENV.items()}


class StartupError(RuntimeError):
    """Start-up failed for a known cause; its message is one line: the cause, then ``; fix: ...``."""


def one_line_cause(exc: BaseException) -> str:
    """A one-line description of `exc`: its type and the last non-empty line of its message (Ray's
    errors carry whole tracebacks in theirs)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else '(no message)'}"[:400]


class Progress:
    """Start-up progress, a line per stage (``adapt serve: ... (12.3 s)``) on `stream`; `say`
    repeats nothing it said last."""

    def __init__(self, prefix: str = "adapt serve", stream=None, clock: Callable[[], float] = time.monotonic):
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.clock = clock
        self.t0 = clock()
        self._last = None

    def __call__(self, message: str) -> None:
        if message == self._last:
            return
        self._last = message
        print(f"{self.prefix}: {message} ({self.clock() - self.t0:.1f} s)", file=self.stream, flush=True)
