"""The policy tuning notebook runs end to end on real engine traces and writes a loadable policy."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from adapt import policy_file
from tests.tiny_models import make_tiny_pair
from workers.engine import Engine, EngineConfig
from workers.request import DecodeKnobs, SamplingParams
from workers.traces import FileTraceSink

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "policy_tuning.ipynb"


@pytest.fixture(scope="module")
def engine_traces(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("nb")
    target, drafter = make_tiny_pair(tmp, train_steps=60)
    path = tmp / "traces.jsonl"
    sink = FileTraceSink(path)
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=8, max_len=256),
                    trace_sink=sink)
    for i in range(8):
        knobs = DecodeKnobs(steps=1 + i % 2, draft_len=8,
                            quality="lossless" if i % 3 else "tvd=0.1", commit_order="left-to-right")
        params = SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i)
        engine.add_request(f"r{i}", list(range(3 + i, 15 + i)), params, knobs)
    while engine.has_unfinished():
        engine.step()
    sink.close()
    assert path.stat().st_size > 0
    return path


def test_notebook_fits_a_policy_from_engine_traces(engine_traces, tmp_path):
    out = tmp_path / "policy.json"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"ADAPT_TRACES": str(engine_traces), "ADAPT_POLICY_OUT": str(out)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(NOTEBOOK.parents[1])}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    loaded = policy_file.load(out)
    assert loaded.policy == "adaptive"
    assert loaded.predictor.fitted and loaded.report["draft"]["test_points"] > 0  # fitted on the traces, not the stand-in
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "acceptance per position" in outputs and "goodput_tok_s" in outputs
