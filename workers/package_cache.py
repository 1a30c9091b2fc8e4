"""The compiled packages' folder: where packages live, what their keys cover, listing and removing them.

A **package** is one program compiled ahead of time (workers/aot.py): the target's decode step
(`decode-<key>.pt2`) and, on some CPUs, its one-row steps (`onerow-<key>.pt2`), the drafter's
denoising pass (`draft-<key>.pt2`) or its context commit (`context-<key>.pt2`), each with a
facts file beside it (`<kind>-<key>.json`: what it was built for). Its key covers the source of
the code it compiled (`KIND_SOURCES`); this module is not among those files, so changing how the
folder is listed or pruned leaves every package valid.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from workers.pull import cache_root

PACKAGE_FORMAT = 1
SOURCES = ("aot.py", "target_model.py", "layers.py", "kv_cache.py")  # in workers/: the forward's code
DRAFT_SOURCES = ("aot.py", "drafter.py", "layers.py", "kv_cache.py")  # the drafter pass's code
CONTEXT_SOURCES = (*DRAFT_SOURCES, "target_model.py")  # the context commit's code (its cache write: `write_kv`)
PACKAGE_KINDS = ("decode", "onerow", "draft", "context")  # file name prefixes: <kind>-<key>.pt2
KIND_SOURCES = dict(zip(PACKAGE_KINDS, (SOURCES, SOURCES, DRAFT_SOURCES, CONTEXT_SOURCES)))


def source_digest(sources: tuple[str, ...]) -> str:
    """sha256 over the code a package compiled (`sources`, files in workers/)."""
    here = Path(__file__).resolve().parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in sources)).hexdigest()


def package_key(facts: dict, weights: str) -> str:
    """The key in a package's file name: a digest of its facts and its weights' digest."""
    return hashlib.sha256(json.dumps({**facts, "weights": weights}, sort_keys=True).encode()).hexdigest()[:24]


def package_dir(cache_dir: str | Path | None = None) -> Path:
    """Where packages live: <cache>/aot (workers/pull.py's cache root)."""
    return cache_root(cache_dir) / "aot"


def facts_files(folder: Path, prefix: str) -> list[dict]:
    """The facts written beside each `prefix` package in `folder` (workers/aot.py `package_facts`,
    `one_row_facts`, `draft_facts` or `context_facts`, plus "built_s" and, for a one-row program, its "verdict")."""
    return [json.loads(f.read_text()) for f in sorted(folder.glob(f"{prefix}-*.json"))] if folder.is_dir() else []


def _package_files(folder: Path) -> list[Path]:
    """The packages in `folder`: the targets' decode steps and one-row steps, the drafters' passes,
    their context commits."""
    return [p for kind in PACKAGE_KINDS for p in sorted(folder.glob(f"{kind}-*.pt2"))]


def list_packages(cache_dir: str | Path | None = None) -> list[dict]:
    """The packages in the cache directory: path, kind, size in MB and the facts they were built for
    (none where the facts file beside one is missing or unreadable)."""
    out = []
    for pt2 in _package_files(package_dir(cache_dir)):
        meta = pt2.with_suffix(".json")
        try:
            facts = json.loads(meta.read_text()) if meta.is_file() else {}
        except (OSError, ValueError):
            facts = {}
        kind = pt2.name.split("-", 1)[0]  # one of PACKAGE_KINDS
        out.append({"path": str(pt2), "kind": kind, "mb": round(pt2.stat().st_size / 2**20, 1), **facts})
    return out


def stale_packages(cache_dir: str | Path | None = None) -> list[Path]:
    """The packages no engine of this installation can load: built from other code (their
    kind's `source_digest` differs: any change to the files of `KIND_SOURCES` makes new keys), by
    another torch or in another package format, or without the facts file written beside each.
    Packages for other models, engine shapes or CPU capabilities (a cache directory shared by
    machines) are not stale."""
    current = {kind: source_digest(sources) for kind, sources in KIND_SOURCES.items()}
    return [Path(pkg["path"]) for pkg in list_packages(cache_dir)
            if pkg.get("source") != current[pkg["kind"]] or pkg.get("torch") != torch.__version__
            or pkg.get("format") != PACKAGE_FORMAT]


def remove_stale_packages(cache_dir: str | Path | None = None) -> tuple[int, float]:
    """Delete `stale_packages` and their facts files; returns (how many, MB freed)."""
    stale = stale_packages(cache_dir)
    mb = 0.0
    for pt2 in stale:
        mb += pt2.stat().st_size / 2**20
        pt2.unlink()
        pt2.with_suffix(".json").unlink(missing_ok=True)
    return len(stale), round(mb, 1)


def remove_packages(cache_dir: str | Path | None = None) -> int:
    """Delete every package (and its facts file); returns how many packages there were."""
    folder = package_dir(cache_dir)
    n = len(_package_files(folder))
    if folder.is_dir():
        shutil.rmtree(folder)
    return n
