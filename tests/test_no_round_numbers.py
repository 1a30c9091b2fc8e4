"""The project states what is true now and why; *when* is git log's business. A numbered work round
(the word "stop" and its number) means nothing to a reader, so no tracked text file of the project's
folders may name one (comments, docstrings, docs, results, file names alike)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("README.md", "docs", "adapt", "workers", "kernels", "policies", "tests", "scripts", "results", "notebooks",
           "models", "deploy")
ROUND = re.compile(r"\bstops?[ -][0-9]+", re.IGNORECASE)


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *FOLDERS], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in filter(None, out.decode().split("\0")):
        path = ROOT / name
        if ".venv" in path.parts or not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" in head:  # binary (images, weights)
            continue
        files.append(path)
    return files


def test_the_pattern_catches_round_numbers():
    word = "st" + "op"  # spelled apart, so that this file does not match its own pattern
    for text in (f"{word.title()} 52 measured", f"before {word} 46", f"{word}s 22-26", f"the {word}-34 drafter"):
        assert ROUND.search(text), text
    for text in ("stop-first verification", "stops at EOS", "stop_tokens", "nonstop 3"):
        assert not ROUND.search(text), text


def test_no_file_names_a_work_round():
    files = tracked_text_files()
    assert len(files) > 100  # the scan sees the project
    hits = []
    for path in files:
        rel = path.relative_to(ROOT)
        if ROUND.search(str(rel).replace("_", " ")):
            hits.append(f"{rel}: its name")
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if ROUND.search(line):
                hits.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not hits, "say why (the measured reason), not when:\n" + "\n".join(hits[:50])
