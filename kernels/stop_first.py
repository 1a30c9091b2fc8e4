"""Stop-first verification: the CPU backend of `kernels.verify`.

A row of the ragged batch emits its accepted drafts and then one token, sampled at its *stop
row*: the target row of its first rejected draft, or its bonus row when every draft is accepted.
The per-position backends (`kernels.reference`, `kernels.triton_verify`) sample the token of
every target row, one draw over the vocabulary each, and keep one per request. Here the accept
decisions come first, from what each rule's accept reads (its `kernels.rules.RuleSpec`: GREEDY:
argmax p; REJECTION and MATCH: p(x), q(x) and a coin; EPS_TVD: a vocabulary sum), and the token
is sampled at the stop rows only: one draw per request instead of one per target row, and q
spread over the whole vocabulary only at the rows that read it (`reads_q_rows`, and stop rows
whose residual is p - q).

The arithmetic of every row is the reference's (`kernels.reference.decide_accept` and
`emit_token`, same tensors, same uniforms), so tokens, accept counts and TVD are the
reference's (tests/test_kernels_equal.py). On CPU, where the vocabulary sweeps are the cost,
this is the default; on CUDA the Triton kernel sweeps every row in parallel.

Draft distributions may come over the drafter's own vocabulary: `draft_probs` [N, Vd] with
`draft_ids` [Vd] (the target ids of its columns), q = 0 elsewhere.
"""

from __future__ import annotations

import torch

from kernels.layout import RaggedLayout
from kernels.reference import decide_accept, emit_token, per_row_outputs
from kernels.rules import RESIDUAL_ARGMAX, RESIDUAL_P_MINUS_Q, spec_of


def spread(probs: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """q [n, V] from `probs` [n, Vd] over target ids `ids` [Vd] (0 elsewhere); `probs` itself
    when `ids` is None."""
    if ids is None:
        return probs
    return torch.zeros(probs.shape[0], vocab, dtype=probs.dtype, device=probs.device).index_copy_(1, ids, probs)


class DraftProbs:
    """Rows of q over the target vocabulary, read from `probs` [N, Vd] over draft ids `ids` [Vd]
    (None: Vd = V) without spreading all of them: `at(idx, x)` is q(x) [n], `rows(idx)` [n, V]."""

    def __init__(self, probs: torch.Tensor, ids: torch.Tensor | None, vocab: int):
        self.probs, self.ids, self.vocab = probs, ids, vocab
        self.column = None
        if ids is not None:  # [V] column of each target id in probs, -1 outside the draft vocabulary
            self.column = torch.full((vocab,), -1, dtype=torch.int64, device=probs.device)
            self.column[ids] = torch.arange(ids.shape[0], device=probs.device)

    def at(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """q(x) [n] of draft rows idx [n] at tokens x [n]."""
        if self.column is None:
            return self.probs[idx, x]
        col = self.column[x]
        return torch.where(col >= 0, self.probs[idx, col.clamp_min(0)], 0.0)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """q [n, V] of draft rows idx [n]."""
        return spread(self.probs.index_select(0, idx), self.ids, self.vocab)


def positions_stop_first(tok, draft_idx, rule, param, param2, uniforms, target_probs, draft_probs,
                         sample_u, noise_rows, layout: RaggedLayout, max_k: int, rules: list[int] | None = None):
    """(accept [R] bool, token [R] int64, tvd [R] f32) as `positions_reference`, except that
    `token` is set only at each request's stop row (0 elsewhere): all that `_assemble` reads.
    `draft_probs`: a `DraftProbs`, or None when no row has drafts under a rule that reads q.
    `rules`: the rule values the batch's rows use, as the host knows them (None: read from `rule`,
    one host read); only those are swept, and where there is one, over every row without
    selecting them. Reads no other tensor value into Python (on a GPU, the index selections would
    sync as the reference's do)."""
    R = target_probs.shape[0]
    present = [spec_of(r) for r in sorted(set(rule.unique().tolist() if rules is None else rules))]
    every = torch.arange(R, device=target_probs.device) if len(present) == 1 else None  # [R] the one rule's rows
    dev = target_probs.device
    accept, token, tvd, is_draft, u_all = per_row_outputs(draft_idx, uniforms, target_probs)
    x_all = tok.clamp_min(0)                                             # [R] (0 at bonus rows)
    px_all = target_probs.gather(1, x_all[:, None]).squeeze(1)           # [R] p(x)

    def q_at(rows, draft):                                               # [n] q(x), 0 at bonus rows
        if draft_probs is None:
            return torch.zeros(rows.shape[0], device=dev)
        qx = draft_probs.at(draft_idx[rows].clamp_min(0), x_all[rows])
        return torch.where(draft, qx, 0.0)

    def q_rows(rows, draft):                                             # [n, V], 0 at bonus rows
        if draft_probs is None:
            return torch.zeros(rows.shape[0], target_probs.shape[1], device=dev)
        return torch.where(draft[:, None], draft_probs.rows(draft_idx[rows].clamp_min(0)), 0.0)

    for spec in present:                                                 # 1. accept and TVD, every row
        rows = every if every is not None else (rule == spec.id).nonzero().squeeze(-1)  # [n] target rows
        draft = is_draft[rows]
        p = target_probs if rows.numel() == R else target_probs.index_select(0, rows)  # [n, V]
        q = q_rows(rows, draft) if spec.reads_q_rows else None
        qx = q_at(rows, draft) if spec.needs_q else None
        a, d, y = decide_accept(spec.id, p, q, x_all[rows, None], px_all[rows], qx, u_all[rows],
                                param[rows], param2[rows])
        accept[rows] = a & draft
        if d is not None:
            tvd[rows] = torch.where(draft, d, 0.0).to(torch.float32)
        if y is not None:                                                # GREEDY: argmax p, every row
            token[rows] = y

    B = layout.cu.shape[0] - 1                                           # 2. stop rows, one per request
    if B == 0:
        return accept, token, tvd
    cu = layout.cu.to(torch.int64)
    first = cu[:-1] + torch.arange(B, device=dev)                        # [B] first target row
    k = cu[1:] - cu[:-1]                                                 # [B]
    j = torch.arange(max_k, device=dev)
    trow = (first[:, None] + j).clamp_max(R - 1)                         # [B, K]
    acc = accept[trow] & (j[None] < k[:, None])                          # [B, K]
    stop = first + (acc.to(torch.int32).cumprod(1).sum(1) if max_k else 0)  # [B] stop row
    stop_rule = rule[stop] if every is None else None
    for spec in present:                                                 # 3. the token at the stop rows
        if spec.residual == RESIDUAL_ARGMAX:                             # token set in 1.
            continue
        rows = stop if every is not None else stop[stop_rule == spec.id]  # [m]
        if rows.numel() == 0:
            continue
        draft = is_draft[rows]
        p = target_probs.index_select(0, rows)                           # [m, V]
        us = sample_u[rows if noise_rows is None else noise_rows[rows]]  # [m]
        q = q_rows(rows, draft) if spec.residual == RESIDUAL_P_MINUS_Q else None
        token[rows] = emit_token(spec.id, p, q, us, x_all[rows, None], draft, px_all[rows])
    return accept, token, tvd
