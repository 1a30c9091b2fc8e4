"""`adapt bench report`: the README's results table and docs/benchmarks.md's are exactly what
`--render-only` renders from the files under results/, so a number can never drift from its file.

Running the benchmarks themselves is `adapt bench speed` / `adapt bench policies`' business (their
own tests); here the rendering, the markers and the metadata each results folder must carry.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adapt.bench import report
from adapt.cli import main
from workers.cpu_capability import CAPABILITY_FLAGS

ROOT = Path(__file__).resolve().parents[1]


def _between(text: str) -> str:
    i, j = text.index(report.START), text.index(report.END)
    return text[i:j + len(report.END)]


@pytest.mark.parametrize("doc, base", [("README.md", ""), ("docs/benchmarks.md", "../")])
def test_table_equals_the_render_of_results(doc, base):
    rendered = report.render_table(ROOT / "results", base=base)
    assert _between((ROOT / doc).read_text(encoding="utf-8")) == rendered, (
        f"{doc}'s results table differs from the results files: run `adapt bench report --render-only`")


def test_every_headline_has_its_files_and_rows():
    rendered = report.render_table(ROOT / "results")
    for h in report.HEADLINES:
        out = report.folder(ROOT / "results", h.name, "smollm2")
        meta = json.loads((out / "run.json").read_text(encoding="utf-8"))
        assert meta["command"].startswith(f"adapt bench {h.benchmark} ")
        assert meta["commit"] and meta["date"] and meta["machine"]["cores"] >= 1
        assert (out / "README.md").read_text(encoding="utf-8") == report.folder_readme(meta, h.benchmark, "smollm2")
        rows = report.RENDERERS[h.benchmark](out)
        assert rows, f"{out}: no rows to report"
        for what, number, _ in rows:
            assert f"| {what} | {number} |" in rendered


def test_render_only_rewrites_both_tables(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results" / "speed" / "smollm2", results / "speed" / "smollm2")
    speed = json.loads((results / "speed" / "smollm2" / "speed.json").read_text(encoding="utf-8"))
    for r in speed["results"]:  # a changed result must show in the rewritten tables
        if r["row"] == "adapt-policy" and r["batch"] == 1:
            r["tokens_per_s"] = 123.4
    (results / "speed" / "smollm2" / "speed.json").write_text(json.dumps(speed), encoding="utf-8")
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    for path in (readme, docs):
        path.write_text(f"before\n{report.START}\nstale\n{report.END}\nafter\n", encoding="utf-8")
    assert main(["bench", "report", "--render-only", "--results", str(results), "--readme", str(readme),
                 "--docs", str(docs)]) == 0
    for path in (readme, docs):
        text = path.read_text(encoding="utf-8")
        assert text.startswith("before\n") and text.endswith("\nafter\n") and "stale" not in text
        assert "123 against" in text and "results/policies/" not in text  # only the files that are there


def test_a_document_without_markers_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="markers"):
        report.replace_table("no table here\n", "x", "doc.md")


def test_machine_names_cpu_flags_and_cores():
    m = report.machine()
    assert m["cpu"] and m["cores"] >= 1 and set(m["flags"]) <= set(CAPABILITY_FLAGS)


def test_vllm_rows_become_a_row_against_the_faster_of_the_two(tmp_path):
    """Where the speed run measured vLLM's rows, the table says how the adaptive policy does against the
    faster of `vllm` and `vllm-ngram` at each batch size; where it did not, there is no such row."""
    out = tmp_path / "speed"
    shutil.copytree(ROOT / "results" / "speed" / "smollm2", out)
    speed = json.loads((out / "speed.json").read_text(encoding="utf-8"))
    speed["results"] = [r for r in speed["results"] if not r["row"].startswith("vllm")]
    (out / "speed.json").write_text(json.dumps(speed), encoding="utf-8")
    assert not any("against vLLM" in what for what, _, _ in report._speed_rows(out))
    ours = next(r["tokens_per_s"] for r in speed["results"] if r["row"] == "adapt-policy" and r["batch"] == 1)
    speed["results"] += [{"row": "vllm", "batch": 1, "tokens_per_s": ours / 2},
                         {"row": "vllm-ngram", "batch": 1, "tokens_per_s": ours / 1.6}]
    (out / "speed.json").write_text(json.dumps(speed), encoding="utf-8")
    rows = [r for r in report._speed_rows(out) if "against vLLM" in r[0]]
    assert len(rows) == 1 and "batch 1" in rows[0][0]
    assert rows[0][1].startswith("**1.60×**") and "`vllm-ngram` here" in rows[0][2]


def test_a_mix_of_prompt_classes_becomes_a_row_per_class(tmp_path):
    """A speed run over a mix of prompt classes (`--workload longdoc-chat`) is reported per class:
    the adaptive policy against the fastest static row on that class, over `adapt-ar`, and vLLM's
    rates on the same prompts."""
    def row(name, per_class):
        return {"row": name, "batch": 1, "tokens_per_s": 1.0, "tau": 1.0, "per_class": {
            cls: {"tokens_per_s": r, "tokens_per_s_samples": [r], "tau": t} for cls, (r, t) in per_class.items()}}

    speed = {"config": {"prompts": "workload longdoc-chat", "compile": "aot", "batch_sizes": [1], "num_prompts": 4,
                        "max_tokens": 128, "interleave": True, "prompt_classes": ["longdoc", "chat"] * 2},
             "results": [row("adapt-ar", {"longdoc": (30.0, 1.0), "chat": (50.0, 1.0)}),
                         row("adapt-suffix", {"longdoc": (40.0, 1.6), "chat": (60.0, 1.4)}),
                         row("adapt-policy", {"longdoc": (39.0, 1.7), "chat": (75.0, 1.9)}),
                         row("vllm", {"longdoc": (31.0, 1.0), "chat": (52.0, 1.0)})]}
    from adapt.bench.speed import class_ratios

    speed["ratios"] = {"per_class": class_ratios(speed["results"], [1])}
    (tmp_path / "speed.json").write_text(json.dumps(speed), encoding="utf-8")
    rows = report._speed_rows(tmp_path)
    assert [what.split(", ")[3] for what, _, _ in rows] == ["longdoc class: 2 of 4 prompts (workload longdoc-chat) × 128 tokens",
                                                            "chat class: 2 of 4 prompts (workload longdoc-chat) × 128 tokens"]
    (longdoc, n1, against1), (_, n2, _) = rows
    assert n1.startswith("**0.975×**; 39.0 against 40.0 tok/s, τ 1.70 against 1.60; 1.30× `adapt-ar` (rounds 1.300)")
    assert n1.endswith("; vllm 31.0 tok/s") and "`adapt-suffix` of `adapt-ar`, `adapt-suffix`" in against1
    assert n2.startswith("**1.25×**")
