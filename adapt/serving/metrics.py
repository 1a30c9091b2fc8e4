"""Decoder counters and their Prometheus exposition.

Each worker keeps a `WorkerCounters`: cumulative numbers fed from its trace records (one per row
per engine step, contracts §6), its step loop and its finished requests. The snapshot travels
with the worker's heartbeat into the state store, and ``GET /metrics`` renders every live
worker's snapshot with a ``worker`` label, so the numbers are the same whichever process serves
the HTTP request (and a Ray Serve deployment needs no extra plumbing).

Words: a *draft* is one row's drafted block in one step (diffusion steps ``s > 0``); *draft
tokens* are the tokens sent to verification (``draft_len``); τ (tokens per target pass) is
``emitted / passes`` where a row emits ``accepted + 1`` tokens per step.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

__all__ = ["WorkerCounters", "STEP_BUCKETS_MS", "render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEP_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
RULE_NAMES = {0: "greedy", 1: "rejection", 2: "match", 3: "eps_tvd", 4: "lambda", 5: "sglang", 6: "typical"}


def _bump(table: dict[str, float], key: object, by: float = 1.0) -> None:
    k = str(key)
    table[k] = table.get(k, 0.0) + by


class WorkerCounters:
    """Cumulative counters of one decoder worker (thread-safe; `snapshot()` is JSON)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, Any] = {
            "passes": 0, "emitted_tokens": 0, "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
            "tvd_spent": 0.0, "accepted_per_position": [], "verified_per_position": [],
            "decisions": {"steps": {}, "draft_len": {}, "rule": {}},
            "steps": 0, "step_ms_sum": 0.0, "step_ms_buckets": [0] * (len(STEP_BUCKETS_MS) + 1),
            "requests": {}, "sla": {"total": 0, "met": 0, "latency_total": 0, "latency_met": 0,
                                    "quality_total": 0, "quality_met": 0},
            "trace_records_dropped": 0,
        }

    def observe_traces(self, records: Iterable[dict[str, Any]]) -> None:
        """Fold trace records (contracts §6) into the counters."""
        with self._lock:
            c = self._c
            for r in records:
                accepted = int(r.get("accepted", 0))
                draft_len = int(r.get("draft_len", 0))
                c["passes"] += 1
                c["emitted_tokens"] += accepted + 1
                if int(r.get("steps", 0)) > 0:
                    c["drafts"] += 1
                c["draft_tokens"] += draft_len
                c["accepted_tokens"] += accepted
                c["tvd_spent"] += float(r.get("tvd_spent", 0.0))
                acc, ver = c["accepted_per_position"], c["verified_per_position"]
                if len(ver) < draft_len:
                    acc.extend([0] * (draft_len - len(acc)))
                    ver.extend([0] * (draft_len - len(ver)))
                for i, flag in enumerate(r.get("accept_flags", [])[:draft_len]):
                    acc[i] += int(flag)
                for i in range(draft_len):
                    ver[i] += 1
                d = c["decisions"]
                _bump(d["steps"], r.get("steps", 0))
                _bump(d["draft_len"], draft_len)
                _bump(d["rule"], RULE_NAMES.get(int(r.get("rule", -1)), str(r.get("rule"))))

    def observe_step(self, step_ms: float) -> None:
        """One engine step of the worker took `step_ms` milliseconds."""
        with self._lock:
            c = self._c
            c["steps"] += 1
            c["step_ms_sum"] += float(step_ms)
            i = next((j for j, b in enumerate(STEP_BUCKETS_MS) if step_ms <= b), len(STEP_BUCKETS_MS))
            c["step_ms_buckets"][i] += 1

    def observe_request(self, finish_reason: str, sla: dict[str, Any] | None) -> None:
        """A request finished (`finish_reason`), with its SLA verdict (`None` when it had no targets)."""
        with self._lock:
            _bump(self._c["requests"], finish_reason or "unknown")
            if sla is None:
                return
            s = self._c["sla"]
            s["total"] += 1
            s["met"] += int(bool(sla.get("met")))
            if sla.get("latency_met") is not None:
                s["latency_total"] += 1
                s["latency_met"] += int(bool(sla["latency_met"]))
            if sla.get("quality_met") is not None:
                s["quality_total"] += 1
                s["quality_met"] += int(bool(sla["quality_met"]))

    def dropped(self, n: int) -> None:
        with self._lock:
            self._c["trace_records_dropped"] += int(n)

    def snapshot(self) -> dict[str, Any]:
        import json

        with self._lock:
            return json.loads(json.dumps(self._c))


def _series(lines: list[str], name: str, kind: str, help_text: str,
            samples: Iterable[tuple[dict[str, str], float]], suffix: str = "") -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
        lines.append(f"{name}{suffix}{{{label_text}}} {float(value):.10g}")


