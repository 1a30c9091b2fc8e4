"""Loading an AOTInductor package without leaving its extracted copy behind.

torch's loader (`torch._inductor.aoti_load_package`) extracts a package into a fresh folder
under the temporary directory (``$TMPDIR/aotinductor_XXXXXX``: the shared library and its
weights, as large as the package: ~320 MB for SmolLM2's decode step) and removes it only when the
loader object is destroyed. A process that ends without destroying it (a Ray worker stopped at
shutdown, ``os._exit``, a killed benchmark subprocess) left that folder behind on every load, and
a machine serving for days filled its disk. Once loaded, the library is mapped into the process
(Linux keeps a mapped file's data until it is unmapped), so `load_package` extracts into a
scratch folder of its own and removes it as soon as the package is loaded.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import torch

_ENV_LOCK = threading.Lock()  # TMPDIR is process-wide: one load at a time swaps it


def load_package(path: str | Path):
    """The runner of the package at ``path`` (`torch._inductor.aoti_load_package`), its
    extracted copy already removed from disk."""
    tempfile.gettempdir()  # fix Python's own temporary directory first: it is read once, from TMPDIR
    with _ENV_LOCK, tempfile.TemporaryDirectory(prefix="adapt-package-") as scratch:
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = scratch  # torch's C++ loader extracts under $TMPDIR
        try:
            return torch._inductor.aoti_load_package(str(path))
        finally:
            if before is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = before
