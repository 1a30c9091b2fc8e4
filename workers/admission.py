"""Admission: how many waiting requests an engine step prefills.

A prefill stalls every running row: the rows wait while the new prompts run through the target
(on this CPU, where the target is compute-bound, other requests' prefills took 15-20 % of a
decoding request's time at 8-16 requests on the mixed workload, and caused every TPOT miss of the
autoregressive baseline there). Two modes:

- ``"all"``: prefill every waiting request there is a slot for (vLLM's scheduler without a
  token budget; the default).
- ``"sla"``: **SLA-aware admission**. A *protected* row is a running row with a TPOT target that
  is on it so far and will finish within ``max_wait_ms`` at its pace. Its *slack* is the stall it
  can absorb and still end on target: ``(target − pace) · (n + left)`` ms, with ``pace`` its
  wall ms per token after its first so far, ``n`` those tokens and ``left`` the tokens it may
  still emit. The step prefills the longest FIFO prefix of the waiting requests whose estimated
  prefill time fits within every protected row's slack; the rest wait for a later step. A
  waiting request is never deferred past its *deadline*: ``max_wait_ms`` after it arrived, or
  sooner where its own TTFT target (less the prefill's time) comes first. This trades the
  waiting requests' TTFT, bounded, for the running rows' TPOT targets; rows without a target,
  rows already off it, and rows too far from their end (deferring cannot help them within the
  bound) never defer anyone.

The estimated prefill time is ``ms_per_token`` (the engine's running average over its own
prefills) times the tokens the prefill runs: the prompts' own tokens with packed prefill, else
the prompts padded to the longest.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMISSION_MODES = ("all", "sla")
MIN_TOKENS_SEEN = 4  # a row's pace is read only after this many tokens past its first


@dataclass(frozen=True)
class RowClock:
    """A running row's clock: ``target_ms`` its TPOT target (None: no target), ``elapsed_ms``
    wall time since its first token, ``n`` tokens emitted after the first, ``left`` tokens it
    may still emit."""

    target_ms: float | None
    elapsed_ms: float
    n: int
    left: int


@dataclass(frozen=True)
class Waiting:
    """A waiting request: ``prompt_len`` tokens, ``waited_ms`` since it arrived, ``ttft_ms`` its
    TTFT target (None: none)."""

    prompt_len: int
    waited_ms: float
    ttft_ms: float | None = None


def stall_budget_ms(rows: list[RowClock], max_wait_ms: float) -> float:
    """The smallest slack (ms) over the protected rows (see the module docstring); inf if none."""
    budget = float("inf")
    for r in rows:
        if r.target_ms is None or r.n < MIN_TOKENS_SEEN or r.left <= 0:
            continue
        pace = r.elapsed_ms / r.n
        if pace > r.target_ms or r.left * pace > max_wait_ms:
            continue  # off target already, or too far from its end for a bounded wait to help
        budget = min(budget, (r.target_ms - pace) * (r.n + r.left))
    return budget


def prefill_ms(prompt_lens: list[int], ms_per_token: float, packed: bool) -> float:
    """Estimated time of prefilling these prompts in one forward."""
    if not prompt_lens:
        return 0.0
    tokens = sum(prompt_lens) if packed else len(prompt_lens) * max(prompt_lens)
    return ms_per_token * tokens


def admit_count(waiting: list[Waiting], rows: list[RowClock], free_slots: int, *, mode: str = "all",
                ms_per_token: float | None = None, max_wait_ms: float = 1000.0, packed: bool = True) -> int:
    """How many of ``waiting`` (FIFO order) to prefill now, at most ``free_slots``."""
    if mode not in ADMISSION_MODES:
        raise ValueError(f"admission: must be one of {ADMISSION_MODES}, got {mode!r}")
    most = min(free_slots, len(waiting))
    if mode == "all" or most == 0 or ms_per_token is None:
        return most  # no estimate yet (no prefill seen): admit
    budget = stall_budget_ms(rows, max_wait_ms)
    take = total = longest = 0  # the FIFO prefix's request count, token sum and longest prompt
    for w in waiting[:most]:
        total, longest = total + w.prompt_len, max(longest, w.prompt_len)
        if ms_per_token * (total if packed else (take + 1) * longest) > budget:
            break
        take += 1
    due = 0  # up to the last request whose deadline has come (FIFO: everyone before it goes too)
    for i, w in enumerate(waiting[:most]):
        ttft_due = w.ttft_ms is not None and w.waited_ms + prefill_ms([w.prompt_len], ms_per_token, packed) >= w.ttft_ms
        if w.waited_ms >= max_wait_ms or ttft_due:
            due = i + 1
    return max(take, due)
