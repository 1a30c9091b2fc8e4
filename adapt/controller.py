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

import torch

from adapt.cost_model import DEFAULT_ROW_GRID, DEFAULT_TOKEN_GRID, CostModel
from adapt.policy_file import PolicyFile, load

# settings each policy accepts from a policy file's "settings" (others are ignored for it)
_SETTINGS = {
    "static": {"steps", "draft_len", "rule"},
    "batch-schedule": {"schedule", "steps", "rule"},
    "dspark": {"steps", "stop"},
    "adaptive": {"steps_grid", "allow_no_draft", "sla_weight", "sla_slack", "priority_weight", "flat_share",
                 "replan_every"},
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


def reload(decision_maker, policy) -> str:
    """Swap a new policy file's predictor, cost model and settings into a running policy."""
    pf = _as_policy_file(policy)
    allowed = _SETTINGS.get(getattr(decision_maker, "name", ""), set())
    settings = {k: (tuple(v) if k == "steps_grid" else v) for k, v in pf.settings.items() if k in allowed}
    decision_maker.update(predictor=pf.predictor, cost=CostModel.from_dict(pf.cost.to_dict()), **settings)
    return pf.version


@torch.inference_mode()
def profile_engine(engine, token_grid=DEFAULT_TOKEN_GRID[:8], row_grid=DEFAULT_ROW_GRID[:7],
                   context: int = 64, repeats: int = 3) -> CostModel:
    """Time ``engine``'s target forward per token count and drafter pass per row count.

    Must run before the engine has running requests (it writes scratch entries into cache slots).
    """
    if getattr(engine, "running", None):
        raise RuntimeError("profile_engine: the engine has running requests; profile at worker start")
    dev = engine.device
    max_b = engine.config.max_batch
    K = max(engine.block, 1)
    width_cap = engine.tcache.max_len
    sync = torch.cuda.synchronize if dev.type == "cuda" else None

    def verify_fn(n: int) -> None:
        b = max(1, min(max_b, n // (K + 1) or 1))
        t = max(1, -(-n // b))
        t = min(t, width_cap - context - 1)
        ids = torch.zeros(b, t, dtype=torch.long, device=dev)
        start = torch.full((b,), context, dtype=torch.long, device=dev)
        engine.target(ids, start, engine.tcache, 0, context + t, engine.capture)

    draft_fn = None
    if engine.drafter is not None:
        dr = engine.drafter

        def draft_fn(rows: int) -> None:
            b = min(rows, max_b)
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
    return CostModel.profile(verify_fn, draft_fn, token_grid=token_grid, row_grid=grid_rows, repeats=repeats, sync=sync)
