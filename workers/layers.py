"""Building blocks shared by the target model and the drafter: RMSNorm, rotary embeddings, SwiGLU.

On CPU at decode sizes (a few rows of a few hundred features) every eager op costs a fixed few
µs whatever its size, so these blocks are written with as few ops as their numerics allow
(docs/cpu-performance.md, "Fewer ops per step"): RMSNorm is 6 ops (HF's form is 9), RoPE 4 (was 7).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.linear import Fusable


class RMSNorm(nn.Module):
    """Llama RMSNorm with Hugging Face's numerics: the statistics and the scaling in float32,
    rounded to the input dtype before the (input-dtype) weight multiplies.

    The sum of squares is one fused reduction (`vector_norm` accumulating in float32, without a
    float32 copy of the input), `mean + eps` one `addcmul`; HF's pow / mean / add / rsqrt / mul
    chain computes the same float32 values up to rounding (1 ulp of float32)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _eps_tensor(self, device: torch.device) -> torch.Tensor:
        """`eps` as a float32 0-dim tensor on `device` (addcmul adds to a tensor), kept outside
        the state; a normal tensor even when first made under inference mode, for training."""
        eps = self.__dict__.get("_eps_t")
        if eps is None or eps.device != device:
            with torch.inference_mode(False):
                eps = torch.tensor(self.eps, dtype=torch.float32, device=device)
            self.__dict__["_eps_t"] = eps
        return eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This norm of x [..., dim] with any `weight` broadcastable to x (callers normalising the
        heads of several norms of the same eps at once pass their weights stacked)."""
        xs = x if x.dtype != torch.float64 else x.float()  # HF computes in float32 whatever comes in
        norm = torch.linalg.vector_norm(xs, dim=-1, keepdim=True, dtype=torch.float32)  # [..., 1]
        inv = torch.addcmul(self._eps_tensor(x.device), norm, norm, value=1.0 / x.shape[-1]).rsqrt_()
        return weight * (xs * inv).to(x.dtype)  # xs * inv promotes to float32, as HF's x.float()


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Rotary tables for integer `positions` [...]: cos, sin each [..., head_dim] (HF half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [..., head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_cos_signed_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """[..., 2, head_dim]: cos, and sin with its first half negated (`signed sin`), for
    `rotate_signed`. The same values as `rope_cos_sin` (negation is exact)."""
    cos, sin = rope_cos_sin(positions, head_dim, theta, dtype)
    half = head_dim // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return torch.stack((cos, signed), dim=-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., d] with cos/sin broadcastable to it (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`rotate(x, cos, sin)` in 4 ops instead of 7, bit for bit: HF's rotate_half(x) * sin is
    (x with its halves swapped) * (sin with its first half negated), and swapping the halves is
    one `roll`. x [..., d]; cos / signed_sin broadcastable to it (`rope_cos_signed_sin`)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, d]; cos/sin [B, T, d]."""
    return rotate(x, cos[:, None], sin[:, None])


class SwiGLU(Fusable):
    """down(silu(gate(x)) * up(x)); gate and up are one matmul once fused (workers/linear.py)."""

    FUSE = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.fused("gate_up")
        if gate_up is not None:
            gate, up = gate_up(x).chunk(2, dim=-1)  # [..., I] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)
