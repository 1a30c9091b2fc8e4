"""Ahead-of-time compiled decode steps: the target's decode forward as an AOTInductor package.

`compile="on"` (workers/compiled.py) makes decode steps ~1.6x faster on a CPU but compiles them in
every process (minutes on SmolLM2: torch's on-disk caches refuse frozen programs, docs/engine.md).
`compile="aot"` gets the same programs without that: the decode forward is exported once with
`torch.export` (dynamic batch, query length and cache window), compiled by AOTInductor with
freezing (weights packed for oneDNN, kernels called from C++) into a **package** (one `.pt2`
file) in the cache directory, and loaded by every later process in about a second.

One program serves every decode call of an engine: rows `1 .. max_batch`, `1 .. tmax` new tokens
each (an anchor and its drafts), per-row start positions, any window `2 .. cache length - 1`.
Prefills (`logits_index`), packed verification and anything outside those ranges run the eager
forward, which stays loaded. The drafter's passes stay eager.

A package holds the target's weights as constants and the cache's shape as a constant, so its
**key** covers what it was built from: the weights' bytes, dtype, captured layers, cache shape
and dtype, `tmax`, torch's version, the CPU's vector capability and the source of the forward
(this file, `target_model.py`, `layers.py`, `kv_cache.py`). Any change builds a new package; old
ones stay until removed (`adapt compile --list`). Packages are built on this machine and read
only from its own cache directory: loading one runs the native code it contains, like torch's own
compile cache, and nothing is ever downloaded or unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from workers.atomic_file import write_text_atomic
from workers.pull import cache_root

PACKAGE_FORMAT = 1
SOURCES = ("aot.py", "target_model.py", "layers.py", "kv_cache.py")  # in workers/: the forward's code


class _CacheInputs:
    """A `KVCache` look-alike over the program's cache inputs (what `TargetModel.forward` reads)."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v = k, v

    def view(self, layer: int, row0: int, rows: int, width: int):
        return self.k[layer][row0 : row0 + rows, :, :width], self.v[layer][row0 : row0 + rows, :, :width]


class DecodeForward(nn.Module):
    """What the package runs: `target(ids, start, cache, 0, W, capture)` with the window W carried
    as the length of `window` (a tensor, so that export sees W as a dynamic size) and the cache's
    key and value tensors as inputs written in place.

    ids [B, T] int64, start [B] int64, window [W] (contents unused), kv: the cache's L key tensors
    then L value tensors, each [max_batch, kv_heads, cache length, head_dim].
    Returns logits [B, T, V] float32 and hidden [B, T, len(capture) * H] (or None)."""

    def __init__(self, target: nn.Module, capture: tuple[int, ...]):
        super().__init__()
        self.target, self.capture = target, tuple(capture)

    def forward(self, ids, start, window, *kv):
        layers = len(kv) // 2
        cache = _CacheInputs(list(kv[:layers]), list(kv[layers:]))
        return self.target(ids, start, cache, 0, window.shape[0], self.capture)


def weights_digest(target: nn.Module) -> str:
    """sha256 over the target's parameters and buffers in `state_dict` order (names, shapes,
    dtypes, bytes); ~0.3 s for SmolLM2's 270 MB."""
    h = hashlib.sha256()
    for name, t in target.state_dict().items():
        t = t.detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes())
    return h.hexdigest()


def package_facts(target: nn.Module, capture: tuple[int, ...], cache, tmax: int) -> dict:
    """Everything a package depends on besides the weights (which `weights_digest` covers)."""
    here = Path(__file__).resolve().parent
    src = hashlib.sha256(b"".join((here / name).read_bytes() for name in SOURCES)).hexdigest()
    k0 = cache.k[0]
    return {
        "format": PACKAGE_FORMAT, "torch": torch.__version__, "device": k0.device.type,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dtype": str(next(target.parameters()).dtype), "capture": list(capture),
        "layers": len(cache.k), "cache_shape": list(k0.shape), "cache_dtype": str(k0.dtype), "tmax": int(tmax),
        "source": src,
    }


def package_key(facts: dict, weights: str) -> str:
    return hashlib.sha256(json.dumps({**facts, "weights": weights}, sort_keys=True).encode()).hexdigest()[:24]


def package_dir(cache_dir: str | Path | None = None) -> Path:
    """Where packages live: <cache>/aot (workers/pull.py's cache root)."""
    return cache_root(cache_dir) / "aot"


