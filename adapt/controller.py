"""The data-plane controller: builds the policy a worker hands its engine, with fitted parts.

`build_policy(name, policy=None, **settings)` returns a `DecisionMaker` (a `policies` class)
with the predictor and cost model of a policy file (`adapt.policy_file`) injected; settings of the
file apply first and keyword settings override them. `reload(decision_maker, policy)` swaps a new
policy version in between steps (what `adapt policy push` triggers on every worker).
`profile_engine(engine)` times the engine's own target forward and drafter pass on a grid when a
worker starts and returns a `CostModel` (DSpark's SPS(B) table, per token count and per row
count); the policy then keeps correcting it online from measured steps.

The per-step decision logic itself lives in `policies/` (tensor code, no I/O); this module is the
glue between policy files, engines and policies.
"""

from __future__ import annotations

import os
import time

import torch

from adapt.cost_model import DEFAULT_ROW_GRID, DEFAULT_TOKEN_GRID, CostModel, Table
from adapt.policy_file import PolicyFile, load
from workers.decisions import StaticDecisions

# settings each policy accepts from a policy file's "settings" (others are ignored for it)
_SETTINGS = {
    "static": {"steps", "draft_len", "rule"},
    "batch-schedule": {"schedule", "steps", "rule"},
    "dspark": {"steps", "stop"},
    "adaptive": {"steps_grid", "allow_no_draft", "sla_weight", "sla_slack", "priority_weight", "flat_share",
                 "replan_every", "idle_decay", "no_draft_margin"},
    "explore": {"steps_grid", "lenient_share", "seed"},
}


def _as_policy_file(policy) -> PolicyFile | None:
    if policy is None or isinstance(policy, PolicyFile):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        return load(policy)
    raise ValueError(f"policy: expected a PolicyFile or a path, got {type(policy).__name__}")


def build_policy(name: str | None = None, policy=None, **settings):
    """A policy instance; ``policy`` is a `PolicyFile`, a path to one, or None (built-in stand-ins).

    ``name`` defaults to the file's policy name (or 'adaptive').
    """
    import policies

    pf = _as_policy_file(policy)
    name = name or (pf.policy if pf else "adaptive")
    merged: dict = {}
    if pf is not None:
        allowed = _SETTINGS.get(name, set())
        merged.update({k: v for k, v in pf.settings.items() if k in allowed})
        merged["predictor"] = pf.predictor
        merged["cost"] = CostModel.from_dict(pf.cost.to_dict())  # each worker corrects its own copy
    merged.update(settings)
    if "steps_grid" in merged:
        merged["steps_grid"] = tuple(merged["steps_grid"])
    if "schedule" in merged and isinstance(merged["schedule"], dict):
        merged["schedule"] = {int(k): v for k, v in merged["schedule"].items()}
    return policies.get(name, **merged)


def reload(decision_maker, policy, keep_cost: bool = False) -> str:
    """Swap a new policy file's predictor, cost model and settings into a running policy.
    ``keep_cost``: keep the running policy's cost model (profiled on this worker and corrected
    online), which knows this machine better than a file fitted elsewhere."""
    pf = _as_policy_file(policy)
    allowed = _SETTINGS.get(getattr(decision_maker, "name", ""), set())
    settings = {k: (tuple(v) if k == "steps_grid" else v) for k, v in pf.settings.items() if k in allowed}
    cost = None if keep_cost else CostModel.from_dict(pf.cost.to_dict())
    decision_maker.update(predictor=pf.predictor, cost=cost, **settings)
    return pf.version


