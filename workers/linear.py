"""Inference-time linears: shape-aware CPU matmuls, and fused projections.

Words used here:
- **MACs** of a matmul: rows × in_features × out_features (multiply-accumulates).
- **packed weight**: a bf16/fp16 weight reordered once into oneDNN's blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing uses). A plain bf16
  `F.linear` on CPU re-lays the weight out on every call, a fixed cost of ~15–40 µs (one thread);
  the packed call skips it and is 10–45% faster at every size measured (docs/cpu-performance.md).
- **shadow**: a float32 copy of the weight. fp32 has no fixed cost at all, but reads twice the
  bytes, so it only wins for tiny matmuls (one row through a 256 × 256 weight).
- **native low precision**: whether oneDNN computes bf16 (fp16) matmuls in hardware (AVX-512
  BF16 / AMX: `torch.ops.mkldnn._is_mkldnn_bf16_supported()`). Without it (AVX2-only CPUs, e.g.
  AMD EPYC before Zen 4) a bf16 matmul is emulated: ~5 GMAC/s on one core against ~45 in fp32,
  so its cost grows with every row, while fp32's stays near the time to read the weight.
- **wide matmul**: one with at least `WIDE_ROWS` rows (tokens in the forward: a prefill chunk,
  a verify block, a batch of 10+ decoding rows).
- **shape-aware linear**: per call, matmuls of at most `SMALL_MATMUL_MACS` MACs use the shadow
  (input cast to fp32, output cast back to the input dtype), larger ones the packed weight. Only
  layers whose one-row matmul is within the threshold get a shadow, so for big models only the
  small projections do. Where the CPU has no native low precision, wide matmuls use an fp32
  shadow too (every layer may get one then, built at its first wide call: the fp32 copy doubles
  the weights' memory; a SmolLM2 forward 1.5x faster at 16 tokens, 4x for a 256-token prefill,
  docs/cpu-performance.md, "Wide fp32 matmuls"). The
  copies are built on first use (parts of a fused projection never are). Off the CPU, or for
  fp32 weights, it is exactly `nn.Linear`.
- **fused projection**: several linears that read the same input (q/k/v, gate/up) computed as one
  matmul over their concatenated weights. The parts keep their parameters (and so their names,
  `state_dict` and loading), whose storage becomes a slice of the fused weight: no extra memory.

Both are inference-only derived state. They are rebuilt when the parameters are moved or cast
(`.to()`) or reloaded (`load_state_dict`), so they never go stale; training code never creates them.
Memory: a packed copy of each used bf16 weight (same size), plus the small layers' fp32 shadows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# Calibrated with one thread on the demo's shapes, weights not in cache (`adapt bench forward
# variants --linears`): against the packed path fp32 wins for 1–4 rows through
# 256 × 256 (17–21 vs 22–24 µs) and loses for one row through 256 × 768 (42 vs 36 µs, 197K MACs).
SMALL_MATMUL_MACS = 150_000
# Tokens from which a CPU without native bf16 runs a bf16 layer through its fp32 shadow. Measured
# on SmolLM2-135M, two threads, an AMD EPYC with AVX2 only (`adapt bench forward variants
# --wide-table`, docs/cpu-performance.md "Wide fp32 matmuls"): emulated bf16 costs ~21 ms per token per
# forward, fp32 ~200 ms flat up to ~16 tokens (reading 4-byte weights), so the two cross at 8–10.
WIDE_ROWS = 10
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight [out, in] gets a packed copy: CPU, bf16/fp16 that oneDNN supports."""
    if weight.device.type != "cpu" or weight.dtype not in _LOW_PRECISION:
        return False
    mkldnn = torch.ops.mkldnn
    try:
        return bool(mkldnn._is_mkldnn_bf16_supported() if weight.dtype == torch.bfloat16 else mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def wants_wide_shadow(weight: torch.Tensor) -> bool:
    """Whether wide matmuls through this weight [out, in] run in fp32: a CPU bf16/fp16 weight
    whose dtype the CPU has no native matmuls for."""
    return weight.device.type == "cpu" and weight.dtype in _LOW_PRECISION and not can_pack(weight)


def wants_shadow(weight: torch.Tensor, threshold: int = SMALL_MATMUL_MACS) -> bool:
    """Whether a layer with this weight [out, in] gets an fp32 shadow: CPU, bf16/fp16, and a
    one-row matmul within `threshold` MACs."""
    return weight.device.type == "cpu" and weight.dtype in _LOW_PRECISION and weight.numel() <= threshold


def use_fp32(rows: int, in_features: int, out_features: int, threshold: int = SMALL_MATMUL_MACS) -> bool:
    """The per-call choice of a layer that has a shadow: fp32 for matmuls of at most `threshold` MACs."""
    return rows * in_features * out_features <= threshold


class ShapeAwareLinear(nn.Linear):
    """`nn.Linear` that, on CPU, runs tiny matmuls through an fp32 shadow and the rest through a
    packed weight (module docstring). Build it with `from_linear`, which shares the Parameters."""

    threshold: int = SMALL_MATMUL_MACS
    wide_rows: int | None = WIDE_ROWS  # None: never the wide fp32 path

    @classmethod
    def from_linear(cls, linear: nn.Linear, threshold: int = SMALL_MATMUL_MACS,
                    wide_rows: int | None = WIDE_ROWS) -> "ShapeAwareLinear":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias  # the same Parameter objects (ties survive)
        new.threshold, new.wide_rows = threshold, wide_rows
        new.register_load_state_dict_post_hook(_after_load)
        return new

    def refresh(self) -> None:
        """Forget the derived copies; the next call rebuilds them from the current weights."""
        self.__dict__.pop("_derived", None)
        self.__dict__.pop("_fp32", None)

    def _derive(self) -> tuple:
        """(small, packed weight, wide): whether matmuls within `threshold` MACs take the fp32
        shadow; the packed weight or None; whether wide matmuls take the fp32 shadow."""
        w = self.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1) if can_pack(w) else None  # layout tuned for few rows
        small = wants_shadow(w, self.threshold)
        wide = self.wide_rows is not None and wants_wide_shadow(w)
        self.__dict__["_derived"] = (small, packed, wide)
        return self.__dict__["_derived"]

    def _shadow(self) -> tuple:
        """The fp32 copies of the weight and bias (built at the first call that needs them, kept
        until `refresh`)."""
        if "_fp32" not in self.__dict__:
            b32 = None if self.bias is None else self.bias.detach().float()
            self.__dict__["_fp32"] = (self.weight.detach().float(), b32)
        return self.__dict__["_fp32"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled program packs its own weights (workers/compiled.py)
            return F.linear(x, self.weight, self.bias)
        small, packed, wide = self.__dict__.get("_derived") or self._derive()
        if ((small and x.numel() * self.out_features <= self.threshold)  # numel = rows × in
                or (wide and x.numel() >= self.wide_rows * self.in_features)):  # a wide matmul, no native bf16
            w32, b32 = self._shadow()
            return F.linear(x.float(), w32, b32).to(x.dtype)
        if packed is not None and x.dtype == self.weight.dtype:
            bias = None if self.bias is None else self.bias.detach()
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.refresh()
        return out

    def __getstate__(self):  # packed oneDNN weights cannot be copied or pickled; they are rebuilt
        state = self.__dict__.copy()
        state.pop("_derived", None)
        state.pop("_fp32", None)
        return state


def _after_load(module: nn.Module, _incompatible_keys) -> None:
    """load_state_dict post hook: rebuild the module's derived weights from the loaded ones."""
    module.refresh()


def make_shape_aware(module: nn.Module, threshold: int = SMALL_MATMUL_MACS, wide_rows: int | None = WIDE_ROWS) -> nn.Module:
    """Replace every `nn.Linear` under `module` (itself included) by a `ShapeAwareLinear` sharing
    its Parameters; names, ties and `state_dict` are unchanged. Returns the (new) module."""
    if isinstance(module, ShapeAwareLinear):
        return module
    if type(module) is nn.Linear:
        return ShapeAwareLinear.from_linear(module, threshold, wide_rows)
    for name, child in list(module.named_children()):
        new = make_shape_aware(child, threshold, wide_rows)
        if new is not child:
            setattr(module, name, new)
    return module


def fuse_linears(parts: list[nn.Linear], threshold: int | None = SMALL_MATMUL_MACS,
                 wide_rows: int | None = WIDE_ROWS) -> nn.Linear:
    """One linear whose output is `cat([p(x) for p in parts], -1)`. Each part's weight (and bias)
    storage becomes a row slice of the fused one, so the parts keep working and loading into them
    writes through. `threshold` None: a plain `nn.Linear`, else a `ShapeAwareLinear`. The result
    is not registered anywhere: callers keep it outside their `state_dict`."""
    ref = parts[0].weight
    if any(p.in_features != parts[0].in_features for p in parts):
        raise ValueError("fused linears must share in_features")
    has_bias = [p.bias is not None for p in parts]
    with torch.no_grad():
        weight = torch.cat([p.weight.detach() for p in parts])  # [sum out, in]
        bias = None
        if any(has_bias):
            bias = torch.cat([p.bias.detach() if p.bias is not None else ref.new_zeros(p.out_features) for p in parts])
    fused = nn.Linear(parts[0].in_features, weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    if threshold is not None:
        fused = ShapeAwareLinear.from_linear(fused, threshold, wide_rows)
    rows = 0
    for p in parts:
        sl = slice(rows, rows + p.out_features)
        p.weight.data = fused.weight.data[sl]
        if p.bias is not None:
            p.bias.data = fused.bias.data[sl]
        if isinstance(p, ShapeAwareLinear):
            p.refresh()  # its copies (if ever used) are rebuilt from the new storage
        rows += p.out_features
    return fused


class Fusable(nn.Module):
    """Mixin for a module that can compute groups of its linears as one matmul.

    Subclasses set `FUSE = {"qkv": ("q_proj", "k_proj", "v_proj"), ...}` (submodule paths) and read
    `self.fused("qkv")` (None until `fuse()`) in their forward. The fused linears live outside the
    module's parameters and are rebuilt after `.to()` and `load_state_dict`."""

    FUSE: dict[str, tuple[str, ...]] = {}

    def fuse(self, threshold: int | None = SMALL_MATMUL_MACS, wide_rows: int | None = WIDE_ROWS) -> None:
        """Build the fused linears (`threshold` and `wide_rows` as in `fuse_linears`)."""
        self.__dict__["_fuse_threshold"] = threshold, wide_rows
        if not self.__dict__.get("_fuse_hooked"):
            self.register_load_state_dict_post_hook(_after_load)
            self.__dict__["_fuse_hooked"] = True
        self.__dict__["_fused"] = {name: fuse_linears([self.get_submodule(p) for p in paths], threshold, wide_rows)
                                   for name, paths in self.FUSE.items()}

    def unfuse(self) -> None:
        self.__dict__.pop("_fused", None)

    def fused(self, name: str) -> nn.Linear | None:
        table = self.__dict__.get("_fused")
        return None if table is None else table[name]

    def _refuse(self) -> None:
        if "_fused" in self.__dict__:
            self.fuse(*self.__dict__["_fuse_threshold"])

    def refresh(self) -> None:  # called after load_state_dict
        self._refuse()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._refuse()
        return out


def prepare_for_inference(module: nn.Module, shape_aware: bool = True, fuse: bool = True,
                          threshold: int = SMALL_MATMUL_MACS, wide_rows: int | None = WIDE_ROWS) -> nn.Module:
    """Make `module` (already on its device and dtype) fast for inference: every `Fusable` under
    it builds its fused projections (`fuse`), and on CPU every linear becomes a
    `ShapeAwareLinear` (`shape_aware`; a no-op elsewhere, where linears stay plain; `wide_rows`
    None: no wide fp32 matmuls, else as `WIDE_ROWS`). Parameter
    names, ties and `state_dict` are unchanged. Returns the module."""
    param = next(module.parameters(), None)
    sa = shape_aware and param is not None and param.device.type == "cpu"
    if sa:
        module = make_shape_aware(module, threshold, wide_rows)
    for m in reversed(list(module.modules())):  # children before parents: an outer fusion wins
        if isinstance(m, Fusable):
            if fuse:
                m.fuse(threshold if sa else None, wide_rows)
            else:
                m.unfuse()
    return module
