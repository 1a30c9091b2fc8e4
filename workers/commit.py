"""Commit and traces: the host side of a step, after its one host read.

A row **commits** its accepted drafts + 1 tokens: its committed length advances (rolling back a
rejected draft is just not advancing), its counters and recent acceptance update, its tokens are
emitted and its stop conditions checked. Each committed row of a traced step writes one **trace
record** (schema: workers/traces.py, docs/contracts.md §6); `request_stats` is what a request
reports with each output (`RequestOutput.stats`).
"""

from __future__ import annotations

import time

from workers.decisions import next_recent_accept
from workers.draft_sources import SUFFIX_CODE
from workers.step_batch import RequestState, source_name
from workers.traces import COPY_STEPS, TRACE_VERSION


def advance(req: RequestState, source: int, steps: int, draft_len: int, rule: int, accepted: int, tvd: float,
            accept_per_position: list[float] | None, clamp: str | None = None) -> None:
    """Count one decode step of `req` that drafted from source code `source` (in `steps`
    diffusion passes; 0 for other sources), verified `draft_len` drafts with `rule` and accepted
    `accepted`; `clamp`: why a pinned knob was cut this step (workers/pins.py), None if none was."""
    req.passes += 1
    req.ema_before = req.recent_accept
    req.accepted += accepted
    req.verified += draft_len
    req.tvd += tvd
    if steps > 0:  # diffusion drafts only: a copy's acceptance has its own model (a suffix draft's: its match)
        req.recent_accept = next_recent_accept(req.recent_accept, accepted, draft_len)
    if accept_per_position is not None:  # else the counters did not change
        req.apos = accept_per_position
    req.last_knobs = (source, steps, draft_len, rule)
    req.log.record(source, steps, draft_len, rule, accepted, clamp)
    req.length += accepted + 1


def remaining(req: RequestState, max_len: int) -> int:
    """Tokens `req` may still emit: its max_tokens, and the context's room (max_len)."""
    return min(req.params.max_tokens - len(req.output), max_len - len(req.prompt) - len(req.output))


def emit(req: RequestState, new: list[int], now: float, max_len: int) -> str | None:
    """Append tokens; returns the finish reason ('stop' | 'length') if the request is done."""
    req.output.extend(new)
    if req.suffix_index is not None:
        req.suffix_index.extend(new)
    req.t_last = now
    if new and new[-1] in req.stop_ids:
        return "stop"
    if remaining(req, max_len) <= 0:
        return "length"
    return None


def request_stats(req: RequestState) -> dict:
    """What `req` reports with each output (docs/serving.md, "Per-request decode pins", defines
    the fields): its totals, what most of its decode steps used (`*_used`), its latest decode
    step (`last_step`) and the per-step counts with its pins (`decode_stats`)."""
    gen = len(req.output)
    wall = max(req.t_last - req.t_start, 1e-9)
    return {
        "tau": gen / max(req.passes, 1), "target_passes": req.passes, "tokens": gen,
        "accepted": req.accepted, "verified": req.verified,
        "accept_per_position": req.apos, "tvd_spent": req.tvd,
        **req.log.used(), "last_step": req.log.last_step(), "decode_stats": req.log.summary(),
        "tokens_per_s": gen / wall, "prompt_tokens": len(req.prompt),
    }


def trace_record(req: RequestState, step: int, feats: list[float], K: int, source: int, s: int, k: int, rule: int, param: float,
                 param2: float, a: int, tvd: float, times: tuple[float, float, float], B: int, num_tokens: int) -> dict:
    """The trace record of `req`'s row in decode step `step`, written after the step's commit
    (position / generated / recent_accept as they were before it); `source`: the row's source code,
    `s` its diffusion steps (0 for other sources). times: (start, drafted, done)
    perf_counter seconds; num_tokens: positions in the step's target forward (rows padded)."""
    t0, t_draft, now = times
    before = req.length - a - 1
    return {
        "v": TRACE_VERSION, "request_id": req.request_id, "step": step, "time": time.time(),
        "position": before, "generated": len(req.output),
        "temperature": float(req.params.temperature), "recent_accept": req.ema_before,
        "batch_size": B, "num_tokens": num_tokens, "steps": COPY_STEPS if source == SUFFIX_CODE else s, "draft_len": k, "rule": rule,
        "source": source_name(source, k), "suffix_match": req.suffix_draft.match_len if source == SUFFIX_CODE else 0,
        "param": param, "param2": param2, "commit_order": req.knobs.commit_order,
        "confidence": feats[:K] if source else [], "entropy": feats[K : 2 * K] if source else [],
        "margin": feats[2 * K : 3 * K] if source else [], "accepted": a,
        "accept_flags": [1] * a + [0] * (k - a), "tvd_spent": tvd,
        "draft_ms": (t_draft - t0) * 1e3, "verify_ms": (now - t_draft) * 1e3, "step_ms": (now - t0) * 1e3,
    }
