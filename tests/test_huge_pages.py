"""Engines' memory moved onto transparent huge pages (workers/huge_pages.py): the mode read from the
kernel, the regions found, the data kept, huge pages really given where the kernel gives them."""

from __future__ import annotations

import platform
import tempfile
from pathlib import Path

import torch

from workers import huge_pages


def test_thp_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never")):
        f.write_text(text)
        monkeypatch.setattr(huge_pages, "_THP_MODE", f)
        assert huge_pages.thp_mode() == mode
    monkeypatch.setattr(huge_pages, "_THP_MODE", tmp_path / "missing")
    assert huge_pages.thp_mode() is None


def test_nothing_is_moved_where_the_kernel_gives_no_huge_pages(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_MODE", f)
    assert huge_pages.back_with_huge_pages() == {"thp": "never", "mb": 0, "collapsed": False, "seconds": 0.0}


def _huge_kb_at(address: int) -> int:
    """AnonHugePages (KB) of the mapping of this process that holds `address`."""
    current = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= address < hi
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _kernel() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def test_a_large_tensor_lands_on_huge_pages_with_its_data_intact():
    mode = huge_pages.thp_mode()
    weights = torch.arange(16 << 20, dtype=torch.float32)  # 64 MB, 4 KB pages (torch asks for none)
    expected = weights.clone()
    address = weights.data_ptr()
    assert any(lo <= address < hi for lo, hi in huge_pages.large_anonymous_regions())
    moved = huge_pages.back_with_huge_pages()
    assert torch.equal(weights, expected)
    assert moved["thp"] == mode
    if mode in (None, "never"):
        assert moved["mb"] == 0 and not moved["collapsed"]
        return
    if _kernel() >= (6, 1):  # MADV_COLLAPSE: moved at once, at least the tensor's whole huge pages
        # madvise splits the mapping at huge page bounds: look inside the tensor, past its first one
        inside = [_huge_kb_at(address + (n << 21)) for n in (2, 16, 30)]
        assert moved["collapsed"] and min(inside) >= 2 << 10 and moved["mb"] >= 60, inside
    assert moved["mb"] == huge_pages.huge_page_mb()


def test_an_engine_moves_its_memory_unless_told_not_to():
    from tests.tiny_models import make_tiny_pair
    from workers.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory() as d:
        target, drafter = make_tiny_pair(Path(d), vocab=256, seed=1)
        config = dict(target=str(target), drafter=str(drafter), dtype="float32", max_batch=2, max_len=64)
        assert Engine(EngineConfig(**config, huge_pages=False)).huge_pages is None
        moved = Engine(EngineConfig(**config)).huge_pages
    assert moved is not None and moved["thp"] == huge_pages.thp_mode()
