"""The policy tuning notebook runs as shipped, on the traces of the default pair that ship with it,
shows its plots and writes a loadable policy; the instrument that makes those traces works."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from adapt import policy_file
from adapt.trace_data import TraceTable

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "policy_tuning.ipynb"
SHIPPED = ROOT / "notebooks" / "data" / "smollm2-traces.jsonl"


def _set_env(values: dict[str, str | None]) -> None:
    """Set each variable, or unset it where its value is None."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_the_shipped_notebook_fits_a_policy_from_the_shipped_smollm2_traces(tmp_path):
    assert 0 < SHIPPED.stat().st_size < 1_000_000  # small enough to ship
    out = tmp_path / "policy.json"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"ADAPT_TRACES": None, "ADAPT_POLICY_OUT": str(out)}  # the notebook's own default input
    old = {k: os.environ.get(k) for k in env}
    _set_env(env)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        _set_env(old)
    loaded = policy_file.load(out)
    assert loaded.policy == "adaptive"
    assert loaded.predictor.fitted and loaded.report["draft"]["test_points"] > 0  # fitted on the traces
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert f"trace rows from {SHIPPED.relative_to(ROOT)}" in text
    assert "acceptance per position" in text and "goodput_tok_s" in text and "ece_uncalibrated" in text
    # acceptance per position, the reliability diagram and the frontier
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3


def test_the_traces_instrument_writes_explore_records_a_table_reads(tmp_path):
    from adapt.bench.instruments.traces import main

    out = tmp_path / "traces.jsonl"
    assert main(["--pair", "demo", "--requests", "2", "--loads", "1,2", "--max-tokens", "8", "--out", str(out)]) == 0
    table = TraceTable.read(str(out))
    assert len(table) >= 4 and int(table.draft_len.max()) > 0  # explore drafts
