"""Decoder counters and their Prometheus exposition.

Each worker keeps a `WorkerCounters`: cumulative numbers fed from its trace records (one per row
per engine step, contracts §6), its step loop and its finished requests. The snapshot travels
with the worker's heartbeat into the state store, and ``GET /metrics`` renders every live
worker's snapshot with a ``worker`` label, so the numbers are the same whichever process serves
the HTTP request (and a Ray Serve deployment needs no extra plumbing).

The exposition is prometheus-client's: `DecoderCollector` turns the snapshots into metric
families at scrape time, `IngressCollector` adds one ingress's admission counts, and each app
holds them in its own `CollectorRegistry` (`MetricsExporter`; never the process-global registry,
so several apps can live in one process). The format follows the scraper's ``Accept`` header
(Prometheus text, or OpenMetrics).

Words: a *draft* is one row's drafted block in one step (diffusion steps ``s > 0``); *draft
tokens* are the tokens sent to verification (``draft_len``); τ (tokens per target pass) is
``emitted / passes`` where a row emits ``accepted + 1`` tokens per step.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kernels.rules import rule_name

__all__ = ["WorkerCounters", "STEP_BUCKETS_MS", "DecoderCollector", "IngressCollector", "MetricsExporter",
           "render_metrics"]

STEP_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


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
            "decisions": {"steps": {}, "draft_len": {}, "rule": {}, "source": {}},
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
                if int(r.get("steps", 0)) != 0:  # a diffusion draft (s > 0) or a suffix draft (-1)
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
                _bump(d["rule"], rule_name(r.get("rule", -1)).lower())  # label from the rule table
                _bump(d.setdefault("source", {}), r.get("source", "none"))

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


class DecoderCollector(Collector):
    """The workers' counters as Prometheus metric families, from the load records most recently
    handed to `set_loads` (each with its ``counters`` snapshot, `WorkerCounters.snapshot`)."""

    def __init__(self) -> None:
        self._loads: dict[str, dict[str, Any]] = {}

    def set_loads(self, loads: dict[str, dict[str, Any]]) -> None:
        self._loads = dict(loads)

    def collect(self) -> Iterator[Metric]:
        ws = sorted(self._loads.items())
        cs = [(w, load.get("counters") or {}) for w, load in ws]

        def per_worker(family: CounterMetricFamily | GaugeMetricFamily, values) -> Metric:
            for w, v in values:
                family.add_metric([w], float(v))
            return family

        for name, help_text, key in _SIMPLE_COUNTERS:
            yield per_worker(CounterMetricFamily(name, help_text, labels=["worker"]),
                             [(w, c.get(key, 0)) for w, c in cs])
        yield per_worker(GaugeMetricFamily("adapt_tau", "Tokens per target pass since start (accepted + 1 averaged).",
                                           labels=["worker"]),
                         [(w, c.get("emitted_tokens", 0) / c["passes"] if c.get("passes") else 0.0) for w, c in cs])
        for name, help_text, key in (
                ("adapt_accepted_per_position", "Accepted draft tokens at each draft position (0 = first).",
                 "accepted_per_position"),
                ("adapt_verified_per_position", "Draft tokens verified at each draft position (0 = first).",
                 "verified_per_position")):
            fam = CounterMetricFamily(name, help_text, labels=["worker", "position"])
            for w, c in cs:
                for i, v in enumerate(c.get(key, [])):
                    fam.add_metric([w, str(i)], float(v))
            yield fam
        fam = CounterMetricFamily("adapt_decisions",
                                  "Per-row decisions by lever (steps, draft_len, rule, source) and chosen value.",
                                  labels=["worker", "lever", "value"])
        for w, c in cs:
            for lever, table in sorted((c.get("decisions") or {}).items()):
                for value, n in sorted(table.items()):
                    fam.add_metric([w, lever, value], float(n))
        yield fam
        fam = CounterMetricFamily("adapt_requests_finished", "Finished requests by finish reason.",
                                  labels=["worker", "reason"])
        for w, c in cs:
            for reason, n in sorted((c.get("requests") or {}).items()):
                fam.add_metric([w, reason], float(n))
        yield fam
        fam = CounterMetricFamily("adapt_sla_requests", "Requests with targets, and those whose SLA was met.",
                                  labels=["worker", "target", "outcome"])
        for w, c in cs:
            s = c.get("sla") or {}
            for kind, total_key, met_key in (("all", "total", "met"), ("latency", "latency_total", "latency_met"),
                                             ("quality", "quality_total", "quality_met")):
                fam.add_metric([w, kind, "total"], float(s.get(total_key, 0)))
                fam.add_metric([w, kind, "met"], float(s.get(met_key, 0)))
        yield fam
        yield per_worker(GaugeMetricFamily("adapt_sla_attainment", "Fraction of requests with targets that met them.",
                                           labels=["worker"]),
                         [(w, (c.get("sla") or {}).get("met", 0) / max(1, (c.get("sla") or {}).get("total", 0)))
                          for w, c in cs])
        yield per_worker(GaugeMetricFamily("adapt_queue_depth", "Requests waiting for a batch slot.", labels=["worker"]),
                         [(w, load.get("waiting", 0)) for w, load in ws])
        yield per_worker(GaugeMetricFamily("adapt_running_requests", "Requests in the running batch.",
                                           labels=["worker"]),
                         [(w, load.get("running", 0)) for w, load in ws])
        yield per_worker(GaugeMetricFamily("adapt_worker_rss_bytes", "Resident memory of the worker's process.",
                                           labels=["worker"]),
                         [(w, load["rss_bytes"]) for w, load in ws if load.get("rss_bytes") is not None])
        fam = HistogramMetricFamily("adapt_step_time_ms", "Engine step wall time in milliseconds.", labels=["worker"])
        bounds = [*(floatToGoString(b) for b in STEP_BUCKETS_MS), "+Inf"]
        for w, c in cs:
            counts = c.get("step_ms_buckets") or [0] * (len(STEP_BUCKETS_MS) + 1)
            fam.add_metric([w], list(zip(bounds, (float(n) for n in itertools.accumulate(counts)))),
                           sum_value=float(c.get("step_ms_sum", 0.0)))
        yield fam
        yield GaugeMetricFamily("adapt_workers_live", "Workers with a live heartbeat in the state store.",
                                value=float(len(ws)))


_SIMPLE_COUNTERS = (  # (name without _total, help, key of the counters snapshot)
    ("adapt_drafts", "Drafted blocks (rows with diffusion steps > 0).", "drafts"),
    ("adapt_draft_tokens", "Draft tokens sent to verification.", "draft_tokens"),
    ("adapt_accepted_tokens", "Draft tokens accepted.", "accepted_tokens"),
    ("adapt_emitted_tokens", "Tokens emitted (accepted + 1 per row per step).", "emitted_tokens"),
    ("adapt_target_passes", "Row-steps verified by the target (τ denominator).", "passes"),
    ("adapt_tvd_spent", "Total-variation distance spent by lossy rules.", "tvd_spent"),
    ("adapt_trace_records_dropped", "Trace records not delivered to the store.", "trace_records_dropped"),
)


class IngressCollector(Collector):
    """One ingress's admission counts (`adapt.serving.limits.Admission.snapshot`)."""

    def __init__(self, admission: Any) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        snap = self.admission.snapshot()
        fam = GaugeMetricFamily("adapt_ingress_requests", "Generation requests held by this ingress.",
                                labels=["state"])
        fam.add_metric(["in_flight"], float(snap["in_flight"]))
        fam.add_metric(["waiting"], float(snap["waiting"]))
        yield fam
        capacity = snap["capacity"]
        yield GaugeMetricFamily("adapt_ingress_capacity", "Generation requests this ingress holds at most "
                                "(max_running + max_queue; -1 = unbounded).",
                                value=-1.0 if capacity is None else float(capacity))
        yield CounterMetricFamily("adapt_ingress_admitted", "Generation requests admitted.",
                                  value=float(snap["admitted"]))
        fam = CounterMetricFamily("adapt_ingress_rejected", "Requests refused before decoding, by reason.",
                                  labels=["reason"])
        for reason, n in sorted(snap["rejected"].items()):
            fam.add_metric([reason], float(n))
        yield fam


class MetricsExporter:
    """One app's ``/metrics``: its own `CollectorRegistry` (never prometheus-client's global one,
    so several apps can live in one process) holding the workers' counters and, when given, the
    ingress's admission counts."""

    def __init__(self, admission: Any | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.decoders = DecoderCollector()
        self.registry.register(self.decoders)
        if admission is not None:
            self.registry.register(IngressCollector(admission))
        self._lock = threading.Lock()

    def render(self, loads: dict[str, dict[str, Any]], accept: str | None = None) -> tuple[bytes, str]:
        """The exposition of `loads` (the live workers' load records) in the format the ``Accept``
        header `accept` asks for (Prometheus text by default, or OpenMetrics); returns the body and
        its content type."""
        encoder, content_type = choose_encoder(accept or "")
        with self._lock:  # a scrape from another thread must not see this one's loads
            self.decoders.set_loads(loads)
            return encoder(self.registry), content_type


def render_metrics(loads: dict[str, dict[str, Any]]) -> str:
    """Prometheus text exposition of every live worker's load record (``counters`` inside),
    through a registry of its own."""
    body, _ = MetricsExporter().render(loads)
    return body.decode()
