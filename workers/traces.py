"""Per-row, per-step trace records (contracts §6) and the sinks they are written to.

A record describes one row of one engine step: the row's state before the step, the knobs the
decision maker chose, the draft features it saw, and what happened (accepted drafts, TVD spent,
timings). Records are plain dicts with `"v": TRACE_VERSION`; sinks take a list per step.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Protocol

TRACE_VERSION = 2  # 2: recent_accept is the per-position estimate (workers.decisions.next_recent_accept)
# fields added within version 2 (readers default them): source ('none' | 'diffusion' | 'suffix'; steps is
# -1 for suffix rows) and suffix_match (the suffix draft's match length)
COPY_STEPS = -1  # a suffix row's `steps` in a trace record (the file format stored traces and their readers keep)
TRACE_FIELDS = ("v", "request_id", "step", "time", "position", "generated", "temperature", "recent_accept",
                "batch_size", "num_tokens", "steps", "draft_len", "rule", "source", "suffix_match", "param", "param2", "commit_order",
                "confidence", "entropy", "margin", "accepted", "accept_flags", "tvd_spent",
                "draft_ms", "verify_ms", "step_ms")


class TraceSink(Protocol):
    def write(self, records: list[dict]) -> None: ...


class FileTraceSink:
    """Appends records as JSON Lines to `path` (flushed after every step's batch)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        with self._lock:
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class ListTraceSink:
    """Keeps records in memory (`.records`), for in-process consumers such as benchmarks."""

    def __init__(self):
        self.records: list[dict] = []

    def write(self, records: list[dict]) -> None:
        self.records.extend(records)


def read_traces(path: str | Path) -> list[dict]:
    """All records of a JSON Lines trace file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
