"""The demo corpus: the Python standard library's own source, shipped with every interpreter.

Held-out split: a file is held out for evaluation when the first byte of the SHA-1 of its
path relative to the stdlib root (POSIX separators) is below 13, i.e. ~5 % of files, chosen
by name only so every machine with the same Python version picks the same files.
Test suites (`test/`, `tests/`, `idle_test/`) and `site-packages` are excluded entirely.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
HELD_OUT_BYTE_BELOW = 13


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """True for the files kept out of training (evaluation only)."""
    return hashlib.sha1(relative_path.encode()).digest()[0] < HELD_OUT_BYTE_BELOW


def stdlib_files(split: str) -> list[Path]:
    """Sorted stdlib `.py` files of one split: "train", "heldout" or "all"."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if EXCLUDED_PARTS.intersection(rel.split("/")[:-1]):
            continue
        held = is_held_out(rel)
        if split == "all" or (split == "heldout") == held:
            files.append(path)
    return files


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts
