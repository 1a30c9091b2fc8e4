"""`adapt bench startup`'s parts: a cold process timed to its first stdout byte and its exit, the
stats line it reads, and the empty cache directory a first run gets (the pulled model linked in)."""

from __future__ import annotations

import os
import sys

import pytest

from adapt.bench.startup import _stats_line, fresh_cache, markdown, timed_process


def test_a_process_is_timed_to_its_first_byte_and_its_exit():
    code = "import sys, time; time.sleep(0.3); print('a', flush=True); time.sleep(0.5); print('[3 tokens]', file=sys.stderr)"
    r = timed_process([sys.executable, "-c", code], dict(os.environ), timeout=60)
    assert 0.3 <= r["first_token_s"] < r["end_s"] and r["end_s"] - r["first_token_s"] >= 0.45
    assert r["text"].strip() == "a" and _stats_line(r["stderr_tail"]) == {"tokens": 3}
    with pytest.raises(RuntimeError, match="exited 3"):
        timed_process([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ), timeout=60)


def test_the_adapt_stats_line_is_read():
    line = ("adapt: dtype bfloat16 (measured in 2.5 s): ...\nadapt: profiled in 4.1 s\n"
            "[128 tokens, tau 1.41, 27 tok/s, tvd spent 0.000, decode steps: eager, length]\n")
    assert _stats_line(line) == {"tokens": 128, "tau": 1.41, "decode_tok_s": 27.0, "dtype_choice_s": 2.5,
                                 "profile_s": 4.1}


def test_a_first_run_gets_an_empty_cache_with_the_model_linked(tmp_path):
    model = tmp_path / "pulled" / "smollm2-135m-instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    root = fresh_cache(model, tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["models"]
    assert (root / "models" / model.name / "config.json").read_text() == "{}"


def test_the_markdown_table_has_a_row_per_process():
    summary = {"transformers": {"first_token_s": 2.0, "end_s": 6.0, "tokens": 128},
               "adapt later run": {"first_token_s": 3.0, "end_s": 5.0, "tokens": 128,
                                   "first_token_vs_transformers": 1.5, "end_vs_transformers": 0.833}}
    md = markdown({"machine": {"cpu": "X", "cores": 2, "flags": ["avx2"], "torch": "2"}, "max_tokens": 128,
                   "runs": [{}] * 6, "commit": "abc", "date": "d", "summary": summary})
    assert "| adapt later run | 3.00 | 5.00 | 128 | 1.50 | 0.83 |" in md and "X, 2 cores" in md