@torch.inference_mode()
def profile_engine(engine, token_grid=DEFAULT_TOKEN_GRID[:8], row_grid=DEFAULT_ROW_GRID[:7],
                   context: int = 64, repeats: int = 5, overhead_steps: int = 12) -> CostModel:
    """Time ``engine``'s target forward per token count and drafter pass per row count, then the
    per-step overhead the two tables do not cover (acceptance, bookkeeping, the host sync).

    - verify table: one target forward over ``n`` tokens (with the stash of their hidden states);
    - draft table: one denoising pass over ``rows`` blocks of ``K + 1`` tokens, plus the lazy
      drafter-context commit of two positions per row (what a row drafting every step flushes on
      average at τ ≈ 2; the online correction adjusts it to the measured steps);
    - ``overhead_ms``: the median time of ``overhead_steps`` real autoregressive engine steps of one
      request, minus the verify table's value at one token;
    - then the *drafting extra*: the median time of real speculative steps of one request (s = 1,
      the full block), minus what the tables and the overhead predict for them, added to every
      point of the draft table. A drafting step pays more than its denoising pass: acceptance over
      the block, the drafter-context commit, the draft features, bookkeeping per drafted token
      (at batch 1 on the demo pair ~1.8 ms that the passes alone did not show, so drafting looked
      cheaper than it was).

    Must run before the engine has running requests (it writes scratch entries into cache slots).
    """
    if getattr(engine, "running", None):
        raise RuntimeError("profile_engine: the engine has running requests; profile at worker start")
    dev = engine.device
    max_b = engine.config.max_batch
    K = max(engine.block, 1)
    width_cap = engine.tcache.max_len
    context = max(1, min(context, engine.max_len // 2))  # small engines: a shorter scratch context
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    dr = engine.drafter

    def verify_fn(n: int) -> None:
        b = max(1, min(max_b, n // (K + 1) or 1))
        t = max(1, -(-n // b))
        t = min(t, width_cap - context - 1)
        ids = torch.zeros(b, t, dtype=torch.long, device=dev)
        start = torch.full((b,), context, dtype=torch.long, device=dev)
        _, hidden = engine.target_forward(ids, start, engine.tcache, 0, context + t, start_value=context)
        if dr is not None:
            engine.pending[:b, :t] = hidden[:, : engine.pending.shape[1]]

    draft_fn = None
    if dr is not None:

        def draft_fn(rows: int) -> None:
            b = min(rows, max_b)
            slots = torch.arange(b, device=dev)
            start = torch.full((b,), context, dtype=torch.long, device=dev)
            flushed = dr.context_kv(engine.pending[:b, :2], start[:, None] + torch.arange(2, device=dev))
            engine.dcache.write_rows(flushed, slots, start)
            ctx = engine.dcache.views(0, b, context)
            tokens = torch.zeros(b, K + 1, dtype=torch.long, device=dev)
            masked = torch.ones(b, K + 1, dtype=torch.bool, device=dev)
            masked[:, 0] = False
            positions = context + torch.arange(K + 1, device=dev).expand(b, K + 1)
            ctx_mask = torch.ones(b, K + 1, context, dtype=torch.bool, device=dev)
            hidden = dr.forward_block(dr.embed_block(tokens, masked), positions, ctx, ctx_mask)
            dr.logits(hidden[:, 1:])

    grid_rows = [r for r in row_grid if r <= max_b] or [1, 2]
    if len(grid_rows) < 2:
        grid_rows = [1, 2]
    cost = CostModel.profile(verify_fn, draft_fn, token_grid=token_grid, row_grid=grid_rows, repeats=repeats, sync=sync)
    if overhead_steps > 0:
        ar = _step_times(engine, context, overhead_steps, draft_len=0)
        cost.overhead_ms = max(0.0, ar - float(cost.verify.at(1.0)))
        if dr is not None:
            spec = _step_times(engine, context, overhead_steps, draft_len=K)
            extra = max(0.0, spec - cost.step_ms_at(float(K + 1), [1]))
            cost.draft_pass = Table(cost.draft_pass.xs.tolist(), (cost.draft_pass.ys + extra).tolist(), "cost.draft_pass")
    return cost


class _FeatureReadingStatic(StaticDecisions):
    """Each request's own knobs, with the draft features computed as for a policy that reads them."""

    reads_draft_features = True


def _step_times(engine, context: int, steps: int, draft_len: int) -> float:
    """Median wall time (ms) of ``steps`` real decode steps of one greedy request (s = 1,
    ``draft_len`` drafts verified per step) after a ``context``-token prompt."""
    import numpy as np

    from workers.request import DecodeKnobs, SamplingParams

    saved, sink = engine.decisions, engine.trace_sink
    engine.decisions, engine.trace_sink = _FeatureReadingStatic(), None
    rid = "__adapt_profile__"
    try:
        room = steps * (draft_len + 1) + 4
        length = max(1, min(context, engine.max_len - room))
        prompt = [int(t) % engine.vocab for t in range(3, 3 + length)]
        engine.add_request(rid, prompt, SamplingParams(max_tokens=min(room, engine.max_len - length) - 1,
                                                       temperature=0.0, ignore_eos=True),
                           DecodeKnobs(steps=1 if draft_len else 0, draft_len=draft_len))
        times = []
        while engine.has_unfinished() and len(times) < steps + 1:
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        if engine.has_unfinished():
            engine.abort(rid)
    finally:
        engine.decisions, engine.trace_sink = saved, sink
    decode = times[1:] or times  # the first step is the prefill
    return float(np.median(decode))
