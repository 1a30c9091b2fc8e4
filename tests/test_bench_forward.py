"""`adapt bench forward`: target forward and drafter pass per width on the demo pair, and the forward's variants."""

from __future__ import annotations

import json

import pytest

from adapt.bench import forward_speed


def test_forward_widths_times_every_token_count_and_span(tmp_path):
    out = tmp_path / "widths.json"
    assert forward_speed.main(["widths", "--pair", "demo", "--compile", "off", "--max-tokens", "6",
                                                "--sweeps", "2", "--context", "32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["target_forward_ms"]) == [str(t) for t in range(1, 7)]
    assert len(result["drafter_pass_ms"]) == 16  # the demo drafter's block
    assert all(v > 0 for v in [*result["target_forward_ms"].values(), *result["drafter_pass_ms"].values()])


def test_forward_widths_times_the_forward_after_each_context(tmp_path):
    """``--contexts``: the target forward per token count after each prompt length as well, in the
    same sweeps; a bad list is refused, naming the option."""
    out = tmp_path / "contexts.json"
    assert forward_speed.main(["widths", "--pair", "demo", "--compile", "off", "--max-tokens", "3", "--sweeps", "2",
                        "--context", "32", "--contexts", "48,16,48", "--out", str(out)]) == 0
    by_context = json.loads(out.read_text())["target_forward_ms_by_context"]
    assert list(by_context) == ["16", "48"]
    assert all(list(row) == ["1", "2", "3"] and min(row.values()) > 0 for row in by_context.values())
    for bad in ("64,x", "0"):
        with pytest.raises(SystemExit):
            forward_speed.main(["widths", "--pair", "demo", "--contexts", bad])


def test_forward_variants_time_every_variant_and_shape_in_turns(tmp_path):
    """`adapt bench forward variants`: the demo target's variants (plain, fused, packed, the engine's
    default) at each (rows, tokens) shape, each timing positive."""
    out = tmp_path / "variants.json"
    assert forward_speed.main(["variants", "--iters", "1", "--rounds", "1", "--context", "16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["threads"] == 1 and report["dtype"] == "bfloat16" and report["compile_s"] is None
    assert list(report["forward_ms"]) == ["B=1 T=1", "B=1 T=17", "B=8 T=1", "B=8 T=17"]
    for shape in report["forward_ms"].values():
        assert all(shape[v] > 0 for v in ("plain", "fused", "fused+packed", "fused+sa"))
        assert shape["fused+sa/plain"] == pytest.approx(shape["fused+sa"] / shape["plain"], abs=2e-3)
