"""Atomic file writes: readers see the old file or the new one, never half of either.

The text goes to a temporary file in the same directory (so the rename stays on one file
system) and `os.replace` swaps it in; a failure removes the temporary file and leaves the old
file as it was.
"""

from __future__ import annotations

import os
import tempfile


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically, creating its directory if needed."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
