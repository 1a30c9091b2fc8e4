"""The evaluation mix that the live benchmarks and the measurement scripts serve, priced on one engine.

Words used here:
- **profiled policy file**: a policy file whose cost tables were replaced by a start-up profile of
  the engine that will serve it (`adapt.controller.profile_engine`), as a worker does at start-up.
- **tight TPOT target**: the evaluation mix's tight latency target, the cost model's step over a
  whole drafter block at one row; the loose target is four times it (`adapt.replay.make_mix`: one
  request in three gets the tight one).
"""

from __future__ import annotations

import torch

from adapt.replay import RequestSpec, make_mix


def profiled_policy_file(path, engine):
    """The policy file at `path` with its cost tables from a start-up profile of `engine`."""
    from adapt.controller import profile_engine
    from adapt.policy_file import load

    pf = load(str(path))
    pf.cost = profile_engine(engine)
    return pf


def tight_tpot_ms(cost, block: int) -> float:
    """The evaluation mix's tight TPOT target (ms): `cost`'s step verifying a whole block of
    `block` drafts at one row."""
    return float(cost.step_ms(float(block + 1), torch.tensor([1])))


def evaluation_mix(cost, block: int, requests: int, *, max_tokens: int = 64, length_spread: float = 0.5,
                   tight_ms: float | None = None) -> list[RequestSpec]:
    """`requests` requests of the evaluation mix (`adapt.replay.make_mix`) with TPOT targets
    `tight_ms` (default `tight_tpot_ms(cost, block)`) and four times it."""
    t1 = tight_tpot_ms(cost, block) if tight_ms is None else float(tight_ms)
    return make_mix(requests, t1, 4 * t1, max_tokens=max_tokens, length_spread=length_spread)
