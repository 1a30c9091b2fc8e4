"""Benchmarks (`adapt bench`: speed, policies, kernels, ab, forward, load, flood, ...), the GPU check, and
maintainers' profiling instruments (`adapt.bench.instruments`); docs/instruments.md lists them."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, data) -> None:
    """Write a benchmark's result ``data`` as indented JSON to ``path``, making its folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
