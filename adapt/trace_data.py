"""Reading engine trace records (contracts §6) into column arrays for fitting and replay.

A *trace record* is one JSON object per row per engine step: the row's state before the step
(position, generated, temperature, recent acceptance), the decision taken (diffusion steps ``s``,
draft length ``k``, rule and its parameters), the draft's per-position features (confidence,
entropy, margin over the whole drafted block of ``K`` positions) and the outcome (``accept_flags``
over the ``k`` verified positions: 1 until the first rejection, then 0; ``accepted``; TVD spent;
timings).

`read_records` streams records from a JSON Lines file, a directory of ``*.jsonl`` files or a
glob; `TraceTable.from_records` packs them into NumPy columns padded to ``K_MAX`` positions, with
``flags = -1`` where acceptance is unknown (positions at or beyond the logged draft length).
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from workers.decisions import RECENT_NONE
from workers.traces import TRACE_VERSION

K_MAX = 16  # widest drafted block the contracts allow

REQUIRED = ("request_id", "step", "steps", "draft_len", "rule", "temperature", "accepted", "accept_flags")


class TraceError(ValueError):
    """A trace file or record is malformed; the message names the file, line and field."""


def trace_files(path: str | os.PathLike) -> list[str]:
    """The ``*.jsonl`` files named by ``path`` (a file, a directory or a glob), sorted."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
    elif any(ch in path for ch in "*?["):
        files = sorted(glob.glob(path, recursive=True))
    elif os.path.exists(path):
        files = [path]
    else:
        raise TraceError(f"traces: no such file or directory: {path}")
    if not files:
        raise TraceError(f"traces: no *.jsonl files under {path}")
    return files


def read_records(path: str | os.PathLike) -> Iterator[dict]:
    """Yield every trace record under ``path``; raise `TraceError` naming file:line on bad JSON."""
    for file_index, name in enumerate(trace_files(path)):
        with open(name, encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"traces: {name}:{lineno}: invalid JSON ({exc.msg})") from None
                if not isinstance(record, dict):
                    raise TraceError(f"traces: {name}:{lineno}: a record must be a JSON object")
                missing = [f for f in REQUIRED if f not in record]
                if missing:
                    raise TraceError(f"traces: {name}:{lineno}: missing field {missing[0]!r}")
                record.setdefault("run", file_index)
                yield record


def _padded(records: list[dict], field: str, fill: float, dtype) -> np.ndarray:
    out = np.full((len(records), K_MAX), fill, dtype=dtype)
    for i, rec in enumerate(records):
        values = rec.get(field) or []
        n = min(len(values), K_MAX)
        if n:
            out[i, :n] = values[:n]
    return out


