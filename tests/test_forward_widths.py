"""scripts/forward_widths.py: target forward and drafter pass per width, on the demo pair."""

from __future__ import annotations

import json

from tests.script_loader import load_script


def test_forward_widths_times_every_token_count_and_span(tmp_path):
    out = tmp_path / "widths.json"
    assert load_script("forward_widths").main(["--pair", "demo", "--compile", "off", "--max-tokens", "6",
                                                "--sweeps", "2", "--context", "32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result["target_forward_ms"]) == [str(t) for t in range(1, 7)]
    assert len(result["drafter_pass_ms"]) == 16  # the demo drafter's block
    assert all(v > 0 for v in [*result["target_forward_ms"].values(), *result["drafter_pass_ms"].values()])
