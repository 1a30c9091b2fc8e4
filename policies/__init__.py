"""Decision policies: who chooses diffusion steps, draft length and acceptance rule each step.

Every policy is a `DecisionMaker` (docs/contracts.md §5; docs/policies.md) and a subclass of
`policies.base.Policy`. Get one by name:

    import policies
    policies.names()                          # ['adaptive', 'batch-schedule', 'dspark', 'static']
    p = policies.get("static", steps=1, draft_len=8)
    p = policies.get("adaptive", predictor=..., cost=...)   # fitted parts: adapt.controller.build_policy

| name | what it does |
|---|---|
| static | fixed s, k and rule for every row (ε rows use their ε unless rule='exact') |
| batch-schedule | k looked up from the batch size (vLLM / TRT-LLM style), fixed s |
| dspark | DSpark's greedy prefix scheduler: exact rules, fixed s, k per row by survival |
| adaptive | ours: s, k and leniency per row, weighted by SLA lateness, within quality budgets |
| explore | data collection: full block, random s, random leniency (for replayable traces) |

`register(name)` adds a policy class; the engine, the replay evaluator (`adapt.replay`) and the
benchmarks all build policies through `get`.
"""

from __future__ import annotations

_REGISTRY: dict[str, str] = {
    "static": "policies.static:StaticPolicy",
    "batch-schedule": "policies.batch_schedule:BatchSchedulePolicy",
    "dspark": "policies.dspark:DSparkPolicy",
    "adaptive": "policies.adaptive:AdaptivePolicy",
    "explore": "policies.explore:ExplorePolicy",
}


def register(name: str, target) -> None:
    """Register a policy class (or a "module:Class" string) under ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError("name: a policy needs a non-empty string name")
    _REGISTRY[name] = target


def names() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"policy: unknown policy {name!r} (known: {', '.join(names())})")
    target = _REGISTRY[name]
    if isinstance(target, str):
        import importlib

        module, _, cls = target.partition(":")
        target = getattr(importlib.import_module(module), cls)
    return target


def get(name: str, **settings):
    """A new policy instance; ``settings`` are the policy's keyword settings (docs/policies.md)."""
    try:
        return policy_class(name)(**settings)
    except TypeError as exc:
        raise ValueError(f"policy {name!r}: bad settings ({exc})") from None
