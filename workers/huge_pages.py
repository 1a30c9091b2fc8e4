"""A loaded engine's weights moved onto transparent huge pages (2 MB) from 4 KB pages.

A decode step reads every weight once: ~330 MB for SmolLM2's compiled decode package, ~80,000
pages of 4 KB (each a TLB entry to find) or ~160 of 2 MB. On Linux set to
``transparent_hugepage=madvise`` (the common default) memory gets huge pages only where a program
asks, and neither glibc's ``malloc`` (where AOTInductor copies a package's weights) nor torch's
allocator asks. `back_with_huge_pages`, called once an engine is loaded, asks for every large
anonymous region of the process (``madvise(MADV_HUGEPAGE)``) and has the kernel move it onto huge
pages at once (``MADV_COLLAPSE``, Linux 6.1+; older kernels collapse in the background, slowly).

Measured on a 2-core AMD EPYC (AVX-512) VM, SmolLM2 with compiled packages: moving ~840 MB takes
1.8-5.2 s, after which decode forwards run 1.05-1.14x faster (results/ab/smollm2/huge-pages/,
`python -m adapt.bench.instruments.huge_pages`). So engines that live long (`adapt serve`'s
workers, the benchmarks) do it by default (`EngineConfig.huge_pages`); `adapt generate` does not
(a 128-token answer decodes in ~2 s; `--huge-pages` turns it on).

Asking for huge pages on every allocation instead (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, read
at process start) made `adapt generate` decode at 47 and 51 tok/s against 69 and 72 without (runs
alternating): the step's temporary buffers were each faulted in as fresh, zeroed 2 MB pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from pathlib import Path

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman.h
HUGE = 2 << 20  # bytes in a huge page (x86-64, arm64 with 4 KB base pages)
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never); None off Linux."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    return next((w[1:-1] for w in text.split() if w.startswith("[")), None)


def large_anonymous_regions(min_mb: int = 4) -> list[tuple[int, int]]:
    """[(start, end)] of this process's writable anonymous mappings of at least `min_mb` MB
    (/proc/self/maps): where the weights, the compiled packages' constants and the caches live."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        anonymous = len(parts) < 6 or parts[5] == "[heap]"
        if parts[1].startswith("rw") and anonymous and hi - lo >= min_mb << 20:
            out.append((lo, hi))
    return out


def back_with_huge_pages(min_mb: int = 4) -> dict:
    """Ask for huge pages on `large_anonymous_regions` and collapse them now. Returns what
    happened: {"thp": mode, "mb": MB on huge pages after, "collapsed": whether the kernel did it
    at once, "seconds"}; nothing is done where the kernel gives no huge pages (mode never, not Linux)."""
    mode = thp_mode()
    if mode not in ("madvise", "always"):
        return {"thp": mode, "mb": 0, "collapsed": False, "seconds": 0.0}
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    t0 = time.perf_counter()
    collapsed = False
    for lo, hi in large_anonymous_regions(min_mb):
        a, b = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE  # the whole huge pages inside the region
        if b > a:
            libc.madvise(a, b - a, MADV_HUGEPAGE)
            collapsed |= libc.madvise(a, b - a, MADV_COLLAPSE) == 0  # fails in part where a page cannot move
    return {"thp": mode, "mb": huge_page_mb(), "collapsed": collapsed, "seconds": round(time.perf_counter() - t0, 2)}


def huge_page_mb() -> int:
    """MB of this process's anonymous memory on huge pages (``AnonHugePages``,
    /proc/self/smaps_rollup); 0 where it cannot be read."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
