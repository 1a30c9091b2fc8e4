"""Offline trace-replay evaluator: what would a policy have done on logged engine steps, at what cost.

The replay runs a closed-loop serving simulation: ``concurrency`` requests are in flight, each
finished request is replaced by the next of the scenario. Every simulated step calls the policy's
real `before_draft` / `after_draft` / `observe` with real `RowState` / `DraftIntent` /
`DraftFeatures` / `StepRecord` objects, exactly as the engine does (suffix drafts are not
replayed: a row whose intent names another source than diffusion decodes without a draft); what the engine would have computed comes from
logged trace records:

- **features** (confidence, entropy, margin) of a row's draft come from a logged record of the same
  source request (when there is one) with the same temperature class, the diffusion steps the
  policy chose, and the rule class (exact or ε-TVD) the request last used;
- **acceptance**: the logged ``accept_flags`` truncated to the draft length the policy chose;
- **TVD**: the logged TVD, scaled by the share of positions the truncated verification decides;
- **time**: the cost model's step time for the tokens and drafter passes the policy chose, plus
  the policy's own measured decision time.

Limits (what a replay cannot know; see docs/policies.md):
1. acceptance beyond the logged draft length is unknown: a policy verifying more than was logged
   gets those positions counted as rejected (pessimistic; reported as ``unknown_share``). Log
   traces with the full block (the `explore` policy does) so that truncation covers every k;
2. a step count ``s`` that was never logged falls back to the nearest logged one;
3. when a policy switches a request between exact and ε-TVD verification, the record drawn for
   the rule class it used before is kept (reported as ``rule_mismatch_share``); under the optimal
   coupling ε-TVD accepts whenever the exact rule does, so this under-states the lenient rule's
   acceptance and over-states the exact rule's;
4. prefill and time to first token are not simulated; SLA attainment is on TPOT.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from adapt.targets import RequestTargets
from adapt.trace_data import K_MAX, TraceTable
from kernels.rules import LENIENT_RULE
from workers.decisions import RECENT_NONE, next_recent_accept

_EPS_RULE = int(LENIENT_RULE)  # the lossy rule policies choose, from the rule table (kernels/rules.py)


@dataclass(frozen=True)
class RequestSpec:
    """One simulated (or live) request: its targets, temperature and length."""

    targets: RequestTargets
    temperature: float = 0.0
    max_tokens: int = 64
    commit_order: str = "confidence"


@dataclass
class Scenario:
    name: str
    concurrency: int
    requests: list[RequestSpec]


def make_mix(num_requests: int, tight_tpot_ms: float, loose_tpot_ms: float, eps: float = 0.1,
             max_tokens: int = 64, budget_total: float | None = None, length_spread: float = 0.0) -> list[RequestSpec]:
    """The evaluation mix, deterministic: half greedy and half sampled (T = 0.8); sampled requests
    alternate lossless and ``tvd=eps``; one request in three has the tight TPOT target.
    ``length_spread`` s in [0, 1): request i asks for ``max_tokens · (1 − s + 2s · frac(i · φ))``
    tokens (φ the golden ratio: evenly spread, mean ``max_tokens``) instead of ``max_tokens`` each.
    With equal lengths, autoregressive decoding in a closed loop runs in lockstep cohorts: every
    request of a cohort finishes in the same step, so no request ever waits for another's prefill
    while it decodes, which a policy whose rows finish apart cannot match."""
    if not 0.0 <= length_spread < 1.0:
        raise ValueError(f"length_spread must be in [0, 1), got {length_spread}")
    out = []
    for i in range(num_requests):
        sampled = i % 2 == 1
        lenient = sampled and (i // 2) % 2 == 1
        quality = f"tvd={eps:g}" if lenient else "lossless"
        total = budget_total if lenient else None
        tpot = tight_tpot_ms if i % 3 == 0 else loose_tpot_ms
        length = spread_length(max_tokens, length_spread, i)
        out.append(RequestSpec(RequestTargets(tpot_ms=tpot, quality=quality, tvd_budget_total=total),
                               temperature=0.8 if sampled else 0.0, max_tokens=length))
    return out


def spread_length(max_tokens: int, length_spread: float, i: int) -> int:
    """The tokens request ``i`` asks for: ``max_tokens · (1 − s + 2s · frac(i · φ))`` with ``s`` =
    ``length_spread`` in [0, 1) (φ the golden ratio: evenly spread, mean ``max_tokens``; at least
    2), ``max_tokens`` when ``s`` = 0."""
    if not length_spread:
        return max_tokens
    even = (i * 0.6180339887) % 1.0  # frac(i · φ): evenly spread over [0, 1)
    return max(2, round(max_tokens * (1.0 - length_spread + 2.0 * length_spread * even)))


class RecordPool:
    """Trace records indexed by (source request, greedy?, steps, lenient?) for drawing features."""

    def __init__(self, table: TraceTable, seed: int = 0):
        usable = (table.steps > 0) & (table.block > 0) & (table.draft_len > 0)
        if not usable.any():
            raise ValueError("traces: no drafted records to replay")
        self.t = table
        self.rng = np.random.default_rng(seed)
        self.by_key: dict[tuple, np.ndarray] = {}
        self.by_source: dict[tuple, np.ndarray] = {}
        idx = np.nonzero(usable)[0]
        keys = np.stack([table.temperature[idx] <= 0, table.steps[idx], table.rule[idx] == _EPS_RULE], 1)
        for key in {tuple(int(v) for v in row) for row in keys}:
            m = (keys == np.array(key)).all(1)
            self.by_key[key] = idx[m]
        sources = table.request_id[idx].astype(str)
        self.sources = sorted(set(sources))
        for key, members in self.by_key.items():
            src = table.request_id[members].astype(str)
            for name in np.unique(src):
                self.by_source[(name,) + key] = members[src == name]
        self.logged_steps = sorted({k[1] for k in self.by_key})
        self.block = int(table.block[idx].max())

    def _key(self, greedy: bool, steps: int, lenient: bool) -> tuple:
        s = min(self.logged_steps, key=lambda v: (abs(v - steps), v))
        for key in ((int(greedy), s, int(lenient)), (int(greedy), s, 0), (int(greedy), s, 1)):
            if key in self.by_key:
                return key
        for key in self.by_key:  # last resort: any temperature class with that s
            if key[1] == s:
                return key
        return next(iter(self.by_key))

    def draw(self, source: str, cursor: dict, greedy: bool, steps: int, lenient: bool) -> tuple[int, bool]:
        """(record index, whether the rule class matched the request's wish)."""
        key = self._key(greedy, steps, lenient)
        own = self.by_source.get((source,) + key)
        if own is not None and len(own):
            pos = cursor.get(key, 0)
            if pos < len(own):
                cursor[key] = pos + 1
                return int(own[pos]), key[2] == int(lenient)
        members = self.by_key[key]
        return int(members[self.rng.integers(len(members))]), key[2] == int(lenient)


@dataclass
class _SimRequest:
    rid: str
    spec: RequestSpec
    source: str
    knobs: object
    generated: int = 0
    recent: float = RECENT_NONE
    verified: int = 0
    tvd: float = 0.0
    elapsed_ms: float = 0.0
    passes: int = 0
    lenient: bool = False
    cursor: dict = field(default_factory=dict)


def replay(policy, table: TraceTable, scenario: Scenario, cost, *, seed: int = 0, pool: RecordPool | None = None,
           max_steps: int = 100_000, charge_decisions: bool = True) -> dict:
    """Simulate ``scenario`` under ``policy``; returns metrics (see `summarize`).

    ``charge_decisions``: add the policy's measured decision time (CPU time of its calls) to each
    simulated step, as it would be in the engine."""
    from kernels.rules import enforce_rules
    from workers.decisions import DraftFeatures, DraftIntent, RowState, StepOutcome, exact_rules
    from workers.draft_sources import DIFFUSION_CODE
    from workers.step_record import StepRecord
    from workers.request import DecodeKnobs

    pool = pool or RecordPool(table, seed)
    K = pool.block
    queue = deque(enumerate(scenario.requests))
    active: list[_SimRequest] = []
    finished: list[_SimRequest] = []
    clock_ms, steps_run = 0.0, 0
    decision_s, unknown, decided, mismatched, drawn = 0.0, 0, 0, 0, 0
    row_steps, tokens_total = 0, 0
    t = pool.t
    while (active or queue) and steps_run < max_steps:
        while queue and len(active) < scenario.concurrency:
            i, spec = queue.popleft()
            q = spec.targets.quality
            knobs = DecodeKnobs(steps=1, draft_len=K, quality=str(q), commit_order=spec.commit_order)
            active.append(_SimRequest(f"sim{i}", spec, pool.sources[i % len(pool.sources)], knobs,
                                      lenient=(not q.lossless) and spec.temperature > 0))
        B = len(active)
        temp = torch.tensor([r.spec.temperature for r in active], dtype=torch.float32)
        rows = RowState(request_ids=[r.rid for r in active], knobs=[r.knobs for r in active],
                        targets=[r.spec.targets for r in active],
                        position=torch.tensor([64 + r.generated for r in active]),
                        generated=torch.tensor([r.generated for r in active]), temperature=temp,
                        recent_accept=torch.tensor([r.recent for r in active], dtype=torch.float32),
                        tvd_spent=torch.tensor([r.tvd for r in active], dtype=torch.float32),
                        remaining=torch.tensor([r.spec.max_tokens - r.generated for r in active]),
                        batch_size=B, block_size=K, packed_verify=True,  # steps are priced by Σ (k + 1)
                        fixed_span=True)  # the logged drafts are whole blocks
        t0 = time.thread_time()
        intent = policy.before_draft(rows)
        # what the engine applies: diffusion rows only, at most K passes, the whole block drafted
        steps = torch.where(intent.source == DIFFUSION_CODE, intent.steps, 0).to(torch.int64).clamp(0, K)
        intent = DraftIntent(torch.where(steps > 0, DIFFUSION_CODE, 0), steps, K)
        t1 = time.thread_time()
        s_host = steps.tolist()
        idx = []
        for r, s in zip(active, s_host):
            if s > 0:
                j, ok = pool.draw(r.source, r.cursor, r.spec.temperature <= 0, s, r.lenient)
                drawn += 1
                mismatched += not ok
            else:
                j = -1
            idx.append(j)
        idx_t = np.array(idx)
        has = idx_t >= 0
        conf = torch.zeros(B, K)
        ent, margin = torch.zeros(B, K), torch.zeros(B, K)
        flags = np.zeros((B, K_MAX), dtype=np.int8)
        if has.any():
            sel = torch.from_numpy(np.nonzero(has)[0])
            conf[sel] = torch.from_numpy(t.confidence[idx_t[has], :K])
            ent[sel] = torch.from_numpy(t.entropy[idx_t[has], :K])
            margin[sel] = torch.from_numpy(t.margin[idx_t[has], :K])
            flags[has] = t.flags[idx_t[has]]
        l2r = torch.tensor([r.spec.commit_order == "left-to-right" for r in active])
        conditional = (steps <= 1) | l2r
        exact = exact_rules(temp, conditional)
        draft = DraftFeatures(steps, conf, ent, margin, exact, conditional)
        t2 = time.thread_time()
        dec = policy.after_draft(rows, intent, draft)
        t3 = time.thread_time()
        # what the engine enforces
        remaining = rows.remaining
        k = torch.minimum(dec.draft_len.clamp(min=0), torch.where(steps > 0, K, 0))
        k = torch.minimum(k, remaining - 1).clamp(min=0)
        lossless = torch.tensor([r.knobs.lossless for r in active])
        rule, _, _ = enforce_rules(dec.rule, dec.param, dec.param2, temp, lossless, conditional)
        k_np = k.numpy()
        j = np.arange(K_MAX)[None, :]
        within = j < k_np[:, None]
        unknown += int(((flags < 0) & within).sum())
        decided += int(within.sum())
        lead = np.cumprod(np.where(within, flags == 1, False), axis=1)
        acc = lead.sum(1)                                                       # [B] accepted
        logged_decided = np.where(has, np.minimum(t.accepted[np.maximum(idx_t, 0)] + 1,
                                                  t.draft_len[np.maximum(idx_t, 0)]), 1)
        now_decided = np.minimum(acc + 1, k_np)
        lenient_now = (rule == _EPS_RULE).numpy()
        tvd = np.where(has & lenient_now, t.tvd_spent[np.maximum(idx_t, 0)] * now_decided / np.maximum(logged_decided, 1), 0.0)
        num_tokens = int(k_np.sum()) + B
        max_s = max(s_host) if s_host else 0
        rpp = (steps[None, :] >= torch.arange(1, max_s + 1)[:, None]).sum(1) if max_s else None
        step_ms = float(cost.step_ms(float(num_tokens), rpp)) + charge_decisions * 1e3 * ((t1 - t0) + (t3 - t2))
        decision_s += (t1 - t0) + (t3 - t2)
        t4 = time.thread_time()
        policy.observe(StepRecord.of(rows, intent, StepOutcome(torch.from_numpy(acc.astype(np.int64)), k.to(torch.int64),
                                                               torch.from_numpy(tvd.astype(np.float32)), step_ms / 1e3,
                                                               num_tokens), steps_run))
        decision_s += time.thread_time() - t4
        clock_ms += step_ms
        steps_run += 1
        still = []
        for r, a, kk, tv, lenient in zip(active, acc.tolist(), k_np.tolist(), tvd.tolist(), lenient_now.tolist()):
            emitted = min(a + 1, r.spec.max_tokens - r.generated)
            r.generated += emitted
            r.elapsed_ms += step_ms
            r.passes += 1
            r.tvd += tv
            row_steps += 1
            tokens_total += emitted
            if kk:
                r.verified += kk
                r.recent = next_recent_accept(r.recent, a, kk)
                r.lenient = bool(lenient) if r.spec.temperature > 0 and not r.spec.targets.quality.lossless else False
            (finished if r.generated >= r.spec.max_tokens else still).append(r)
        active = still
    return summarize(finished + active, clock_ms, steps_run, decision_s,
                     extra={"unknown_share": unknown / max(decided, 1), "rule_mismatch_share": mismatched / max(drawn, 1),
                            "tau": tokens_total / max(row_steps, 1)})


def summarize(requests, clock_ms: float, steps: int, decision_s: float, extra: dict | None = None) -> dict:
    """Goodput, SLA attainment, TVD per token and decision time of one run."""
    tokens = sum(r.generated for r in requests)
    met, with_target = 0, 0
    for r in requests:
        target = r.spec.targets.effective_tpot_ms
        if target is None:
            continue
        with_target += 1
        met += (r.elapsed_ms / max(r.generated, 1)) <= target
    lenient_tokens = sum(r.generated for r in requests if not r.spec.targets.quality.lossless)
    out = {"goodput_tok_s": 1e3 * tokens / max(clock_ms, 1e-9), "sla_attainment": met / max(with_target, 1),
           "tvd_spent_per_token": sum(r.tvd for r in requests) / max(tokens, 1),
           "tvd_spent_per_lenient_token": sum(r.tvd for r in requests) / max(lenient_tokens, 1),
           "decision_ms_per_step": 1e3 * decision_s / max(steps, 1), "steps": steps, "tokens": tokens,
           "requests": len(requests)}
    out.update(extra or {})
    return out