def build_package(target: nn.Module, capture: tuple[int, ...], cache, tmax: int, path: Path) -> float:
    """Export `DecodeForward` and compile it into the package `path` (written atomically: a
    temporary file renamed into place). Returns the seconds it took. `target` must be in eval
    mode; its eager forward runs once first (it builds lazily made tables the program reads)."""
    t0 = time.perf_counter()
    max_batch, _, length, _ = cache.k[0].shape
    module = DecodeForward(target, capture).eval()
    B, T = min(2, max_batch), min(3, tmax)
    kv = tuple(torch.zeros_like(t) for t in cache.k) + tuple(torch.zeros_like(t) for t in cache.v)
    example = (torch.zeros(B, T, dtype=torch.long, device=cache.k[0].device),
               torch.full((B,), 5, dtype=torch.long, device=cache.k[0].device),
               torch.zeros(5 + T, device=cache.k[0].device))
    Dim = torch.export.Dim
    dynamic = {"ids": {0: Dim("rows", min=1, max=max_batch) if max_batch > 1 else Dim.STATIC,
                       1: Dim("tokens", min=1, max=tmax) if tmax > 1 else Dim.STATIC},
               "window": {0: Dim("window", min=2, max=length - 1)}, "kv": tuple(None for _ in kv)}
    dynamic["start"] = {0: dynamic["ids"][0]}
    with torch.no_grad():  # inductor freezes weights only with grad off
        module(*example, *kv)
        exported = torch.export.export(module, (*example, *kv), dynamic_shapes=dynamic, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp.pt2", dir=path.parent)
        os.close(fd)
        try:
            torch._inductor.aoti_compile_and_package(exported, package_path=tmp,
                                                     inductor_configs={"freezing": True})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return time.perf_counter() - t0


class AotTarget:
    """The target forward of an engine, its decode calls run by a loaded package.

    Same signature and results as `TargetModel.forward(..., capture=capture)` up to rounding (the
    program fuses and orders reductions its own way). Calls the program cannot take (prefills,
    packed verification, another cache, rows or tokens beyond the package's, a window reaching
    the cache's end) run the eager forward."""

    def __init__(self, target: nn.Module, capture: tuple[int, ...], cache, runner, tmax: int):
        self.target, self.capture, self.cache, self.tmax = target, tuple(capture), cache, tmax
        self.max_batch, self.length = cache.k[0].shape[0], cache.k[0].shape[2]
        self.kv = list(cache.k) + list(cache.v)
        self.window = torch.empty(self.length, device=cache.k[0].device)  # sliced to W per call
        self.loader = runner.loader  # called directly: AOTICompiledModel re-parses its specs per call
        self.out_spec = torch.utils._pytree.treespec_loads(self.loader.get_call_spec()[1])
        self.calls = {"program": 0, "eager": 0}

    def fits(self, input_ids, cache, row0, width, logits_index, packed) -> bool:
        B, T = input_ids.shape
        return (logits_index is None and packed is None and row0 == 0 and cache is self.cache
                and B <= self.max_batch and T <= self.tmax and 2 <= width < self.length)

    def __call__(self, input_ids, start, cache, row0, width, logits_index=None, start_value=None, packed=None,
                 packed_counts=None):
        if not self.fits(input_ids, cache, row0, width, logits_index, packed):
            self.calls["eager"] += 1
            return self.target(input_ids, start, cache, row0, width, self.capture, logits_index, start_value,
                               packed=packed, packed_counts=packed_counts)
        self.calls["program"] += 1
        flat = self.loader.boxed_run([input_ids, start, self.window[:width], *self.kv])
        return torch.utils._pytree.tree_unflatten(flat, self.out_spec)


def aot_target(target: nn.Module, capture: tuple[int, ...], cache, tmax: int, cache_dir: str | Path | None = None,
               build: bool = True, log=None) -> tuple[AotTarget, dict]:
    """The engine's `AotTarget`: its package loaded from the cache directory, built first when
    missing (`build`; else `FileNotFoundError` naming the command that builds it). Returns it and
    {"path", "key", "built": bool, "build_s", "load_s"}. `log(message)` hears about a build."""
    facts = package_facts(target, capture, cache, tmax)
    folder = package_dir(cache_dir)
    missing = ("no compiled decode package {} for this target and engine shape; build it with `adapt compile` "
               "(or --compile aot, which builds it on first use)")
    built_for = [{k: v for k, v in pkg.items() if k != "built_s"} for pkg in _facts_files(folder)]
    if not build and facts not in built_for:  # no package of this shape at all: spare hashing the weights
        raise FileNotFoundError(missing.format(f"in {folder}"))
    key = package_key(facts, weights_digest(target))
    path = folder / f"decode-{key}.pt2"
    info = {"path": str(path), "key": key, "built": False, "build_s": 0.0}
    if not path.is_file():
        if not build:
            raise FileNotFoundError(missing.format(path))
        if log:
            log(f"compiling the target's decode step into {path} (once per machine and engine shape; "
                f"a minute or two per 100 M parameters)")
        info["build_s"] = round(build_package(target, capture, cache, tmax, path), 1)
        info["built"] = True
        write_text_atomic(folder / f"decode-{key}.json", json.dumps({**facts, "built_s": info["build_s"]}, indent=1))
    t0 = time.perf_counter()
    runner = torch._inductor.aoti_load_package(str(path))
    info["load_s"] = round(time.perf_counter() - t0, 2)
    return AotTarget(target, capture, cache, runner, tmax), info


def compile_options(choice: str) -> dict:
    """`EngineConfig` settings for the CLIs' `--compile` choice: `auto` = the compiled package
    when one is built for this model and engine shape, else eager steps (never a build at start);
    `aot` = the package, built first when missing; `on` / `off` as `EngineConfig.compile`."""
    if choice == "auto":
        return {"compile": "aot", "aot_build": False}
    return {"compile": choice}


def _facts_files(folder: Path) -> list[dict]:
    """The facts written beside each package in `folder` (`package_facts` plus "built_s")."""
    return [json.loads(f.read_text()) for f in sorted(folder.glob("decode-*.json"))] if folder.is_dir() else []


def list_packages(cache_dir: str | Path | None = None) -> list[dict]:
    """The packages in the cache directory: path, size in MB and the facts they were built for."""
    out = []
    for pt2 in sorted(package_dir(cache_dir).glob("decode-*.pt2")):
        meta = pt2.with_suffix(".json")
        facts = json.loads(meta.read_text()) if meta.is_file() else {}
        out.append({"path": str(pt2), "mb": round(pt2.stat().st_size / 2**20, 1), **facts})
    return out


def remove_packages(cache_dir: str | Path | None = None) -> int:
    """Delete every package (and its facts file); returns how many packages there were."""
    folder = package_dir(cache_dir)
    n = len(list(folder.glob("decode-*.pt2"))) if folder.is_dir() else 0
    if folder.is_dir():
        shutil.rmtree(folder)
    return n
