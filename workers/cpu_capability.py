"""The CPU capability this process's kernels really use, for the keys of everything timed or built per machine.

Words used here:
- **effective capability**: the vector instruction set torch's own kernels dispatch to
  (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2, AVX512, ...) together with the
  instruction-set limit oneDNN runs under (its matmuls and packed bf16 weights) and whether
  oneDNN computes bf16 matmuls natively. A CPU's flags say what it could run; these say what
  this process runs.
- **limiting variables**: environment variables that lower the effective capability below the
  CPU's: ``ATEN_CPU_CAPABILITY`` (torch's kernels and inductor's generated code) and
  ``ONEDNN_MAX_CPU_ISA`` (``DNNL_MAX_CPU_ISA`` in older oneDNN). They are read once, when the
  libraries start, so the capability is fixed for the process's life.

Why it is in the keys: on an AMD EPYC with avx512_bf16, ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` turns a [16, 576] x [576, 1536] bf16 linear from 118 us into 735 us
(emulated bf16, as on an AVX2-only CPU) while the CPU's model name and flags stay the same. A cost
profile, dtype choice, wide-row table or compiled package timed or built at one capability is
wrong at another, so every such key holds `effective_capability()`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["LIMITING_VARIABLES", "capability_label", "effective_capability"]

LIMITING_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def _native_bf16() -> bool:
    """Whether oneDNN computes bf16 matmuls in hardware in this process (AVX-512 BF16 or AMX, and
    not limited below them by ``ONEDNN_MAX_CPU_ISA``)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


@functools.cache
def effective_capability() -> dict[str, Any]:
    """{"torch_capability": the ISA torch's kernels dispatch to, "onednn_isa_limit": the value of
    ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``), None when unset, "native_bf16": oneDNN's
    native bf16 matmuls, "limited_by": {variable: value} of the `LIMITING_VARIABLES` that are set}."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - a torch without the query
        capability = "unknown"
    limited = {name: os.environ[name] for name in LIMITING_VARIABLES if os.environ.get(name)}
    onednn = limited.get("ONEDNN_MAX_CPU_ISA", limited.get("DNNL_MAX_CPU_ISA"))
    return {"torch_capability": capability, "onednn_isa_limit": onednn, "native_bf16": _native_bf16(),
            "limited_by": limited}


def capability_label() -> str:
    """torch's capability and oneDNN's limit as one short string for flat keys: ``AVX512``, or
    ``AVX2 onednn=AVX2`` under the limiting variables (without a limit it is exactly torch's
    capability, so keys built before the limit was part of them stay valid)."""
    cap = effective_capability()
    limit = cap["onednn_isa_limit"]
    return cap["torch_capability"] + (f" onednn={limit}" if limit else "")
