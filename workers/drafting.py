"""Drafting: the drafter's context cache and the one denoising loop.

Words:
- **drafter context**: the K/V the drafter's layers attend to, projected from the target's
  hidden states at committed positions (`DrafterContext.cache`, one slot per running request).
- **lazy context commit**: a row's context K/V of positions `[ctx_len, L)` are computed only when
  the row next drafts (or when its stash of `PENDING_WINDOW` positions fills), from the target
  hidden states kept in `pending`. Rows that decode without drafts thus pay one batched context
  pass per `PENDING_WINDOW` tokens instead of one per step.
- **denoising**: the drafter starts from the block `[anchor, MASK x K]` and in each of `s` passes
  commits some still-masked positions (most-confident-first or left-to-right, `select_commit`),
  recording the distribution q each committed token was drawn from. `denoise` is the only
  denoising loop: the engine, `BlockDiffusionDrafter.draft` and the drafter's evaluation all
  call it, with their own one-pass function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.denoise import select_commit
from workers import draft_sources
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE
from workers.kv_cache import KVCache
from workers.sampling import argmax, inverse_cdf_sample, probabilities
from workers.step_batch import StepBatch, common_value

PENDING_WINDOW = 64  # target positions a row may stash before its drafter context is written


def commit_counts(steps: torch.Tensor, still: torch.Tensor, it: int) -> torch.Tensor:
    """[B] int32 positions each row commits in denoising pass `it`: its still-masked positions
    spread evenly over its remaining passes (ceil(masked / passes left)); 0 once `it` >= s."""
    left = (steps - it).clamp(min=1)
    return torch.where(steps > it, (still.sum(1) + left - 1) // left, 0).to(torch.int32)


def denoise(one_pass: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], anchor: torch.Tensor,
            steps: list[int], block: int, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
            top_p: torch.Tensor | None = None, left_to_right: torch.Tensor | None = None,
            uniforms: torch.Tensor | None = None, vocab_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Denoise one block per row; returns drafted tokens [B, K] int64 (target ids) and q
    [B, K, Vd] float32, the distribution each token was drawn from, over the draft vocabulary
    (rows with s = 0 commit nothing: tokens 0, q 0; at least one row must have s >= 1).

    one_pass(tokens, masked) -> logits [B, K, Vd] float32 of the K block positions over the draft
    vocabulary, given the block tokens / masked flags [B, K + 1] (the anchor first).
    `vocab_ids` [Vd]: the target id of each draft-vocabulary entry (a reduced draft vocabulary,
    `BlockDiffusionDrafter.draft_ids`), or None when the draft vocabulary is the target's. Every
    softmax, argmax and draw runs over the Vd entries only: target ids outside the draft
    vocabulary have q exactly 0, and at Vd = 8,192 of 49,152 this is ~6x less work per pass
    (`expand_to_vocab` gives q over the whole vocabulary where an acceptance rule reads it).
    anchor [B] int64; steps: s per row (host ints: the loop runs max(s) passes); temperature [B]
    (0 = argmax), top_k / top_p [B] or None; left_to_right [B] bool (None = most-confident-first
    everywhere); uniforms [B, max(s), K] U(0, 1) for sampled rows, one per (pass, position) (None
    when every row is greedy). A token is drawn by inverting the CDF of
    `probabilities(logits, T, top_k, top_p)` at its uniform.
    """
    B, K, dev = anchor.shape[0], block, anchor.device
    s_max = max(steps, default=0)
    if s_max < 1:
        raise ValueError("steps: denoise needs a row with s >= 1")
    s_d = torch.tensor(steps, device=dev)
    tokens = torch.zeros(B, K + 1, dtype=torch.long, device=dev)
    tokens[:, 0] = anchor
    masked = torch.ones(B, K + 1, dtype=torch.bool, device=dev)
    masked[:, 0] = False
    l2r = torch.zeros(B, dtype=torch.bool, device=dev) if left_to_right is None else left_to_right
    greedy = temperature <= 0
    rep = (lambda t: None if t is None else t.repeat_interleave(K))
    T_rep, tk_rep, tp_rep = rep(temperature), rep(top_k), rep(top_p)
    q_rec = None
    for it in range(s_max):
        logits = one_pass(tokens, masked)  # [B, K, V]
        if uniforms is None:  # every row greedy: `probabilities` at T = 0 is the plain softmax, bit for bit
            q = torch.softmax(logits, -1)
            x = argmax(q)  # [B, K]
        else:
            q = probabilities(logits.flatten(0, 1), T_rep, tk_rep, tp_rep).view(B, K, -1)
            x = torch.where(greedy[:, None], argmax(q), inverse_cdf_sample(q, uniforms[:, it]))  # [B, K]
        ids = x if vocab_ids is None else vocab_ids[x]  # [B, K] target ids
        if s_max == 1 and min(steps) == 1:  # one pass: every row commits its whole block
            return ids, q
        if q_rec is None:
            q_rec = torch.zeros_like(q)
        c = q.gather(-1, x[..., None]).squeeze(-1)
        still = masked[:, 1:]
        commit = select_commit(c, still, commit_counts(s_d, still, it), l2r)
        tokens[:, 1:] = torch.where(commit, ids, tokens[:, 1:])
        q_rec = torch.where(commit[..., None], q, q_rec)
        masked[:, 1:] = still & ~commit
    return tokens[:, 1:], q_rec