@dataclass
class TraceTable:
    """Trace records as columns. ``N`` records, ``K_MAX`` padded positions.

    ``flags[n, j]`` is 1/0 for verified positions (``j < draft_len``) and -1 where unknown.
    ``survived[n, j]`` is 1 if position ``j`` was accepted (``j < accepted``), 0 if it was verified
    and not accepted, -1 if unknown (the row never verified it).
    """

    request_id: np.ndarray      # [N] object (str)
    step: np.ndarray            # [N] int64, engine step
    run: np.ndarray             # [N] int64, which engine run (file) the record came from
    position: np.ndarray        # [N] int64
    generated: np.ndarray       # [N] int64
    temperature: np.ndarray     # [N] float32
    recent_accept: np.ndarray   # [N] float32
    batch_size: np.ndarray      # [N] int64
    num_tokens: np.ndarray      # [N] int64, tokens in the target forward of that step
    steps: np.ndarray           # [N] int64, diffusion steps s (-1: a suffix draft, workers/suffix.py)
    draft_len: np.ndarray       # [N] int64, verified draft length k
    block: np.ndarray           # [N] int64, drafted block width (len(confidence))
    rule: np.ndarray            # [N] int64
    param: np.ndarray           # [N] float32
    accepted: np.ndarray        # [N] int64
    tvd_spent: np.ndarray       # [N] float32
    confidence: np.ndarray      # [N, K_MAX] float32 (0 beyond the block)
    entropy: np.ndarray         # [N, K_MAX] float32
    margin: np.ndarray          # [N, K_MAX] float32
    flags: np.ndarray           # [N, K_MAX] int8 (-1 unknown)
    draft_ms: np.ndarray        # [N] float32 (nan if absent)
    verify_ms: np.ndarray       # [N] float32
    step_ms: np.ndarray         # [N] float32
    suffix_match: np.ndarray    # [N] int64, match length of a suffix draft (0 otherwise)

    def __len__(self) -> int:
        return len(self.request_id)

    @property
    def step_key(self) -> np.ndarray:  # [N] int64, unique per (run, engine step)
        return self.run * (1 << 32) + self.step

    @property
    def survived(self) -> np.ndarray:  # [N, K_MAX] int8
        j = np.arange(K_MAX)[None, :]
        out = np.where(j < self.accepted[:, None], 1, 0).astype(np.int8)
        out[j >= self.draft_len[:, None]] = -1
        return out

    def select(self, mask: np.ndarray) -> "TraceTable":
        """The records where ``mask`` ([N] bool) holds."""
        return TraceTable(**{name: getattr(self, name)[mask] for name in self.__dataclass_fields__})

    @classmethod
    def from_records(cls, records: Iterable[dict]) -> "TraceTable":
        records = list(records)
        if not records:
            raise TraceError("traces: no records")

        def col(field: str, default, dtype):
            return np.array([r.get(field, default) if r.get(field) is not None else default for r in records],
                            dtype=dtype)

        version = col("v", TRACE_VERSION, np.int64)
        if (version != TRACE_VERSION).any():
            i = int(np.argmax(version != TRACE_VERSION))
            raise TraceError(f"traces: record {i}: field 'v' is {version[i]}, this build reads {TRACE_VERSION} "
                             f"(version 1 traces measured recent_accept differently: collect new traces)")
        flags = _padded(records, "accept_flags", -1, np.int8)
        draft_len = col("draft_len", 0, np.int64)
        j = np.arange(K_MAX)[None, :]
        flags[j >= np.minimum(draft_len, K_MAX)[:, None]] = -1
        bad = (draft_len < 0) | (draft_len > K_MAX)
        if bad.any():
            i = int(np.argmax(bad))
            raise TraceError(f"traces: record {i}: field 'draft_len' out of range: {draft_len[i]}")
        return cls(
            request_id=np.array([str(r["request_id"]) for r in records], dtype=object),
            step=col("step", 0, np.int64),
            run=np.array([zlib.crc32(str(r.get("run", 0)).encode()) for r in records], dtype=np.int64),
            position=col("position", 0, np.int64),
            generated=col("generated", 0, np.int64),
            temperature=col("temperature", 0.0, np.float32),
            recent_accept=col("recent_accept", RECENT_NONE, np.float32),
            batch_size=col("batch_size", 1, np.int64),
            num_tokens=col("num_tokens", 0, np.int64),
            steps=col("steps", 0, np.int64),
            draft_len=draft_len,
            block=np.array([len(r.get("confidence") or []) for r in records], dtype=np.int64),
            rule=col("rule", 0, np.int64),
            param=col("param", 0.0, np.float32),
            accepted=col("accepted", 0, np.int64),
            tvd_spent=col("tvd_spent", 0.0, np.float32),
            confidence=_padded(records, "confidence", 0.0, np.float32),
            entropy=_padded(records, "entropy", 0.0, np.float32),
            margin=_padded(records, "margin", 0.0, np.float32),
            flags=flags,
            draft_ms=col("draft_ms", np.nan, np.float32),
            verify_ms=col("verify_ms", np.nan, np.float32),
            step_ms=col("step_ms", np.nan, np.float32),
            suffix_match=col("suffix_match", 0, np.int64),
        )

    @classmethod
    def read(cls, path: str | os.PathLike) -> "TraceTable":
        return cls.from_records(read_records(path))
