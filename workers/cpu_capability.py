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
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["CAPABILITY_FLAGS", "LIMITING_VARIABLES", "capability_label", "cpu_identity", "effective_capability"]

# CPU flags that change which kernels torch and oneDNN can run (what a key or a results file names):
# AVX2 / AVX-512 vector units, native bf16 dot products (avx512_bf16), AMX tiles (amx_*), fp16 conversions.
CAPABILITY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                    "amx_tile", "amx_bf16", "amx_int8")

LIMITING_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def _native_bf16() -> bool:
    """Whether oneDNN computes bf16 matmuls in hardware in this process (AVX-512 BF16 or AMX, and
    not limited below them by ``ONEDNN_MAX_CPU_ISA``)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


@functools.cache
def cpu_identity() -> dict[str, Any]:
    """{"cpu": the CPU's model name, "flags": the `CAPABILITY_FLAGS` it has}, from the first
    processor's block of /proc/cpuinfo (the platform's processor name and no flags without one)."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                if info:
                    break
                continue
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {"cpu": info.get("model name") or platform.processor() or platform.machine(),
            "flags": [f for f in CAPABILITY_FLAGS if f in flags]}


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