def draw_uniforms(generators: list, steps: list[int], block: int, device) -> torch.Tensor | None:
    """[B, max(s), K] denoising uniforms, row r's first s_r passes drawn from its own generator
    (None = greedy, zeros); None when no row samples."""
    if all(g is None for g in generators):
        return None
    u = torch.zeros(len(generators), max(steps), block, device=device)
    for b, (g, s) in enumerate(zip(generators, steps)):
        if g is not None:
            u[b, :s].uniform_(generator=g)
    return u


class DrafterContext:
    """The drafter-context cache of an engine's slots and the stash of target hidden states not
    yet written to it (see the module docstring). `context_kv(hidden, positions)` projects hidden
    states [n, P, width] to per-layer K/V; `draft_pass(tokens, masked, ctx, mask, cos, sin)` is
    the drafter's one denoising pass (`BlockDiffusionDrafter.block_logits`, maybe compiled)."""

    def __init__(self, drafter, context_kv, draft_pass, max_batch: int, capacity: int, width: int,
                 dtype: torch.dtype, device: torch.device, temperature_scale: float = 1.0, subset_rows: int = 0):
        dc = drafter.config
        # a sampled row's draft is drawn at its temperature times this (`EngineConfig.draft_temperature_scale`)
        self.temperature_scale = float(temperature_scale)
        self.drafter, self.context_kv, self.draft_pass = drafter, context_kv, draft_pass
        self.block, self.vocab, self.device = dc.block_size, dc.vocab_size, device
        self.cache = KVCache(dc.num_layers, max_batch, dc.num_kv_heads, capacity, dc.head_dim, dtype=dtype, device=device)
        # [max_batch, PENDING_WINDOW, n * H] target hidden states not yet in the drafter context
        self.pending = torch.zeros(max_batch, PENDING_WINDOW, width, dtype=dtype, device=device)
        # the denoising pass from a compiled package (workers/aot.py `AotDraftPass`), or None:
        # it takes passes over every row (the cache's first slots) where it `fits`
        self.program = None
        # the context commit of `flush` from a compiled package (`AotContextWrite`), or None
        self.writer = None
        # passes over a subset of at most this many rows run the package too, over their slots or
        # a scratch copy of their context (`subset_kv`; 0: eagerly over gathered copies)
        self.subset_rows = int(subset_rows)
        self._scratch: KVCache | None = None  # made at the first such pass, grown to the rows it needs

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """[Vd] target ids of the draft vocabulary (a reduced one), or None (the whole vocabulary)."""
        return self.drafter.draft_ids

    def write_prompt(self, hidden: torch.Tensor, row0: int) -> None:
        """Write the context of prompts prefilled into slots row0 .. row0 + m (hidden [m, P, width]),
        after zeroing those slots, so that a new request never depends on what a slot held before:
        its masked columns (past its length, under a longer row's window) enter attention with
        weight 0, and 0 times a non-finite value is NaN. (A drafter package given the whole cache
        wrote non-finite block columns into free slots; workers/aot.py `DraftPassForward`.)"""
        m, P = hidden.shape[:2]
        for t in (*self.cache.k, *self.cache.v):
            t[row0:row0 + m].zero_()
        pos = torch.arange(P, device=self.device).expand(m, P)
        self.cache.write_span(self.drafter.context_kv(hidden, pos, bound=self.cache.max_len), row0, 0)

    def stash(self, running: list, hidden: torch.Tensor, Tq: int) -> None:
        """Keep the target hidden states [B, Tq, width] of this step's positions L .. L + Tq − 1 of
        every running row until it drafts (positions past its new length are overwritten later).
        Rows whose stash would overflow are flushed first."""
        full = [i for i, r in enumerate(running) if r.length - r.ctx_len + Tq > PENDING_WINDOW]
        if full:
            self.flush(running, full)
        B, dev = len(running), self.device
        offs = [r.length - r.ctx_len for r in running]
        off = common_value(offs)
        if off is not None:  # the same offset for every row: one plain copy (index_put_ costs ~8x more)
            self.pending[:B, off : off + Tq] = hidden
            return
        offs = torch.tensor(offs, device=dev)                                             # [B]
        rows = torch.arange(B, device=dev)[:, None].expand(B, Tq)
        self.pending.index_put_((rows, offs[:, None] + torch.arange(Tq, device=dev)), hidden.to(self.pending.dtype))

    def flush(self, running: list, idx: list[int]) -> None:
        """Write the drafter-context K/V of the stashed positions [ctx_len, L) of rows `idx`."""
        dev = self.device
        idx = [i for i in idx if running[i].length > running[i].ctx_len]
        if not idx:
            return
        P = max(running[i].length - running[i].ctx_len for i in idx)
        bound = self.cache.max_len
        starts = [running[i].ctx_len for i in idx]
        common = common_value(starts)
        contiguous = idx == list(range(idx[0], idx[0] + len(idx)))
        if self.writer is not None and self.writer.fits(len(idx), P):  # one program call
            rows = torch.tensor(idx, device=dev)
            hidden = self.pending[idx[0] : idx[0] + len(idx), :P].contiguous() if contiguous else self.pending[rows, :P]
            self.writer(hidden, rows, torch.tensor(starts, device=dev))
        elif common is not None and contiguous:  # a slice of rows, one start
            # fresh contiguous tensors, as the gathered rows below are, whatever P: a compiled
            # context_kv then has the same programs for both (a slice of the stash is contiguous
            # only when P = PENDING_WINDOW, and is not an inference tensor)
            pos = torch.arange(common, common + P, device=dev).repeat(len(idx), 1)      # [n, P]
            kv = self.context_kv(self.pending[idx[0] : idx[0] + len(idx), :P].clone(), pos)
            self.cache.write_span(kv, idx[0], common)
        else:
            rows = torch.tensor(idx, device=dev)
            start = torch.tensor(starts, device=dev)                                     # [n]
            pos = start[:, None] + torch.arange(P, device=dev)                           # [n, P]
            # a row's entries past its own count land at positions >= L: masked, overwritten later
            kv = self.context_kv(self.pending[rows, :P], pos.clamp(max=bound - 1))
            self.cache.write_rows(kv, rows, start)
        for i in idx:
            running[i].ctx_len = running[i].length

    def move(self, src: int, dst: int, req) -> None:
        """Move slot `src`'s context and stash to slot `dst` (a request's slot changes)."""
        self.cache.move(src, dst, req.ctx_len + 1)
        n = req.length - req.ctx_len
        if n > 0:
            self.pending[dst, :n] = self.pending[src, :n]

    def block_pass(self, ctx, mask: torch.Tensor | None, rope, rows: int, block: int, window: int,
                   everyone: bool = True, subset: list[torch.Tensor] | None = None):
        """One denoising pass as a function ``(tokens, masked) [rows, block] -> logits [rows,
        block − 1, Vd]``: the drafter package's where it takes the shape (``everyone``: a pass over
        the cache's first ``rows`` slots, every row of the batch; or ``subset``: `subset_kv`'s views
        or copy of some rows' context), else the engine's own pass over ``ctx`` (per-layer cache views or
        gathered copies, ``window`` columns). mask: [rows, 1, window] additive, or None (every row
        attends to every column); rope: (cos, sin)."""
        if (everyone or subset is not None) and self.program is not None and self.program.fits(rows, block, window):
            if mask is None:  # the program always takes one
                mask = torch.zeros(rows, 1, window, dtype=self.drafter.mask_embedding.dtype, device=self.device)
            if subset is not None:
                return lambda tokens, masked: self.program(tokens, masked, mask, *rope, kv=subset)
            return lambda tokens, masked: self.program(tokens, masked, mask, *rope)
        return lambda tokens, masked: self.draft_pass(tokens, masked, ctx, mask, *rope)

    def subset_kv(self, sel: list[int], window: int) -> list[torch.Tensor]:
        """The drafter context of slots ``sel`` (n host ints, increasing) as the drafter package
        takes its slots: every layer's K, then every layer's V, each ``[n, kv_heads, cache length,
        head_dim]``. Consecutive slots are views of the cache (as a pass over every row reads the
        first ones); others are copied (positions below ``window``) into the first n rows of a
        scratch cache shaped as this one, made at the first such call and grown to the rows asked
        for (~9.5 MB a row for SmolLM2's drafter at 2,064 positions). A pass writes its block's
        keys and values into the columns past the rows' context (below ``window``): free columns
        of the engine's cache for views, as in a pass over every row, the scratch for copies.
        Columns at or past ``window`` are never read."""
        n, c = len(sel), self.cache
        if sel == list(range(sel[0], sel[0] + n)):
            return [t[sel[0]:sel[0] + n] for t in c.k + c.v]
        if self._scratch is None or self._scratch.max_batch < n:
            self._scratch = KVCache(c.num_layers, n, c.k[0].shape[1], c.max_len, c.k[0].shape[3],
                                    dtype=c.k[0].dtype, device=self.device)
        out = []
        for dst, src in zip(self._scratch.k + self._scratch.v, c.k + c.v):
            for j, slot in enumerate(sel):  # a plain strided copy per row: ~4x faster than an indexed gather
                dst[j, :, :window].copy_(src[slot, :, :window])
            out.append(dst[:n])
        return out

    def draft(self, batch: StepBatch, rows: list[int], span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Denoise `[anchor, MASK x K]` for rows `rows` of `batch` (whose context must be written:
        `flush` them first), K = `span` (the first `span` positions of the drafter's block; default
        the whole block: a step that verifies at most `span` drafted tokens need not denoise the rest).
        Returns drafted tokens [Bd, K] (target ids) and q [Bd, K, Vd], the distribution each was
        drawn from, over the draft vocabulary (`denoise`; `self.vocab_ids` are its target ids).

        The block's keys / values go into the drafter-context cache right after the longest
        row's context (columns C .. C + K, free: past every drafting row's length), so attention
        reads context and block in place; RoPE and the mask are built once for all passes."""
        running = batch.requests
        dev, K, dr = self.device, min(span or self.block, self.block), self.drafter
        everyone = len(rows) == batch.size
        sel = None if everyone else torch.tensor(rows, device=dev)
        pick = (lambda t: t) if everyone else (lambda t: None if t is None else t[sel])
        Bd = len(rows)
        L = pick(batch.lengths)
        lens = [batch.lengths_host[i] for i in rows]
        C = max(lens)
        W = C + K + 1  # context columns, then the block's
        subset = None  # a subset of rows: the package over their slots or a copy where it takes them
        if not everyone and self.program is not None and Bd <= self.subset_rows and self.program.fits(Bd, K + 1, W):
            ctx, subset = None, self.subset_kv(rows, W)
        else:
            ctx = self.cache.views(0, Bd, W) if everyone else self.cache.gather(sel, W)
        dtype = dr.mask_embedding.dtype
        mask = None  # one context length: every row attends to all W columns
        if common_value(lens) is None:
            cols = torch.arange(W, device=dev)
            attend = (cols[None] < L[:, None]) | (cols[None] >= C)  # [Bd, W]: own context and the block
            mask = torch.zeros(Bd, 1, W, dtype=dtype, device=dev).masked_fill_(~attend[:, None], float("-inf"))
        positions = L[:, None] + torch.arange(K + 1, device=dev)  # [Bd, K + 1]
        rope = dr.rope(positions, dtype, bound=self.cache.max_len)
        steps = [batch.steps_host[i] for i in rows]
        # drawn for the whole block (a row's generator advances alike whatever the span)
        uniforms = draw_uniforms([running[i].generator for i in rows], steps, self.block, dev)
        uniforms = None if uniforms is None else uniforms[..., :K]
        temperature = pick(batch.temperature)  # [Bd]; 0 stays 0 (greedy rows draft by argmax)
        if self.temperature_scale != 1.0:
            temperature = temperature * self.temperature_scale
        return denoise(self.block_pass(ctx, mask, rope, Bd, K + 1, W, everyone, subset), pick(batch.anchors),
                       steps, K, temperature, pick(batch.top_k), pick(batch.top_p),
                       pick(batch.left_to_right), uniforms, self.vocab_ids)


@dataclass(frozen=True)
class StepDrafts:
    """Every row's draft in a step, padded to the engine's width K (rows without a draft: zeros):
    tokens, q (None unless a diffusion row drafted: the distribution each token was drawn from,
    over the draft vocabulary, whose target ids are `vocab_ids`; None = the whole vocabulary),
    the features the decision maker and the traces read (confidence: max of q, or a point-mass
    token's probability under its source, e.g. a suffix token's vote share; entropy and margin
    of q), and the drafted tokens per row (the most each may verify)."""

    tokens: torch.Tensor       # [B, K] int64
    q: torch.Tensor | None     # [B, span, Vd] float32
    confidence: torch.Tensor   # [B, K] float32
    entropy: torch.Tensor      # [B, K] float32
    margin: torch.Tensor       # [B, K] float32
    lengths: torch.Tensor      # [B] int64 (host)
    vocab_ids: torch.Tensor | None = None  # [Vd] int64


def draft_step(engine, batch: StepBatch, with_features: bool) -> StepDrafts:
    """The drafts of one step: each source that some row's applied intent names
    (`StepBatch.source`) proposes the drafts of its rows (workers/draft_sources.py: diffusion
    rows are denoised together over the first `span` positions of the block, suffix rows take
    their suffix drafts). `with_features`: compute the diffusion rows' features (a top-2 and an
    entropy over [B, span, Vd]); zeros otherwise. At most one source's drafts carry q (diffusion)."""
    B, K = batch.size, engine.width
    dev = batch.lengths.device
    vocab_ids = None if engine.drafting is None else engine.drafting.vocab_ids
    codes = sorted(set(batch.source_host) - {NONE_CODE})
    if codes == [DIFFUSION_CODE] and len(batch.diffusion_rows) == B:  # every row by diffusion: its drafts are the step's
        p = draft_sources.by_code(DIFFUSION_CODE).propose(engine, batch, list(range(B)), with_features)
        span = p.tokens.shape[1]
        pad = (lambda t: t) if span == K else (lambda t: torch.nn.functional.pad(t, (0, K - span)))  # zeros past the span
        return StepDrafts(pad(p.tokens), p.q, pad(p.confidence), pad(p.entropy), pad(p.margin), p.lengths, vocab_ids)
    tokens = torch.zeros(B, K, dtype=torch.long, device=dev)
    conf = torch.zeros(B, K, device=dev)
    ent, margin = torch.zeros_like(conf), torch.zeros_like(conf)
    lengths = torch.zeros(B, dtype=torch.int64)
    q_all = None
    for code in codes:
        idx = [i for i, c in enumerate(batch.source_host) if c == code]
        p = draft_sources.by_code(code).propose(engine, batch, idx, with_features)
        W = p.tokens.shape[1]
        sel = torch.tensor(idx, device=dev)
        tokens[sel, :W], conf[sel, :W] = p.tokens.to(dev), p.confidence.to(dev)
        if p.entropy is not None:
            ent[sel, :W], margin[sel, :W] = p.entropy, p.margin
        if p.q is not None:  # q stays `W` wide: no row of this source verifies past it (`Engine._plan` caps k;
            # a point-mass row may, and `Verifier.ragged` pads q for it)
            q_all = torch.zeros(B, W, p.q.shape[-1], device=dev).index_copy_(0, sel, p.q)
        lengths[idx] = p.lengths
    return StepDrafts(tokens, q_all, conf, ent, margin, lengths, vocab_ids)