def _esc(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(loads: dict[str, dict[str, Any]], extra: dict[str, float] | None = None) -> str:
    """Prometheus text exposition of every live worker's load record (``counters`` inside).

    `extra`: server-level gauges (name -> value), e.g. ``adapt_workers_live``.
    """
    lines: list[str] = []
    ws = sorted(loads.items())
    cs = [(w, load.get("counters") or {}) for w, load in ws]

    def simple(name: str, kind: str, help_text: str, key: str) -> None:
        _series(lines, name, kind, help_text, [({"worker": w}, c.get(key, 0)) for w, c in cs])

    simple("adapt_drafts_total", "counter", "Drafted blocks (rows with diffusion steps > 0).", "drafts")
    simple("adapt_draft_tokens_total", "counter", "Draft tokens sent to verification.", "draft_tokens")
    simple("adapt_accepted_tokens_total", "counter", "Draft tokens accepted.", "accepted_tokens")
    simple("adapt_emitted_tokens_total", "counter", "Tokens emitted (accepted + 1 per row per step).", "emitted_tokens")
    simple("adapt_target_passes_total", "counter", "Row-steps verified by the target (τ denominator).", "passes")
    simple("adapt_tvd_spent_total", "counter", "Total-variation distance spent by lossy rules.", "tvd_spent")
    simple("adapt_trace_records_dropped_total", "counter", "Trace records not delivered to the store.",
           "trace_records_dropped")
    _series(lines, "adapt_tau", "gauge", "Tokens per target pass since start (accepted + 1 averaged).",
            [({"worker": w}, c.get("emitted_tokens", 0) / c["passes"] if c.get("passes") else 0.0) for w, c in cs])
    _series(lines, "adapt_accepted_per_position_total", "counter",
            "Accepted draft tokens at each draft position (0 = first).",
            [({"worker": w, "position": str(i)}, v) for w, c in cs
             for i, v in enumerate(c.get("accepted_per_position", []))])
    _series(lines, "adapt_verified_per_position_total", "counter",
            "Draft tokens verified at each draft position (0 = first).",
            [({"worker": w, "position": str(i)}, v) for w, c in cs
             for i, v in enumerate(c.get("verified_per_position", []))])
    _series(lines, "adapt_decisions_total", "counter",
            "Per-row decisions by lever (steps, draft_len, rule) and chosen value.",
            [({"worker": w, "lever": lever, "value": value}, n) for w, c in cs
             for lever, table in sorted((c.get("decisions") or {}).items()) for value, n in sorted(table.items())])
    _series(lines, "adapt_requests_finished_total", "counter", "Finished requests by finish reason.",
            [({"worker": w, "reason": r}, n) for w, c in cs for r, n in sorted((c.get("requests") or {}).items())])
    sla_rows = []
    for w, c in cs:
        s = c.get("sla") or {}
        for kind, total_key, met_key in (("all", "total", "met"), ("latency", "latency_total", "latency_met"),
                                         ("quality", "quality_total", "quality_met")):
            sla_rows.append(({"worker": w, "target": kind, "outcome": "total"}, s.get(total_key, 0)))
            sla_rows.append(({"worker": w, "target": kind, "outcome": "met"}, s.get(met_key, 0)))
    _series(lines, "adapt_sla_requests_total", "counter", "Requests with targets, and those whose SLA was met.", sla_rows)
    _series(lines, "adapt_sla_attainment", "gauge", "Fraction of requests with targets that met them.",
            [({"worker": w}, (c.get("sla") or {}).get("met", 0) / max(1, (c.get("sla") or {}).get("total", 0)))
             for w, c in cs])
    _series(lines, "adapt_queue_depth", "gauge", "Requests waiting for a batch slot.",
            [({"worker": w}, load.get("waiting", 0)) for w, load in ws])
    _series(lines, "adapt_running_requests", "gauge", "Requests in the running batch.",
            [({"worker": w}, load.get("running", 0)) for w, load in ws])
    # step time histogram (ms)
    lines.append("# HELP adapt_step_time_ms Engine step wall time in milliseconds.")
    lines.append("# TYPE adapt_step_time_ms histogram")
    for w, c in cs:
        buckets = c.get("step_ms_buckets") or [0] * (len(STEP_BUCKETS_MS) + 1)
        running = 0
        for bound, n in zip([*(str(float(b)) for b in STEP_BUCKETS_MS), "+Inf"], buckets):
            running += n
            lines.append(f'adapt_step_time_ms_bucket{{worker="{_esc(w)}",le="{bound}"}} {running}')
        lines.append(f'adapt_step_time_ms_sum{{worker="{_esc(w)}"}} {float(c.get("step_ms_sum", 0.0)):.10g}')
        lines.append(f'adapt_step_time_ms_count{{worker="{_esc(w)}"}} {int(c.get("steps", 0))}')
    for name, value in sorted((extra or {}).items()):
        lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name} {float(value):.10g}")
    return "\n".join(lines) + "\n"
