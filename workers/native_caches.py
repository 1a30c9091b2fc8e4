"""Bounds on the caches of torch's CPU math libraries in a long-running decoder process.

A decoder worker runs its matmuls through oneDNN (bf16 and float32 linears on CPU, through
torch's ideep layer), and both layers keep a cache of what they built per shape: oneDNN its
*primitive cache* (a compiled kernel per operation and shape; ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
1024 entries by default) and ideep its *computation cache* (the prepared operation per shape;
``LRU_CACHE_CAPACITY``, 1024 by default). A serving batch changes shape every step (rows ×
tokens per row, prompt lengths), so under repeated floods both fill for a long time: a bare
decoder worker on the demo pair grew 745 → 938 MiB over ten floods of 32 requests, all of it in
malloc'ed memory in use (live tensors stayed at 47–48 MiB; Python objects, tracemalloc, grew
~2 MiB). With 64 entries each it stayed within 13 MiB of its second flood's level over ten more
and started 160 MiB smaller; served (two replicas, 20 floods) the replicas grew 9–13 MiB from the
second flood against 237–254 MiB with the libraries' defaults, at a cost of a few percent of
decode speed (results/load-soak/demo/README.md).

Both libraries read their variable once, when their cache is first used, so `bound_native_caches`
must run before the worker's first matmul; a value already in the environment (an operator's)
wins.
"""

from __future__ import annotations

import os
from typing import MutableMapping

__all__ = ["NATIVE_CACHE_ENV", "bound_native_caches"]

NATIVE_CACHE_ENV = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",  # oneDNN's primitive cache (library default 1024)
    "LRU_CACHE_CAPACITY": "64",               # ideep's computation cache (library default 1024)
}


def bound_native_caches(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each `NATIVE_CACHE_ENV` variable that `environ` (default: this process's) does not set;
    returns the values in force."""
    environ = os.environ if environ is None else environ
    for name, value in NATIVE_CACHE_ENV.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in NATIVE_CACHE_ENV}
