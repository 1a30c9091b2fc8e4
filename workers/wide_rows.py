"""Choosing, per weight shape, from how many rows a CPU runs a bf16 matmul through fp32.

Words used here (see workers/linear.py for the paths themselves):
- **emulated bf16**: a bf16 matmul on a CPU without native bf16 (AVX2 only). Its cost grows with
  every row (~7 GMAC/s on two cores of an AMD EPYC).
- **fp32 shadow path**: the same matmul on the layer's fp32 copy. It reads twice the bytes but
  costs nearly the same from 4 to 16 rows.
- **crossover** of a weight shape: the fewest rows at which the fp32 path is at least as fast as
  emulated bf16, read off the two paths' cost lines fitted to timings at a few row counts (the
  candidates). A layer's `wide_rows` is its shape's crossover.

The crossover depends on the machine (cores, caches, memory bandwidth) and the shape: measured on
SmolLM2-135M, two threads, an AMD EPYC with AVX2 only, the attention and MLP projections cross at
6–8 rows and the 49,152-row LM head at 6–12 (docs/cpu-performance.md, "Per-shape thresholds timed at
start-up"). One constant (`WIDE_ROWS`) for every layer left ~10 % of an 8-token forward on the
table, so an engine times its own layers at start-up (`EngineConfig.wide_rows="auto"`): a few
seconds, once per machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections import defaultdict

import torch
from torch import nn
from torch.nn import functional as F

from workers.atomic_file import write_text_atomic
from workers.cpu_capability import capability_label, cpu_identity
from workers.linear import Fusable, ShapeAwareLinear, wants_wide_shadow

__all__ = ["CANDIDATE_ROWS", "calibrate_wide_rows", "forward_linears"]

# Row counts timed (the crossover may fall between them). Below 6 emulated bf16 won on every shape
# measured; the largest candidate is the threshold when fp32 never wins, so a prefill (hundreds of
# rows, where fp32 is ~4x faster) still takes the fp32 path. On SmolLM2 (target and drafter)
# timing them takes ~4 s, once per machine.
CANDIDATE_ROWS = (6, 8, 10, 12)
_MEMO: dict[str, int] = {}  # `_key` -> crossover, this process's copy of the stored ones


def forward_linears(*modules: nn.Module) -> list[ShapeAwareLinear]:
    """The shape-aware linears a forward of `modules` really calls: fused projections instead of
    their parts (a fused module never calls its parts), each linear once."""
    parts: set[int] = set()
    found: dict[int, ShapeAwareLinear] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, Fusable):
                for name, paths in m.FUSE.items():
                    fused = m.fused(name)  # None until `fuse()`: then the parts are called
                    if fused is None:
                        continue
                    parts.update(id(m.get_submodule(p)) for p in paths)
                    if isinstance(fused, ShapeAwareLinear):
                        found[id(fused)] = fused
            if isinstance(m, ShapeAwareLinear):
                found.setdefault(id(m), m)
    return [m for key, m in found.items() if key not in parts]


def _time(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` (seconds), after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _crossover(bf16_s: dict[int, float], fp32_s: dict[int, float]) -> int:
    """The fewest rows, between the smallest and the largest candidate, at which the fp32 path's
    cost line is at most the bf16 one's (the largest candidate when it never is). Each path's
    cost is fitted as a line over the candidates (least squares): one slow timing (a machine
    whose speed moves by 10–20 % between calls) moves a line a little, where comparing the
    candidates one by one would move the answer by several rows."""
    rows = sorted(bf16_s)
    r = torch.tensor(rows, dtype=torch.float64)
    design = torch.stack([torch.ones_like(r), r], dim=1)  # [n, 2]
    times = torch.tensor([[bf16_s[k], fp32_s[k]] for k in rows], dtype=torch.float64)  # [n, 2]
    coef = torch.linalg.lstsq(design, times).solution  # [2 (intercept, slope), 2 (bf16, fp32)]
    for n in range(rows[0], rows[-1] + 1):
        if coef[0, 1] + coef[1, 1] * n <= coef[0, 0] + coef[1, 0] * n:
            return n
    return rows[-1]


@torch.inference_mode()
def calibrate_wide_rows(*modules: nn.Module, candidates: tuple[int, ...] = CANDIDATE_ROWS,
                        repeats: int = 2) -> dict[tuple[int, int], int]:
    """Set the `wide_rows` of every linear in `modules` that takes the wide fp32 path (a bf16/fp16
    weight on a CPU without native matmuls for it, `wide_rows` not None) to its shape's crossover,
    timed on this machine. All layers of one shape are timed together, one after another, so their
    weights come from memory as in a forward (a few of them would sit in the caches, which favours
    the fp32 path unfairly). Returns {(out_features, in_features): rows}; empty
    (and nothing timed) where no layer takes the wide path. Builds the fp32 copies (a prefill
    would build them anyway). Call it after the last cast: `.to()` rebuilds fused projections
    with the `wide_rows` they were fused with.

    Each (shape, number of layers, dtype, threads) is timed once per machine: the answer is kept
    in the process and in `crossovers.json` of the cache directory (`workers.pull.cache_root`,
    under a file lock), which later processes read. So every worker on a machine uses the same
    thresholds and decodes bf16 rows with the same numerics (a path change may flip a near-tie
    of greedy decoding); delete the file to time again."""
    groups: dict[tuple[int, int], list[ShapeAwareLinear]] = defaultdict(list)
    for lin in forward_linears(*modules):
        if lin.wide_rows is not None and wants_wide_shadow(lin.weight):
            groups[(lin.out_features, lin.in_features)].append(lin)
    if not groups:
        return {}
    keys = {shape: _key(shape, len(layers), layers[0].weight.dtype, candidates) for shape, layers in groups.items()}
    if any(key not in _MEMO for key in keys.values()):
        with _stored_crossovers() as stored:
            for shape, layers in groups.items():
                key = keys[shape]
                if key not in stored:
                    stored[key] = _time_crossover(layers, candidates, repeats)
                _MEMO[key] = stored[key]
    table = {shape: _MEMO[keys[shape]] for shape in groups}
    for shape, layers in groups.items():
        for lin in layers:
            lin.wide_rows = table[shape]  # read per call: nothing to rebuild
    return table


def _key(shape: tuple[int, int], layers: int, dtype: torch.dtype, candidates: tuple[int, ...]) -> str:
    """What a stored crossover is valid for: this CPU and the capability its kernels run at
    (`workers.cpu_capability`: ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` change which kernels
    the two paths run), torch, threads, the shape and its layers."""
    return "|".join([cpu_identity()["cpu"], capability_label(), torch.__version__, f"threads={torch.get_num_threads()}", str(dtype),
                     f"{shape[0]}x{shape[1]}x{layers}", "rows=" + ",".join(map(str, candidates))])


@contextlib.contextmanager
def _stored_crossovers():
    """{key: rows} from `crossovers.json` in the cache directory, held under an exclusive lock
    and written back (atomically) on exit; a plain dict where the directory is not writable."""
    from workers.pull import cache_root

    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / "crossovers.lock", "w")
    except OSError:
        yield {}
        return
    path = root / "crossovers.json"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stored = json.loads(path.read_text())
            if not isinstance(stored, dict):
                stored = {}
        except (OSError, ValueError):
            stored = {}
        stored = {k: v for k, v in stored.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 1}
        before = dict(stored)
        yield stored
        if stored != before:
            write_text_atomic(path, json.dumps(stored, indent=1, sort_keys=True) + "\n")


def _time_crossover(layers: list[ShapeAwareLinear], candidates: tuple[int, ...], repeats: int) -> int:
    """The crossover of one shape's layers, timed (see `calibrate_wide_rows`)."""
    repeats = max(repeats, min(8, 16 // len(layers)))  # a lone layer (an LM head): more timings
    weights = [lin.weight.detach() for lin in layers]  # [out, in] each
    shadows = [lin._shadow()[0] for lin in layers]
    bf16_s, fp32_s = {}, {}
    for rows in candidates:
        x = torch.randn(rows, layers[0].in_features).to(weights[0].dtype)  # [rows, in]
        x32 = x.float()
        bf16_s[rows] = _time(lambda: [F.linear(x, w) for w in weights], repeats)
        fp32_s[rows] = _time(lambda: [F.linear(x32, w).to(x.dtype) for w in shadows], repeats)
    return _crossover(bf16_s, fp32_s)
