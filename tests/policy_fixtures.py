"""Trace records from a known acceptance process, for unit tests of fitting and replay.

Each synthetic request has a difficulty; the drafter's per-position confidence rises with the
number of diffusion steps and falls with position; the true conditional acceptance of a position
is ``confidence ** 1.3`` (exact rules) and ``c + eps (1 - c)`` under an ε-TVD rule. Because the
truth is known, tests can check that a fitted predictor is calibrated and that a replay of
a policy reproduces the logged acceptance.
"""

from __future__ import annotations

import json

import numpy as np

from workers.decisions import RECENT_NONE, next_recent_accept
from workers.traces import TRACE_VERSION


def synthetic_records(num_requests: int = 60, steps_per_request: int = 30, K: int = 8, seed: int = 0,
                      step_grid=(1, 2, 3, 4), eps_grid=(0.0,), temperature: float = 0.7,
                      batch_size: int = 8) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    step_counter = 0
    for r in range(num_requests):
        difficulty = rng.uniform(-0.5, 2.5)
        recent = RECENT_NONE
        generated = 0
        for t in range(steps_per_request):
            s = int(rng.choice(step_grid))
            eps = float(rng.choice(eps_grid))
            z = difficulty + 0.35 * (s - 1) - 0.25 * np.arange(K) + rng.normal(0, 0.6, K)
            conf = 1 / (1 + np.exp(-z))
            c = conf ** 1.3
            if eps > 0:
                c = c + eps * (1 - c)
            coins = rng.random(K) < c
            accepted = int(np.argmin(coins)) if not coins.all() else K
            flags = [1] * accepted + [0] * (K - accepted)
            entropy = -(conf * np.log(conf) + (1 - conf) * np.log((1 - conf) / 100 + 1e-9))
            rule = 3 if eps > 0 else (1 if temperature > 0 else 0)
            records.append({
                "v": TRACE_VERSION, "request_id": f"r{r}", "step": step_counter, "time": 1764480000.0 + step_counter * 0.01,
                "position": 64 + generated, "generated": generated, "temperature": temperature,
                "recent_accept": recent, "batch_size": batch_size, "num_tokens": batch_size * (K + 1),
                "steps": s, "draft_len": K, "rule": rule, "param": eps, "param2": 0.0,
                "commit_order": "left-to-right",
                "confidence": conf.round(5).tolist(), "entropy": entropy.round(5).tolist(),
                "margin": (conf - (1 - conf) / 2).round(5).tolist(),
                "accepted": accepted, "accept_flags": flags, "tvd_spent": eps * min(accepted + 1, K) * 0.5,
                "draft_ms": 2.0 + 0.3 * s * batch_size, "verify_ms": 5.0 + 0.1 * batch_size * (K + 1),
                "step_ms": 7.5 + 0.3 * s * batch_size + 0.1 * batch_size * (K + 1),
            })
            step_counter += 1
            generated += accepted + 1
            recent = next_recent_accept(recent, accepted, K)
    return records


def write_jsonl(records: list[dict], path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for rec in records:
            handle.write(json.dumps(rec) + "\n")
