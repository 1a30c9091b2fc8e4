"""`python -m adapt.bench.instruments.source_ceiling`: the oracle that copies where static suffix drafting copied and
drafts by diffusion elsewhere at the adaptive policy's measured rate."""

from __future__ import annotations

import pytest

from adapt.bench.instruments import source_ceiling


def _script():
    return source_ceiling


def _records(rid: str, steps: list[tuple[str, int, float]], temperature: float = 0.0) -> list[dict]:
    return [{"request_id": rid, "temperature": temperature, "source": s, "accepted": a, "step_ms": ms}
            for s, a, ms in steps]


def test_the_oracle_drafts_by_diffusion_where_static_suffix_drafting_stepped_plainly():
    sc = _script()
    # static: 2 copy steps (4 tokens each, 20 ms) and 8 plain steps (1 token, 15 ms): 16 tokens, 160 ms
    static = _records("suffix-c1-7-0", [("suffix", 3, 20.0)] * 2 + [("none", 0, 15.0)] * 8)
    # adaptive: diffusion steps at 2 tokens per 20 ms (0.1 / ms, against plain 1 / 15 ms)
    adaptive = _records("adaptive-c1-9-0", [("suffix", 3, 20.0)] * 2 + [("diffusion", 1, 20.0)] * 4)
    out = sc.ceiling(sc.by_source(static, "mixed"), sc.by_source(adaptive, "mixed"))
    (row,) = out["rows"]
    assert (row["kind"], row["greedy"], row["tokens"]) == ("chat", True, 16)
    # the oracle: 40 ms of copies, 8 plain tokens at 0.1 / ms = 80 ms
    assert out["oracle_gain"] == pytest.approx(160.0 / 120.0, abs=1e-3)
    assert out["adaptive_gain"] == pytest.approx((16 / 120.0) / (16 / 160.0), abs=1e-3)
    assert row["diffusion_tok_s"] == 100.0 and row["plain_tok_s"] == pytest.approx(66.7)


def test_a_slower_diffusion_rate_never_makes_the_oracle_slower_than_static():
    sc = _script()
    static = _records("suffix-c1-7-1", [("none", 0, 10.0)] * 4)
    adaptive = _records("adaptive-c1-9-1", [("diffusion", 0, 30.0)] * 4)
    out = sc.ceiling(sc.by_source(static, "code"), sc.by_source(adaptive, "code"))
    assert out["oracle_gain"] == 1.0 and out["rows"][0]["kind"] == "code"


def test_what_if_prices_cheaper_or_better_diffusion_steps():
    sc = _script()
    static = _records("suffix-c1-7-2", [("none", 0, 10.0)] * 10)  # 10 tokens in 100 ms
    # adaptive: 5 diffusion steps winning 1 draft each in 20 ms, 2 plain steps of 10 ms: 12 tokens, 120 ms
    adaptive = _records("adaptive-c1-9-2", [("diffusion", 1, 20.0)] * 5 + [("none", 0, 10.0)] * 2)
    out = sc.what_if(static, adaptive, faster_ms=(2.0, 50.0), more_accepted=(0.4,))
    assert out["diffusion_steps"] == 5 and out["decode_ms"] == 120.0
    assert out["gain"] == pytest.approx(1.0)
    assert out["diffusion_faster_ms"]["2.0"] == pytest.approx((12 / 110) / 0.1, abs=1e-3)
    assert out["diffusion_faster_ms"]["50.0"] == pytest.approx((12 / 20.5) / 0.1, abs=1e-3)  # floored at 0.1 ms
    assert out["diffusion_more_accepted"]["0.4"] == pytest.approx((14 / 120) / 0.1, abs=1e-3)
