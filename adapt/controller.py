"""The data-plane controller: builds the policy a worker hands its engine, with fitted parts.

`build_policy(name, policy=None, **settings)` returns a `DecisionMaker` (a `policies` class)
with the predictor and cost model of a policy file (`adapt.policy_file`) injected; settings of the
file apply first and keyword settings override them. `reload(decision_maker, policy)` swaps a new
policy version in between steps (what `adapt policy push` triggers on every worker).
A file's settings are checked against its policy's settings model (`SETTINGS`, pydantic): an
unknown, ill-typed or out-of-range setting is an error that names it, never dropped; a setting
deleted as measured no better (`policies.adaptive.settings.REMOVED`) is dropped with a warning.
`profile_engine(engine)` times the engine's own target forward and drafter pass on a grid when a
worker starts and returns a `CostModel` (DSpark's SPS(B) table, per token count and per row
count); the policy then keeps correcting it online from measured steps.

The per-step decision logic itself lives in `policies/` (tensor code, no I/O); this module is the
glue between policy files, engines and policies.
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from adapt.cost_model import DEFAULT_ROW_GRID, PROFILE_TOKEN_GRID, CostModel, Table
from adapt.policy_file import PolicyFile, PolicyFileError, load
from policies.adaptive.settings import AdaptiveSettings, drop_removed
from workers.decisions import StaticDecisions


# -- the settings a policy file may carry ----------------------------------------------------------
# One pydantic model per policy: its field names are the settings the policy takes from a file's
# "settings", their types what JSON must hold (strict: no "2" for 2, no 1 for true). The adaptive
# policy's is its own model (`policies.adaptive.settings`, ranges included: its constructor, a
# policy file and `adapt policy set` read the same one); the others' ranges are left to the classes. `Field(default=None)` only marks a setting optional: values are
# taken with ``exclude_unset``, so an absent setting keeps the policy's own default.
class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_Ints = Annotated[list[int], Strict(False)]  # a JSON array, or a tuple from Python callers


class StaticSettings(_Settings):
    steps: int = Field(default=None)
    draft_len: int = Field(default=None)
    rule: Literal["auto", "exact"] = Field(default=None)


class BatchScheduleSettings(_Settings):
    schedule: dict[Annotated[int, Strict(False)], float] | None = None  # JSON keys are strings; None: default
    steps: int = Field(default=None)
    rule: Literal["auto", "exact"] = Field(default=None)


class DSparkSettings(_Settings):
    steps: int = Field(default=None)
    stop: Literal["first_drop", "argmax"] = Field(default=None)


class ExploreSettings(_Settings):
    steps_grid: _Ints = Field(default=None)
    lenient_share: float = Field(default=None)
    seed: int = Field(default=None)


# policy name -> the settings it accepts from a policy file; a policy registered elsewhere
# (`policies.register`) adds its model here, else its files may carry no settings
SETTINGS: dict[str, type[BaseModel]] = {
    "static": StaticSettings,
    "batch-schedule": BatchScheduleSettings,
    "dspark": DSparkSettings,
    "adaptive": AdaptiveSettings,
    "explore": ExploreSettings,
}


def validate_settings(policy: str, settings: dict) -> dict:
    """A policy file's ``settings`` for policy ``policy``, checked: the settings given, with
    validated values. An unknown or ill-typed setting raises `PolicyFileError` naming it
    (``policy.settings.NAME: ...``)."""
    if not isinstance(settings, dict):
        raise PolicyFileError("policy.settings: expected a JSON object")
    model = SETTINGS.get(policy)
    if model is None:
        if settings:
            raise PolicyFileError(f"policy.settings.{sorted(settings)[0]}: unknown setting (policy {policy!r} "
                                  "takes no settings from a policy file)")
        return {}
    if model is AdaptiveSettings:  # settings deleted as measured no better: a warning, not an error
        settings = drop_removed(settings)
    try:
        return model.model_validate(settings).model_dump(exclude_unset=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(model.model_fields))
            raise PolicyFileError(f"policy.settings.{loc}: unknown setting of policy {policy!r} "
                                  f"(known: {known})") from None
        raise PolicyFileError(f"policy.settings.{loc}: {err['msg']} (got {err['input']!r})") from None


def _file_settings(pf: PolicyFile, name: str) -> dict:
    """The settings of ``pf`` (validated for the file's own policy) that policy ``name`` applies:
    all of them when ``name`` is the file's policy; those ``name`` also takes when the file is
    used for another policy (e.g. a benchmark running every policy on one fitted file)."""
    checked = validate_settings(pf.policy, pf.settings)
    if name == pf.policy:
        return checked
    model = SETTINGS.get(name)
    shared = {k: v for k, v in checked.items() if model is not None and k in model.model_fields}
    return validate_settings(name, shared)


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
        merged.update(_file_settings(pf, name))
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
    settings = _file_settings(pf, getattr(decision_maker, "name", ""))
    settings = {k: (tuple(v) if k == "steps_grid" else v) for k, v in settings.items()}
    cost = None if keep_cost else CostModel.from_dict(pf.cost.to_dict())
    decision_maker.update(predictor=pf.predictor, cost=cost, **settings)
    return pf.version


PROFILE_SPAN = 4  # drafts per speculative step when profiling the drafting extra (`profile_engine`)


@torch.inference_mode()
def profile_engine(engine, token_grid=PROFILE_TOKEN_GRID[:15], row_grid=DEFAULT_ROW_GRID[:7],
                   context: int = 64, repeats: int = 5, overhead_steps: int = 12, shuffle: bool = True) -> CostModel:
    """Time ``engine``'s target forward per token count and drafter pass per row count, then the
    per-step overhead the two tables do not cover (acceptance, bookkeeping, the host sync).

    - verify table: one target forward over ``n`` tokens (with the stash of their hidden states),
      at every ``n`` up to 8 and coarser above (`PROFILE_TOKEN_GRID`: a compiled forward is not
      linear between powers of two there);
    - draft table: one denoising pass over ``rows`` blocks of ``K + 1`` tokens (logits over the
      draft vocabulary and their softmax, as the engine drafts: by the drafter's compiled package
      where it has one that takes the shape), plus the lazy drafter-context
      commit of two positions per row (what a row drafting every step flushes on average at
      τ ≈ 2; the online correction adjusts it to the measured steps); and ``span_share``, a pass
      over ``[anchor, MASK]`` against a whole block (the draft span, `CostModel.span_scale`; 1 on
      a compiled engine, which drafts whole blocks);
    - ``overhead_ms``: the median time of ``overhead_steps`` real autoregressive engine steps of one
      request, minus the verify table's value at one token;
    - then the *drafting extra*: the median time of real speculative steps of one request (s = 1,
      `PROFILE_SPAN` drafts verified, the block denoised over as many positions: the drafts a policy
      takes on a CPU, where the whole block's 16 would price drafting by the acceptance, features
      and verification of a step no policy takes there), minus what the tables and the overhead
      predict for them, in whole-block units (`CostModel.span_scale`), added to every
      point of the draft table. A drafting step pays more than its denoising pass: acceptance over
      the block, the drafter-context commit, the draft features, bookkeeping per drafted token
      (at batch 1 on the demo pair ~1.8 ms that the passes alone did not show, so drafting looked
      cheaper than it was).

    ``shuffle``: each sweep of the tables times its points in its own order (`CostModel.profile`);
    False: the grid's order, in which a call always follows the same other calls and a profile
    can price one draft source out (see `CostModel.profile`).

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

        def draft_fn(rows: int, span: int = K) -> None:
            # as the engine drafts: commit two context positions, one pass over [anchor, MASK x span]
            # (the drafter package's where it takes the shape: `DrafterContext.block_pass`)
            # with logits over the draft vocabulary, and their softmax
            b = min(rows, max_b)
            slots = torch.arange(b, device=dev)
            start = torch.full((b,), context, dtype=torch.long, device=dev)
            flushed = dr.context_kv(engine.pending[:b, :2], start[:, None] + torch.arange(2, device=dev))
            engine.dcache.write_rows(flushed, slots, start)
            W = context + span + 1
            tokens = torch.zeros(b, span + 1, dtype=torch.long, device=dev)
            masked = torch.ones(b, span + 1, dtype=torch.bool, device=dev)
            masked[:, 0] = False
            positions = context + torch.arange(span + 1, device=dev).expand(b, span + 1)
            rope = dr.rope(positions, dr.mask_embedding.dtype, bound=engine.dcache.max_len)
            one_pass = engine.drafting.block_pass(engine.dcache.views(0, b, W), None, rope, b, span + 1, W)
            torch.softmax(one_pass(tokens, masked).float(), -1)

    grid_rows = [r for r in row_grid if r <= max_b] or [1, 2]
    if len(grid_rows) < 2:
        grid_rows = [1, 2]
    # a backend without partial spans (torch.compile) runs whole blocks only
    short = None if draft_fn is None or not engine.backend.partial_span else (lambda rows: draft_fn(rows, 1))
    cost = CostModel.profile(verify_fn, draft_fn, token_grid=token_grid, row_grid=grid_rows, repeats=repeats, sync=sync,
                             short_draft_fn=short, block=K, shuffle_seed=0 if shuffle else None)
    if overhead_steps > 0:
        # autoregressive and speculative steps in alternating short runs (a drift meets both)
        chunks = max(1, min(3, overhead_steps // 4))
        span = min(K, PROFILE_SPAN)
        ar_ms, spec_ms = [], []
        for _ in range(chunks):
            ar_ms += _step_times(engine, context, -(-overhead_steps // chunks), draft_len=0)
            if dr is not None:
                spec_ms += _step_times(engine, context, -(-overhead_steps // chunks), draft_len=span)
        cost.overhead_ms = max(0.0, float(np.median(ar_ms)) - float(cost.verify.at(1.0)))
        if dr is not None:
            cost.span = span  # the tables' prediction for these steps: passes over `span` positions
            extra = max(0.0, float(np.median(spec_ms)) - cost.step_ms_at(float(span + 1), [1]))
            extra /= cost.span_scale()  # the draft table holds whole-block passes
            cost.span = None
            cost.draft_pass = Table(cost.draft_pass.xs.tolist(), (cost.draft_pass.ys + extra).tolist(), "cost.draft_pass")
    return cost


class _FeatureReadingStatic(StaticDecisions):
    """Each request's own knobs, with the draft features computed as for a policy that reads them."""

    reads_draft_features = True


def _step_times(engine, context: int, steps: int, draft_len: int) -> list[float]:
    """Wall times (ms) of ``steps`` real decode steps of one greedy request (s = 1, ``draft_len``
    drafts verified per step) after a ``context``-token prompt (its prefill step not counted)."""
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
    return times[1:] or times  # the first step is the prefill
