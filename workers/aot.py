"""Ahead-of-time compiled decode steps: the target's decode forward as an AOTInductor package.

`compile="on"` (workers/compiled.py) makes decode steps ~1.6x faster on a CPU but compiles them in
every process (minutes on SmolLM2: torch's on-disk caches refuse frozen programs, docs/cpu-performance.md).
`compile="aot"` gets the same programs without that: the decode forward is exported once with
`torch.export` (dynamic batch, query length and cache window), compiled by AOTInductor with
freezing (weights packed for oneDNN, kernels called from C++) into a **package** (one `.pt2`
file) in the cache directory, and loaded by every later process in about a second.

One program serves every decode call of an engine: rows `1 .. max_batch`, `1 .. tmax` new tokens
each (an anchor and its drafts), per-row start positions, any window `2 .. cache length - 1`.
Prefills (`logits_index`), packed verification and anything outside those ranges run the eager
forward, which stays loaded.

On a CPU with native bf16 matmuls a bf16 engine also gets a **one-row program**
(`onerow-<key>.pt2`, `aot_one_row`): the same forward for one row and 1 .. `ONE_ROW_TOKENS`
tokens, compiled with inductor's C++ GEMM template timed against oneDNN for every matmul. It runs
the one-row calls of the token counts where it measured faster than the decode package, once,
right after it was built (the verdict is kept beside it): oneDNN's bf16 matmuls of one to four
rows are slower than the template's, and its wide ones faster.

The drafter's denoising pass (`BlockDiffusionDrafter.block_logits`) gets a package of its own
(`draft-<key>.pt2`, `DraftPass`): rows `1 .. max_batch` drafting together, `3 .. K + 1` block
positions (an anchor and at least two drafts), any window over the drafter-context cache, the
mask always given. Passes over a subset of the rows (gathered copies of their context) or over a
block of two positions run eagerly.

The drafter-context commit (`DrafterContext.flush`: `BlockDiffusionDrafter.context_kv` of stashed
target hidden states, written into the drafter-context cache) gets a third package
(`context-<key>.pt2`, `ContextWrite`): any rows `1 .. max_batch`, each at its own start position,
`1 .. pmax` stashed positions. Eager, its ~25 small bf16 ops cost ~1 ms of a SmolLM2 drafting
step; one program call ~0.2 ms. Prompts' contexts (prefills) stay eager.

A package holds the target's weights as constants and the cache's shape as a constant, so its
**key** covers what it was built from: the weights' bytes, dtype, captured layers, cache shape
and dtype, `tmax`, torch's version, the CPU's vector capability and the source of the forward
(this file, `target_model.py`, `layers.py`, `kv_cache.py`). Any change builds a new package; old
ones stay until removed (`adapt compile --prune`). The folder, the keys, listing and pruning live in
workers/package_cache.py, outside those files. Packages are built on this machine and read
only from its own cache directory: loading one runs the native code it contains, like torch's own
compile cache, and nothing is ever downloaded or unpickled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from workers.atomic_file import write_text_atomic
from workers.cpu_capability import capability_label, effective_capability
from workers.package_loader import load_package
from workers.package_cache import (CONTEXT_SOURCES, DRAFT_SOURCES, PACKAGE_FORMAT, SOURCES, facts_files, package_dir,
                                   package_key, source_digest)

log = logging.getLogger(__name__)

MIN_BLOCK = 3  # block positions a drafter package takes at least (2 would specialise the export)


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


def tensors_digest(items) -> str:
    """sha256 over (name, tensor) pairs in order: names, shapes, dtypes and bytes."""
    h = hashlib.sha256()
    for name, t in items:
        t = t.detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.contiguous().view(torch.uint8).reshape(-1).cpu().numpy().tobytes())
    return h.hexdigest()


def weights_digest(target: nn.Module) -> str:
    """`tensors_digest` over the target's parameters and buffers in `state_dict` order; ~0.3 s
    for SmolLM2's 270 MB."""
    return tensors_digest(target.state_dict().items())


