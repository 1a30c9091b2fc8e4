"""The processes of one local Ray instance, found by its temp directory (``RAY_TMPDIR`` /
``--temp-dir``), for tests that start Ray and must stop or check only their own."""

from __future__ import annotations

import psutil


def with_descendants(roots) -> set[psutil.Process]:
    """``roots`` and every process under them (those that have exited are left out)."""
    procs = set(roots)
    for root in roots:
        try:
            procs.update(root.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return procs


def processes_under(tmpdir: str) -> set[psutil.Process]:
    """The processes whose command line names ``tmpdir`` (Ray's GCS, raylets, dashboard), and their
    children (Ray's workers name themselves ``ray::...``)."""
    roots = [p for p in psutil.process_iter(["cmdline"]) if tmpdir in " ".join(p.info["cmdline"] or [])]
    return with_descendants(roots)
