"""Slot-based key/value cache for ragged batches.

One preallocated tensor pair per layer, `[max_batch, kv_heads, max_len, head_dim]`. Each running
request owns one *slot* (a row). The engine keeps the running requests in slots `0 .. n-1`
(compact), so every batched call works on plain views `cache[:n, :, :W]` without gathering.
When a request leaves, the request in the last slot moves into its place (`move`), one copy per
layer, once per departure.

The cache stores no lengths: the engine owns each row's length (host-side integers, mirrored in
the tensors it passes to the forward). Rolling back rejected positions is therefore free: the
engine sets the length back and the stale entries past it are masked out and later overwritten.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, max_batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.max_batch, self.max_len = max_batch, max_len
        shape = (max_batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def view(self, layer: int, row0: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots `row0 .. row0 + rows - 1`, positions `< width`: each
        `[rows, kv_heads, width, head_dim]`, a view (writes go into the cache)."""
        if width > self.max_len:
            raise ValueError(f"cache window {width} exceeds the cache length {self.max_len}")
        k, v = self.k[layer], self.v[layer]
        if torch.compiler.is_compiling():  # a compiled forward slices (as_strided on an offset does not trace)
            return k[row0 : row0 + rows, :, :width], v[row0 : row0 + rows, :, :width]
        shape, strides = (rows, k.shape[1], width, k.shape[3]), k.stride()  # one as_strided: ~1 µs, two slices ~2.5
        offset = row0 * strides[0]
        return (k.as_strided(shape, strides, k.storage_offset() + offset),
                v.as_strided(shape, strides, v.storage_offset() + offset))

    def views(self, row0: int, rows: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.view(i, row0, rows, width) for i in range(self.num_layers)]

    def write(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], row0: int, start: torch.Tensor) -> None:
        """Write new entries for rows `row0 ..`: layer_kv per layer (k, v) each [B, kvh, T, d], row r's
        entry t at position start[r] + t (start [B] int64)."""
        T = layer_kv[0][0].shape[2]
        pos = start[:, None] + torch.arange(T, device=start.device)  # [B, T]
        self._put(layer_kv, torch.arange(row0, row0 + len(start), device=start.device), pos)

    def write_span(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], row0: int, start: int) -> None:
        """Like `write` when every row starts at the same host-known position `start`: plain
        copies into `[row0 : row0 + B, :, start : start + T]` (no index tensors, no index_put_)."""
        B, _, T, _ = layer_kv[0][0].shape
        for i, (k, v) in enumerate(layer_kv):
            self.k[i][row0 : row0 + B, :, start : start + T] = k
            self.v[i][row0 : row0 + B, :, start : start + T] = v

    def write_rows(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor,
                   start: torch.Tensor) -> None:
        """Like `write`, for any slots: rows [B] int64 slot indices, start [B] int64. Positions past
        the cache end are clamped onto its last entry (callers only send such entries as padding)."""
        T = layer_kv[0][0].shape[2]
        pos = (start[:, None] + torch.arange(T, device=start.device)).clamp(max=self.max_len - 1)  # [B, T]
        self._put(layer_kv, rows, pos)

    def _put(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, pos: torch.Tensor) -> None:
        """layer_kv per layer (k, v) each [B, kvh, T, d] into slots rows [B] at positions pos [B, T].
        index_put_ on the [max_batch, max_len, kvh, d] view: a scatter_ into a strided view of the
        cache costs ~30 µs per row and layer on CPU, this a few µs in all."""
        slots = rows[:, None].expand_as(pos)
        for i, (k, v) in enumerate(layer_kv):
            self.k[i].transpose(1, 2).index_put_((slots, pos), k.transpose(1, 2).to(self.k[i].dtype))
            self.v[i].transpose(1, 2).index_put_((slots, pos), v.transpose(1, 2).to(self.v[i].dtype))

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (compaction on departure)."""
        if src == dst or length <= 0:
            return
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def gather(self, rows: torch.Tensor, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the entries of the given slots (a subset of the batch), positions `< width`."""
        return [(k[rows, :, :width], v[rows, :, :width]) for k, v in zip(self.k, self.v)]