def _shared_facts(sources: tuple[str, ...], cache) -> dict:
    """What every package depends on: its format, torch's version, the device and the CPU's
    effective capability (`workers.cpu_capability`: inductor generates code for
    ``ATEN_CPU_CAPABILITY``'s ISA, oneDNN runs under ``ONEDNN_MAX_CPU_ISA``), the cache it runs over
    and the source of the code it compiled (`sources`, in workers/)."""
    k0 = cache.k[0]
    return {"format": PACKAGE_FORMAT, "torch": torch.__version__, "device": k0.device.type,
            "cpu_capability": capability_label(), "native_bf16": effective_capability()["native_bf16"],
            "layers": len(cache.k),
            "cache_shape": list(k0.shape), "cache_dtype": str(k0.dtype), "source": source_digest(sources)}


def package_facts(target: nn.Module, capture: tuple[int, ...], cache, tmax: int) -> dict:
    """Everything a package depends on besides the weights (which `weights_digest` covers)."""
    return {**_shared_facts(SOURCES, cache), "dtype": str(next(target.parameters()).dtype),
            "capture": list(capture), "tmax": int(tmax)}


# the one-row program (`aot_one_row`): calls of one row and up to this many tokens (an anchor and 4 drafts)
ONE_ROW_TOKENS = 5
ONE_ROW_MIN_GAIN = 0.03  # a token count runs on the one-row program where it measured this much faster


def one_row_facts(target: nn.Module, capture: tuple[int, ...], cache) -> dict:
    """What a one-row program depends on besides the weights: the decode package's facts for
    `ONE_ROW_TOKENS` tokens, one row, the GEMM template offered."""
    return {**package_facts(target, capture, cache, ONE_ROW_TOKENS), "rows": 1, "gemm": "template"}


def offers_one_row(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an engine of ``dtype`` on ``device`` tries a one-row program: bf16 / fp16 weights on
    a CPU whose oneDNN has native bf16 matmuls (elsewhere the decode package already times the
    template for every matmul, `inductor_configs`)."""
    return (torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and effective_capability()["native_bf16"])


def build_package(target: nn.Module, capture: tuple[int, ...], cache, tmax: int, path: Path,
                  one_row: bool = False) -> float:
    """Export `DecodeForward` and compile it into the package `path` (written atomically: a
    temporary file renamed into place). Returns the seconds it took. `target` must be in eval
    mode; its eager forward runs once first (it builds lazily made tables the program reads).
    ``one_row``: the one-row program (`one_row_facts`): calls of one row, 1 .. ``tmax`` tokens,
    every matmul timed against inductor's C++ GEMM template at two tokens."""
    max_batch, _, length, _ = cache.k[0].shape
    dev = cache.k[0].device
    B, T = (1, 2) if one_row else (min(2, max_batch), min(3, tmax))
    # the example's window is half the cache: inductor splits its loops over threads by the example's
    # sizes, and with a window of a few positions it ran the attention's softmax on one thread
    # (results/ab/smollm2/verify-example-window/: a 17-token verify after 1,780 positions 0.87x the time)
    W = max(5 + T, (length - 1) // 2)
    kv = tuple(torch.zeros_like(t) for t in cache.k) + tuple(torch.zeros_like(t) for t in cache.v)
    example = (torch.zeros(B, T, dtype=torch.long, device=dev), torch.full((B,), W - T, dtype=torch.long, device=dev),
               torch.zeros(W, device=dev))
    Dim = torch.export.Dim
    dynamic = {"ids": {0: Dim("rows", min=1, max=max_batch) if max_batch > 1 and not one_row else Dim.STATIC,
                       1: Dim("tokens", min=1, max=tmax) if tmax > 1 else Dim.STATIC},
               "window": {0: Dim("window", min=2, max=length - 1)}, "kv": tuple(None for _ in kv)}
    dynamic["start"] = {0: dynamic["ids"][0]}
    return _package(DecodeForward(target, capture).eval(), (*example, *kv), dynamic, path, template=one_row)


FROZEN = {"freezing": True}  # every package: weights are constants, packed for oneDNN


def inductor_configs(dtype: torch.dtype, template: bool = False) -> dict:
    """AOTInductor's options for a package whose weights are ``dtype``: freezing (weights packed
    for oneDNN), and, where oneDNN has no native bf16 / fp16 matmuls (an AVX2-only CPU), inductor's
    own C++ GEMM template as a candidate beside the library call for every matmul, each picked by
    timing both on this machine while the package builds (``max_autotune``). There oneDNN runs a
    bf16 matmul of several rows emulated, its time growing with every row, while the template
    converts the bf16 weights to fp32 in registers and reads them once for all rows: SmolLM2's
    decode forward under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (two threads) took
    10.5 / 10.7 / 18.2 / 43.1 ms for 2 / 3 / 5 / 17 tokens against oneDNN's 17.1 / 24.2 / 40.2 /
    130.6 (one token: 10.5 against 10.4), and 25.3 ms for one token of 8 rows against 63.6
    (results/verify-cost/smollm2-avx2/; docs/cpu-performance.md, "Compiled packages on the AVX2
    kind"). ``template``: offer the template whatever the CPU (the one-row program, `aot_one_row`)."""
    configs: dict = dict(FROZEN)
    if template or (dtype in (torch.bfloat16, torch.float16) and not effective_capability()["native_bf16"]):
        configs.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN",
                       autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False)  # no tables on stderr
    return configs


def _package(module: nn.Module, example: tuple, dynamic: dict, path: Path, template: bool = False) -> float:
    """Export `module` on `example` with `dynamic` shapes, compile it with AOTInductor
    (`inductor_configs` of its weights' dtype) into the package `path`, written atomically.
    Returns the seconds it took."""
    t0 = time.perf_counter()
    with torch.no_grad():  # inductor freezes weights only with grad off
        module(*example)
        exported = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp.pt2", dir=path.parent)
        os.close(fd)
        try:
            weight = next(module.parameters(), None)
            configs = inductor_configs(weight.dtype if weight is not None else torch.float32, template)
            try:
                torch._inductor.aoti_compile_and_package(exported, package_path=tmp, inductor_configs=configs)
            except Exception as exc:  # noqa: BLE001 - inductor's template fails on some programs: build without it
                if not configs.get("max_autotune"):
                    raise
                # (torch 2.13: the drafter's pass at 8 rows, an epilogue the template asserts on)
                log.warning("%s: inductor's C++ GEMM template failed on this program (%s: %s); building it "
                            "with oneDNN's matmuls alone", path.name, type(exc).__name__, str(exc).strip()[:200])
                torch._inductor.aoti_compile_and_package(exported, package_path=tmp,
                                                         inductor_configs=dict(FROZEN))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return time.perf_counter() - t0


class DraftPassForward(nn.Module):
    """What a drafter package runs: one denoising pass, `drafter.block_logits` over the first
    `B` slots of the drafter-context cache, window W carried as the mask's length.

    tokens / masked [B, Q] (the anchor first), mask [B, 1, W] additive (0 = attend), cos / signed
    sin [B, Q, d], kv: the first B slots of the cache's L key tensors then L value tensors, each
    [B, kv_heads, cache length, head_dim] (the block's keys and values are written into columns
    W − Q .. W). Only those slots are inputs: given the whole cache, a program exported at B =
    max_batch (a cache of 2 slots) also wrote the block columns of the slots past B, with
    non-finite values (AOTInductor, torch 2.13, CPU).
    Returns logits [B, Q − 1, Vd] float32 over the draft vocabulary."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, tokens, masked, mask, cos, sin, *kv):
        B, W, layers = tokens.shape[0], mask.shape[-1], len(kv) // 2
        ctx = [(kv[i][:B, :, :W], kv[layers + i][:B, :, :W]) for i in range(layers)]
        return self.drafter.block_logits(tokens, masked, ctx, mask, cos, sin)


def drafter_digest(drafter: nn.Module) -> str:
    """`tensors_digest` over what a drafter package holds as constants: the drafter's own weights
    and the target's embedding and LM-head rows it borrows."""
    head = drafter.draft_head if drafter.draft_head is not None else drafter.lm_head
    return tensors_digest([*drafter.state_dict().items(), ("embed_tokens", drafter.embed_tokens.weight),
                           ("head", head.weight)])


def draft_facts(drafter: nn.Module, cache, qmax: int) -> dict:
    """What a drafter package depends on besides the weights (`drafter_digest`)."""
    return {**_shared_facts(DRAFT_SOURCES, cache), "kind": "draft", "dtype": str(drafter.mask_embedding.dtype),
            "drafter": drafter.config.to_dict(), "qmax": int(qmax)}


def build_draft_package(drafter: nn.Module, cache, qmax: int, path: Path) -> float:
    """Export `DraftPassForward` (rows 1 .. max_batch, block positions `MIN_BLOCK` .. qmax, window
    up to the cache's length − 1) and compile it into the package `path`. Returns the seconds."""
    max_batch, _, length, _ = cache.k[0].shape
    dev, dtype = cache.k[0].device, drafter.mask_embedding.dtype
    B, Q, W = min(2, max_batch), min(4, qmax), min(4, qmax) + 8
    tokens = torch.zeros(B, Q, dtype=torch.long, device=dev)
    masked = torch.ones(B, Q, dtype=torch.bool, device=dev)
    masked[:, 0] = False
    cos, sin = drafter.rope(torch.arange(W - Q, W, device=dev).expand(B, Q), dtype, bound=length)
    kv = tuple(torch.zeros_like(t[:B]) for t in (*cache.k, *cache.v))  # the first B slots (`DraftPassForward`)
    example = (tokens, masked, torch.zeros(B, 1, W, dtype=dtype, device=dev), cos, sin, *kv)
    Dim = torch.export.Dim
    rows = Dim("rows", min=1, max=max_batch) if max_batch > 1 else Dim.STATIC
    block = Dim("block", min=MIN_BLOCK, max=qmax)
    dynamic = {"tokens": {0: rows, 1: block}, "masked": {0: rows, 1: block},
               "mask": {0: rows, 2: Dim("window", min=MIN_BLOCK + 1, max=length - 1)},
               "cos": {0: rows, 1: block}, "sin": {0: rows, 1: block}, "kv": tuple({0: rows} for _ in kv)}
    return _package(DraftPassForward(drafter).eval(), example, dynamic, path)


class ContextWriteForward(nn.Module):
    """What a drafter-context package runs: the commit of `DrafterContext.flush` in place.

    hidden [n, P, width] target hidden states of positions start .. start + P − 1 of slots
    `rows` [n] int64 (start [n] int64), kv: the drafter-context cache's L key tensors then L value
    tensors, each [max_batch, kv_heads, cache length, head_dim]. Positions past the cache's end
    are clamped onto its last column (callers send such entries only as padding, masked and later
    overwritten). Returns each row's last position written [n] (export wants an output)."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, hidden, rows, start, *kv):
        from workers.target_model import write_kv

        layers, (_, kvh, length, _) = len(kv) // 2, kv[0].shape
        pos = (start[:, None] + torch.arange(hidden.shape[1], device=start.device)).clamp(max=length - 1)  # [n, P]
        index = (rows[:, None, None], torch.arange(kvh, device=start.device)[None, None, :], pos[:, :, None])
        for i, (k, v) in enumerate(self.drafter.context_kv(hidden, pos, bound=length)):  # each [n, kvh, P, d]
            write_kv(None, None, (kv[i], kv[layers + i], index), k.transpose(1, 2), v.transpose(1, 2))
        return pos[:, -1]


def context_facts(drafter: nn.Module, cache, pmax: int, width: int, dtype: torch.dtype) -> dict:
    """What a drafter-context package depends on besides the weights (`drafter_digest`)."""
    return {**_shared_facts(CONTEXT_SOURCES, cache), "kind": "context", "dtype": str(drafter.mask_embedding.dtype),
            "drafter": drafter.config.to_dict(), "pmax": int(pmax), "width": int(width), "hidden_dtype": str(dtype)}


def build_context_package(drafter: nn.Module, cache, pmax: int, width: int, dtype: torch.dtype, path: Path) -> float:
    """Export `ContextWriteForward` (rows 1 .. max_batch, 1 .. pmax positions of `width` hidden
    features in `dtype`) and compile it into the package `path`. Returns the seconds."""
    max_batch, dev = cache.k[0].shape[0], cache.k[0].device
    n, P = min(2, max_batch), min(3, pmax)
    kv = tuple(torch.zeros_like(t) for t in cache.k) + tuple(torch.zeros_like(t) for t in cache.v)
    example = (torch.zeros(n, P, width, dtype=dtype, device=dev), torch.arange(n, device=dev),
               torch.full((n,), 4, dtype=torch.long, device=dev), *kv)
    Dim = torch.export.Dim
    rows = Dim("rows", min=1, max=max_batch) if max_batch > 1 else Dim.STATIC
    dynamic = {"hidden": {0: rows, 1: Dim("positions", min=1, max=pmax) if pmax > 1 else Dim.STATIC},
               "rows": {0: rows}, "start": {0: rows}, "kv": tuple(None for _ in kv)}
    return _package(ContextWriteForward(drafter).eval(), example, dynamic, path)


class AotContextWrite:
    """The drafter-context commit from a loaded package: `(hidden, rows, start)` as
    `ContextWriteForward` takes them, over the engine's drafter-context cache (`DrafterContext.flush`
    calls it where it `fits`; elsewhere the eager commit runs). `calls` counts its runs."""

    def __init__(self, cache, runner, pmax: int):
        self.max_batch, self.pmax = cache.k[0].shape[0], pmax
        self.kv = list(cache.k) + list(cache.v)
        self.loader = runner.loader
        self.calls = 0

    def fits(self, rows: int, positions: int) -> bool:
        return 1 <= rows <= self.max_batch and 1 <= positions <= self.pmax

    def __call__(self, hidden, rows, start) -> None:
        self.calls += 1
        self.loader.boxed_run([hidden, rows, start, *self.kv])


def called_directly(runner) -> tuple:
    """(loader, output spec) of a loaded package's ``runner``: its loader is called directly
    (`boxed_run`), since AOTICompiledModel re-parses its specs on every call."""
    return runner.loader, torch.utils._pytree.treespec_loads(runner.loader.get_call_spec()[1])


class AotDraftPass:
    """The drafter's denoising pass from a loaded package: `(tokens, masked, mask, cos, sin)` as
    `DraftPassForward` takes them, over the engine's drafter-context cache (`DrafterContext`
    calls it only where it `fits`; elsewhere the eager pass runs). `calls` counts its runs."""

    def __init__(self, cache, runner, qmax: int):
        self.cache, self.qmax = cache, qmax
        self.max_batch, self.length = cache.k[0].shape[0], cache.k[0].shape[2]
        self.kv = list(cache.k) + list(cache.v)
        self.loader, self.out_spec = called_directly(runner)
        self.calls = 0
        self._kv_rows: dict[int, list[torch.Tensor]] = {}  # rows -> views of the cache's first rows

    def fits(self, rows: int, block: int, window: int) -> bool:
        return rows <= self.max_batch and MIN_BLOCK <= block <= self.qmax and block < window < self.length

    def __call__(self, tokens, masked, mask, cos, sin, kv: list[torch.Tensor] | None = None):
        """One pass over the cache's first B = ``tokens.shape[0]`` slots, or over ``kv`` (every
        layer's K, then every layer's V, each ``[B, kv_heads, cache length, head_dim]``: other
        slots of the cache or a copy of their context, `DrafterContext.subset_kv`), whose block
        columns it writes."""
        self.calls += 1
        B = tokens.shape[0]
        if kv is None:
            kv = self._kv_rows.get(B)
        if kv is None:  # made once per batch size: slicing every layer's K and V per call costs ops
            kv = self._kv_rows[B] = [t[:B] for t in self.kv]
        flat = self.loader.boxed_run([tokens, masked, mask, cos, sin, *kv])
        return torch.utils._pytree.tree_unflatten(flat, self.out_spec)


PAD_ROWS = 4       # calls of fewer rows of tokens (B x T) than this are candidates for padding
PAD_MIN_GAIN = 0.05  # a padded call must be measured this much faster to be used


class AotTarget:
    """The target forward of an engine, its decode calls run by a loaded package.

    Same signature and results as `TargetModel.forward(..., capture=capture)` up to rounding (the
    program fuses and orders reductions its own way). Calls the program cannot take (prefills,
    packed verification, another cache, rows or tokens beyond the package's, a window reaching
    the cache's end) run the eager forward.

    **Padding** (`calibrate_padding`): on a CPU the program's matrix products over very few rows
    of tokens are slower than over a few more (SmolLM2 in bf16 here, one row: 14.0 ms for one
    token, 14.3 for two, 12.9 for three, 12.5 for four). Where calibration measured it faster, a
    call of B rows x T tokens runs padded to ``pad[(B, T)]`` tokens per row (each row's last token
    repeated) and returns the first T positions: the padded positions come after the real ones,
    which attend causally and never see them, and their cache entries lie past each row's length
    (masked, overwritten later, as a rejected draft's are)."""

    def __init__(self, target: nn.Module, capture: tuple[int, ...], cache, runner, tmax: int):
        self.target, self.capture, self.cache, self.tmax = target, tuple(capture), cache, tmax
        self.max_batch, self.length = cache.k[0].shape[0], cache.k[0].shape[2]
        self.kv = list(cache.k) + list(cache.v)
        self.window = torch.empty(self.length, device=cache.k[0].device)  # sliced to W per call
        self.loader, self.out_spec = called_directly(runner)
        self.calls = {"program": 0, "eager": 0}
        self.pad: dict[tuple[int, int], int] = {}  # (rows, tokens) -> tokens per row to run (`calibrate_padding`)
        self.one_row = None  # (loader, output spec) of the one-row program (`aot_one_row`); None: none
        self.one_row_tokens: frozenset[int] = frozenset()  # the token counts of one row it runs

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
        B, T = input_ids.shape
        extra = self.pad.get((B, T), T) - T
        if extra <= 0 or width + extra >= self.length:
            return self._run(input_ids, start, width)
        ids = torch.cat((input_ids, input_ids[:, -1:].expand(B, extra)), 1)                # [B, T + extra]
        logits, hidden = self._run(ids, start, width + extra)
        return logits[:, :T], None if hidden is None else hidden[:, :T]

    def _run(self, input_ids, start, width):
        B, T = input_ids.shape
        loader, spec = self.one_row if B == 1 and T in self.one_row_tokens else (self.loader, self.out_spec)
        flat = loader.boxed_run([input_ids, start, self.window[:width], *self.kv])
        return torch.utils._pytree.tree_unflatten(flat, spec)

    def use_one_row(self, runner, tokens) -> None:
        """Run calls of one row and ``tokens`` tokens (an iterable of counts) on ``runner``'s program."""
        self.one_row = called_directly(runner)
        self.one_row_tokens = frozenset(int(t) for t in tokens)

    def time_one_row(self, runner, reps: int = 10, min_gain: float = ONE_ROW_MIN_GAIN) -> dict:
        """Time one-row calls of 1 .. `ONE_ROW_TOKENS` tokens on this program and on ``runner``'s
        (a one-row program), interleaved, ``reps`` times each after a warm-up round, after a short
        and a long context (64 positions and half the cache); returns {"ms": {T: [this program's
        ms, the one-row program's]} (medians summed over both contexts), "tokens": the counts on
        which the one-row program was at least ``min_gain`` faster}. Writes scratch entries into
        the cache's first row (run it before any request)."""
        import statistics

        dev = self.cache.k[0].device
        starts = sorted({min(64, self.length // 4), self.length // 2 - ONE_ROW_TOKENS - 1})
        cases = [(T, s0) for T in range(1, min(ONE_ROW_TOKENS, self.tmax) + 1) for s0 in starts]
        times = {(c, i): [] for c in cases for i in (0, 1)}
        with torch.inference_mode():
            for _ in range(reps + 1):  # the first round warms up
                for T, s0 in cases:
                    ids = torch.zeros(1, T, dtype=torch.long, device=dev)
                    start = torch.full((1,), s0, dtype=torch.long, device=dev)
                    for i, loader in enumerate((self.loader, runner.loader)):
                        t0 = time.perf_counter()
                        loader.boxed_run([ids, start, self.window[:s0 + T], *self.kv])
                        times[((T, s0), i)].append(time.perf_counter() - t0)
        ms = {}
        for T in sorted({T for T, _ in cases}):
            ms[T] = [round(sum(1e3 * statistics.median(times[((T, s0), i)][1:]) for s0 in starts), 2) for i in (0, 1)]
        tokens = [T for T, (a, b) in ms.items() if b <= (1.0 - min_gain) * a]
        return {"ms": {str(T): v for T, v in ms.items()}, "tokens": tokens, "starts": starts}

    def calibrate_padding(self, reps: int = 12, rows: int = PAD_ROWS, min_gain: float = PAD_MIN_GAIN) -> dict:
        """Time the program on calls of B rows x T tokens with B * T < `rows` against the same
        calls padded to ceil(rows / B) tokens (interleaved, `reps` times each, medians) and pad
        those that ran at least `min_gain` faster padded (`self.pad`). Writes scratch entries into
        the cache's first rows (run it before any request). Returns {"BxT": [ms, padded ms, padded?]}."""
        import statistics

        dev = self.cache.k[0].device
        start_pos = min(64, self.length // 4)
        cases = [(B, T, -(-rows // B)) for B in range(1, min(rows, self.max_batch + 1))
                 for T in range(1, self.tmax + 1) if B * T < rows and -(-rows // B) <= self.tmax]
        cases = [c for c in cases if start_pos + c[2] < self.length]
        times = {c: ([], []) for c in cases}
        with torch.inference_mode():
            for _ in range(reps + 1):  # the first round warms up
                for c in cases:
                    B, T, T2 = c
                    start = torch.full((B,), start_pos, dtype=torch.long, device=dev)
                    for n, out in ((T, times[c][0]), (T2, times[c][1])):
                        ids = torch.zeros(B, n, dtype=torch.long, device=dev)
                        t0 = time.perf_counter()
                        self._run(ids, start, start_pos + n)
                        out.append(time.perf_counter() - t0)
        report = {}
        self.pad = {}
        for (B, T, T2), (plain, padded) in times.items():
            a, b = statistics.median(plain[1:]), statistics.median(padded[1:])
            use = b <= (1.0 - min_gain) * a
            if use:
                self.pad[(B, T)] = T2
            report[f"{B}x{T}"] = [round(1e3 * a, 2), round(1e3 * b, 2), use]
        return report


def aot_target(target: nn.Module, capture: tuple[int, ...], cache, tmax: int, cache_dir: str | Path | None = None,
               build: bool = True, log=None) -> tuple[AotTarget, dict]:
    """The engine's `AotTarget`: its package loaded from the cache directory, built first when
    missing (`build`; else `FileNotFoundError` naming the command that builds it). Returns it and
    {"path", "key", "built": bool, "build_s", "load_s"}. `log(message)` hears about a build."""
    runner, info = _load_package(
        "decode", package_facts(target, capture, cache, tmax), lambda: weights_digest(target),
        lambda path: build_package(target, capture, cache, tmax, path), cache_dir, build, log,
        "the target's decode step", "a minute or two per 100 M parameters")
    return AotTarget(target, capture, cache, runner, tmax), info


def aot_one_row(main: AotTarget, weights: str, cache_dir: str | Path | None = None, build: bool = True,
                log=None) -> dict:
    """Give ``main`` (an engine's `AotTarget`, its weights' digest ``weights``) a **one-row
    program**: the same forward compiled for calls of one row and 1 .. `ONE_ROW_TOKENS` tokens
    with inductor's C++ GEMM template timed against oneDNN for every matmul (at two tokens), and
    use it for the token counts where it measured faster than ``main``'s program
    (`AotTarget.time_one_row`, once, right after it is built: the verdict is kept in its facts
    file). On a CPU with native bf16 matmuls (`offers_one_row`) oneDNN's bf16 matmuls of a few
    rows are slower than the template's, which reads the weights once and converts them in
    registers, while the template loses wide verifies and batches (SmolLM2 on a 2-core AVX-512
    CPU: a one-token forward 12.2 ms against 18.7, a 17-token one 58 against 25, 8 rows slower at
    every width; results/verify-cost/smollm2/template-avx512/), so the decode package keeps
    oneDNN and one-row calls of few tokens go here. Loaded or built as `aot_target` does;
    returns its info with the "verdict"."""
    facts = one_row_facts(main.target, main.capture, main.cache)
    runner, info = _load_package(
        "onerow", facts, lambda: weights,
        lambda path: build_package(main.target, main.capture, main.cache, ONE_ROW_TOKENS, path, one_row=True),
        cache_dir, build, log, "the target's one-row steps", "two or three minutes")
    meta = Path(info["path"]).with_suffix(".json")
    record = json.loads(meta.read_text()) if meta.is_file() else dict(facts)
    verdict = record.get("verdict")
    if verdict is None:  # measured once, on this machine, and kept with the package
        verdict = main.time_one_row(runner)
        write_text_atomic(meta, json.dumps({**record, "verdict": verdict}, indent=1))
    if verdict["tokens"]:
        main.use_one_row(runner, verdict["tokens"])
    info["verdict"] = verdict
    return info


def aot_draft_pass(drafter: nn.Module, cache, qmax: int, cache_dir: str | Path | None = None, build: bool = True,
                   log=None) -> tuple[AotDraftPass, dict]:
    """The drafter's `AotDraftPass` over the drafter-context cache `cache` for blocks of up to
    `qmax` positions, loaded or built as `aot_target` does."""
    runner, info = _load_package(
        "draft", draft_facts(drafter, cache, qmax), lambda: drafter_digest(drafter),
        lambda path: build_draft_package(drafter, cache, qmax, path), cache_dir, build, log,
        "the drafter's denoising pass", "about half a minute")
    return AotDraftPass(cache, runner, qmax), info


def aot_context_write(drafter: nn.Module, cache, pmax: int, width: int, dtype: torch.dtype,
                      cache_dir: str | Path | None = None, build: bool = True, log=None) -> tuple[AotContextWrite, dict]:
    """The drafter's `AotContextWrite` over the drafter-context cache `cache` for up to `pmax`
    stashed positions of `width` hidden features (`dtype`), loaded or built as `aot_target` does."""
    runner, info = _load_package(
        "context", context_facts(drafter, cache, pmax, width, dtype), lambda: drafter_digest(drafter),
        lambda path: build_context_package(drafter, cache, pmax, width, dtype, path), cache_dir, build, log,
        "the drafter's context commit", "about half a minute")
    return AotContextWrite(cache, runner, pmax), info


def _load_package(prefix: str, facts: dict, digest, build_fn, cache_dir, build: bool, log, what: str,
                  how_long: str):
    """Load the package `<prefix>-<key>.pt2` for `facts` and the weights `digest()`, building it
    with `build_fn(path)` when missing and `build`. Returns (AOTI runner, info)."""
    folder = package_dir(cache_dir)
    missing = ("no compiled package {} for this model and engine shape; build it with `adapt compile` "
               "(or --compile aot, which builds it on first use)")
    built_for = [{k: v for k, v in pkg.items() if k not in ("built_s", "verdict")} for pkg in facts_files(folder, prefix)]
    if not build and facts not in built_for:  # no package of this shape at all: spare hashing the weights
        raise FileNotFoundError(missing.format(f"in {folder}"))
    weights = digest()
    key = package_key(facts, weights)
    path = folder / f"{prefix}-{key}.pt2"
    info = {"path": str(path), "key": key, "built": False, "build_s": 0.0, "weights": weights}
    if not path.is_file():
        if not build:
            raise FileNotFoundError(missing.format(path))
        if log:
            log(f"compiling {what} into {path} (once per machine and engine shape; {how_long})")
        info["build_s"] = round(build_fn(path), 1)
        info["built"] = True
        write_text_atomic(folder / f"{prefix}-{key}.json", json.dumps({**facts, "built_s": info["build_s"]}, indent=1))
    t0 = time.perf_counter()
    runner = load_package(path)
    info["load_s"] = round(time.perf_counter() - t0, 2)
    return runner, info
