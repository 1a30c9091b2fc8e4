"""`verify`: one entry point that verifies a ragged batch of drafts under per-row rules.

Vocabulary (following vLLM's rejection sampler):
- *draft tokens*: the k_r tokens row r proposes, flat over the batch; row r owns
  `draft_tokens[cu[r]:cu[r+1]]`.
- *target rows*: `target_probs` has k_r + 1 rows per request, at `cu[r] + r .. cu[r+1] + r`;
  row `cu[r] + r + j` is the target distribution p at draft position j, the last one the
  *bonus* position after all drafts.
- *accepted tokens*: the drafts before the first rejection (a_r of them).
- *recovered token*: what the rule emits at the first rejected position instead of the draft.
- *bonus token*: a sample of p at the bonus position, emitted when all k_r drafts are accepted.
Each row emits a_r + 1 tokens: the accepted drafts, then the recovered or bonus token.

*TVD spent* (`tvd_spent`): for each position the row *decided* (its accepted positions plus the
rejecting one), the total variation distance between the law of the token emitted there and p,
given the emitted prefix; the law is over the draft token x ~ q and the rule's coins. Summed
over those positions. The bonus position samples p and adds 0; exact rules add 0. By the union
bound, the sum bounds the TV distance of the row's emitted sequence from the target's.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kernels.layout import RaggedLayout
from kernels.rules import NEEDS_DRAFT_PROBS, RULES, bad_param_flags, bad_param_messages, rule_ids, rule_name


@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    tokens: torch.Tensor        # [B, max_k + 1] int64, emitted tokens, padded with -1
    num_accepted: torch.Tensor  # [B] int32, accepted drafts a_r (emitted = a_r + 1)
    tvd_spent: torch.Tensor     # [B] f32, TVD this step added to the row (0 for exact rules)


def use_triton(device: torch.device) -> bool:
    """Triton on CUDA, or anywhere when ADAPT_FORCE_TRITON=1 (tests, with TRITON_INTERPRET=1)."""
    return device.type == "cuda" or os.environ.get("ADAPT_FORCE_TRITON", "") == "1"


def verify(
    draft_tokens: torch.Tensor,    # [N] int64
    cu_num_draft: torch.Tensor,    # [B + 1] int32, cu[0] = 0
    target_probs: torch.Tensor,    # [N + B, V] f32
    draft_probs,                   # [N, V] f32 or None
    rule: torch.Tensor,            # [B] int32
    param: torch.Tensor,           # [B] f32
    param2: torch.Tensor,          # [B] f32
    uniforms: torch.Tensor,        # [N] f32, U(0, 1): the drafts' coins
    sample_u: torch.Tensor,        # [N + B] f32, U(0, 1): each target row's draw; [M] with noise_rows
    max_k: int,
    *,
    noise_rows: torch.Tensor | None = None,  # [N + B] int64 noise row of each target row
    layout: RaggedLayout | None = None,
    check: bool = True,
    backend: str = "auto",
    draft_ids: torch.Tensor | None = None,  # [Vd] int64 target ids of draft_probs' columns
    rules: list[int] | None = None,  # the values of `rule`, as the host knows them (stop-first only)
) -> VerifyOutput:
    """Verify the drafts of a ragged batch; see the module docstring and docs/contracts.md §2.

    `sample_u`: the uniform at which a target row's emitted token is drawn (inverse CDF,
    `kernels.reference.inverse_cdf`); `noise_rows` lets target rows share them (`kernels.noise`:
    one per request); None: target row i reads `sample_u[i]`. `layout`: the batch's `RaggedLayout` when the caller
    built it (it must match `cu_num_draft`); else built here. `rules`: the rule values the rows
    use where the caller has them on the host (the stop-first backend then sweeps only those
    without reading `rule`). `draft_ids`: `draft_probs` is then
    [N, Vd] over the drafter's vocabulary, these target ids (q = 0 elsewhere). `check=True`
    validates values (ids, parameters, offsets, noise rows) at the cost of one host sync; shapes
    and dtypes are always checked. `backend` is "auto" (Triton on CUDA or when
    ADAPT_FORCE_TRITON=1, stop-first elsewhere and where `rules` names a rule the Triton kernel
    has no code for), "triton", "torch" (the per-position reference,
    Triton's twin) or "stop_first" (`kernels.stop_first`: tokens sampled at stop rows only; the
    same outputs as "torch").
    """
    if backend == "auto":
        backend = "triton" if use_triton(target_probs.device) else "stop_first"
        if backend == "triton" and rules is not None and not triton_has(rules):
            backend = "stop_first"  # a rule without Triton code (kernels.triton_verify.TRITON_RULES)
    if backend not in ("triton", "torch", "stop_first"):
        raise ValueError(f"backend: expected 'auto', 'triton', 'torch' or 'stop_first', got {backend!r}")
    if draft_ids is not None and draft_probs is not None:
        _check_draft_ids(draft_probs, draft_ids, target_probs.shape[1], check)
        if backend != "stop_first":  # the per-position backends read q over the whole vocabulary
            from kernels.stop_first import spread

            draft_probs, draft_ids = spread(draft_probs, draft_ids, target_probs.shape[1]), None
    _check_shapes(draft_tokens, cu_num_draft, target_probs, draft_probs, rule, param, param2,
                  uniforms, sample_u, max_k, noise_rows, draft_ids)
    if check:
        _check_values(draft_tokens, cu_num_draft, target_probs, draft_probs, rule, param, param2,
                      max_k)
    if layout is None:
        layout = RaggedLayout.from_cu(cu_num_draft, draft_tokens.shape[0])
    if check and noise_rows is not None:
        _check_noise_rows(sample_u, noise_rows)
    tok, draft_idx, rule_r, param_r, param2_r = _per_target_row(draft_tokens, layout, rule, param, param2)
    if backend == "stop_first":
        from kernels.stop_first import DraftProbs, positions_stop_first

        q = None if draft_probs is None else DraftProbs(draft_probs, draft_ids, target_probs.shape[1])
        accept, token, tvd = positions_stop_first(tok, draft_idx, rule_r, param_r, param2_r, uniforms,
                                                  target_probs, q, sample_u, noise_rows, layout, max_k, rules)
        return _assemble(accept, token, tvd, draft_tokens, cu_num_draft, max_k)
    if backend == "triton":
        if check and not triton_has(rule.unique().tolist()):
            raise ValueError("rule: a rule without Triton code (kernels.triton_verify.TRITON_RULES); "
                             "use backend 'stop_first' or 'torch'")
        from kernels.triton_verify import positions_triton as positions
    else:
        from kernels.reference import positions_reference as positions
    accept, token, tvd = positions(tok, draft_idx, rule_r, param_r, param2_r, uniforms,
                                   target_probs, draft_probs, sample_u, noise_rows)
    return _assemble(accept, token, tvd, draft_tokens, cu_num_draft, max_k)


def verify_greedy(target_argmax: torch.Tensor, drafts: torch.Tensor, k: torch.Tensor) -> VerifyOutput:
    """`verify` for a batch whose rows all verify with GREEDY, on the padded layout: row r accepts
    its drafts while each equals the target's argmax at its position, and emits the argmax at the
    first mismatch (or the bonus position). target_argmax [B, Tq] int64 (argmax p per position;
    any value where the row verifies nothing); drafts [B, >= Tq - 1] int64; k [B] drafts each
    row verifies (<= Tq - 1). The GREEDY row of the rule table decides the same per position
    (tests/test_rule_table.py); this form needs no ragged layout, rule groups or noise."""
    B, Tq = target_argmax.shape
    kmax = Tq - 1
    j = torch.arange(Tq, device=target_argmax.device)
    match = (drafts[:, :kmax] == target_argmax[:, :kmax]) & (j[None, :kmax] < k[:, None])  # [B, kmax]
    a = match.to(torch.int32).cumprod(1).sum(1)                                          # [B] leading matches
    tokens = torch.where(j[None, :kmax] < a[:, None], drafts[:, :kmax], -1)
    tokens = torch.cat((tokens, tokens.new_full((B, 1), -1)), 1)                          # [B, Tq], -1 padded
    tokens.scatter_(1, a[:, None].long(), target_argmax.gather(1, a[:, None].long()))
    return VerifyOutput(tokens=tokens, num_accepted=a.to(torch.int32),
                        tvd_spent=torch.zeros(B, device=target_argmax.device))


def triton_has(rules) -> bool:
    """True when the Triton kernel has code for every rule id in `rules` (`TRITON_RULES`: the
    kernel branches per rule, so a rule added to the table alone verifies with the torch backends)."""
    from kernels.triton_verify import TRITON_RULES

    return all(int(r) in TRITON_RULES for r in rules)


def _per_target_row(draft_tokens, layout: RaggedLayout, rule, param, param2):
    """Per-target-row views: drafted token (-1 at bonus rows), draft index (-1 at bonus rows),
    rule and params."""
    draft_idx, row = layout.draft_idx, layout.row
    tok = torch.where(draft_idx >= 0, draft_tokens[draft_idx.clamp_min(0)] if layout.num_drafts else -1, -1)
    return (tok, draft_idx, rule.to(torch.int32)[row], param.to(torch.float32)[row],
            param2.to(torch.float32)[row])


def _assemble(accept, token, tvd, draft_tokens, cu, max_k) -> VerifyOutput:
    """Per-row outputs from per-target-row decisions (shared by both backends)."""
    batch = cu.shape[0] - 1
    device = token.device
    if batch == 0:
        return VerifyOutput(tokens=torch.empty((0, max_k + 1), dtype=torch.int64, device=device),
                            num_accepted=torch.empty(0, dtype=torch.int32, device=device),
                            tvd_spent=torch.empty(0, dtype=torch.float32, device=device))
    cu = cu.to(torch.int64)
    k = cu[1:] - cu[:-1]                                                 # [B]
    j = torch.arange(max_k + 1, device=device)                          # [K + 1]
    valid = j[None, :max_k] < k[:, None]                                 # [B, K]
    trow = (cu + torch.arange(batch + 1, device=device))[:-1, None] + j  # [B, K + 1] target rows
    trow = trow.clamp_max(token.shape[0] - 1)
    acc = accept[trow[:, :max_k]] & valid                                # [B, K]
    num_acc = acc.to(torch.int32).cumprod(dim=1).sum(dim=1) if max_k else torch.zeros(batch, dtype=torch.int64, device=device)
    last = token.gather(0, (cu[:-1] + torch.arange(batch, device=device) + num_acc).clamp_max(token.shape[0] - 1))
    drafts = draft_tokens[(cu[:-1, None] + j[None, :max_k]).clamp_max(max(draft_tokens.shape[0] - 1, 0))] \
        if draft_tokens.shape[0] else torch.zeros(batch, max_k, dtype=torch.int64, device=device)
    out = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=device)
    out[:, :max_k] = torch.where(j[None, :max_k] < num_acc[:, None], drafts, -1)
    out.scatter_(1, num_acc[:, None].to(torch.int64), last[:, None])
    decided = valid & (j[None, :max_k] <= num_acc[:, None])             # accepted + the rejecting one
    spent = torch.where(decided, tvd[trow[:, :max_k]], 0.0).sum(dim=1) if max_k else torch.zeros(batch, device=device)
    return VerifyOutput(tokens=out, num_accepted=num_acc.to(torch.int32), tvd_spent=spent.to(torch.float32))


def _check_draft_ids(draft_probs, draft_ids, vocab, values: bool):
    """Shape always; ids in range when `values` (one host sync)."""
    if not (draft_ids.dim() == 1 and draft_ids.dtype == torch.int64 and draft_ids.shape[0] == draft_probs.shape[-1]
            and draft_ids.device == draft_probs.device):
        raise ValueError(f"draft_ids: expected int64 [{draft_probs.shape[-1]}] (one per column of draft_probs) on "
                         f"{draft_probs.device}, got {tuple(draft_ids.shape)} {draft_ids.dtype} on {draft_ids.device}")
    if values and draft_ids.numel() and bool(((draft_ids < 0) | (draft_ids >= vocab)).any()):
        raise ValueError(f"draft_ids: token ids must lie in [0, {vocab})")


def _check_shapes(draft_tokens, cu, target_probs, draft_probs, rule, param, param2, uniforms,
                  sample_u, max_k, noise_rows=None, draft_ids=None):
    def need(cond, field, msg):
        if not cond:
            raise ValueError(f"{field}: {msg}")

    need(draft_tokens.dim() == 1 and draft_tokens.dtype == torch.int64, "draft_tokens",
         f"expected a 1-D int64 tensor, got {tuple(draft_tokens.shape)} {draft_tokens.dtype}")
    need(cu.dim() == 1 and cu.shape[0] >= 1 and not cu.dtype.is_floating_point, "cu_num_draft",
         f"expected a 1-D integer tensor [batch + 1], got {tuple(cu.shape)} {cu.dtype}")
    n, b = draft_tokens.shape[0], cu.shape[0] - 1
    need(isinstance(max_k, int) and max_k >= 0, "max_k", f"expected an int >= 0, got {max_k!r}")
    need(target_probs.dim() == 2 and target_probs.shape[0] == n + b, "target_probs",
         f"expected [num_tokens + batch, vocab] = [{n + b}, V], got {tuple(target_probs.shape)}")
    need(target_probs.dtype == torch.float32, "target_probs", f"expected float32, got {target_probs.dtype}")
    vocab = target_probs.shape[1]
    need(vocab > 0, "target_probs", "vocab size must be > 0")
    need(target_probs.is_contiguous(), "target_probs", "must be contiguous")
    if noise_rows is None:
        need(tuple(sample_u.shape) == (n + b,) and sample_u.dtype == torch.float32 and sample_u.is_contiguous(),
             "sample_u", f"expected contiguous float32 [{n + b}] (one per target row), got "
             f"{tuple(sample_u.shape)} {sample_u.dtype}")
    else:
        need(tuple(noise_rows.shape) == (n + b,) and noise_rows.dtype == torch.int64, "noise_rows",
             f"expected int64 [{n + b}] (one per target row), got {tuple(noise_rows.shape)} {noise_rows.dtype}")
        need(sample_u.dim() == 1 and sample_u.dtype == torch.float32 and sample_u.is_contiguous(), "sample_u",
             f"expected contiguous float32 [rows], got {tuple(sample_u.shape)} {sample_u.dtype}")
    if draft_probs is not None:
        width = vocab if draft_ids is None else draft_ids.shape[0]
        need(tuple(draft_probs.shape) == (n, width) and draft_probs.dtype == torch.float32
             and draft_probs.is_contiguous(), "draft_probs",
             f"expected contiguous float32 [{n}, {width}], got {tuple(draft_probs.shape)} {draft_probs.dtype}")
    need(tuple(uniforms.shape) == (n,) and uniforms.dtype == torch.float32, "uniforms",
         f"expected float32 [{n}], got {tuple(uniforms.shape)} {uniforms.dtype}")
    for name, tensor in (("rule", rule), ("param", param), ("param2", param2)):
        need(tuple(tensor.shape) == (b,), name, f"expected [{b}] (one per row), got {tuple(tensor.shape)}")
    need(not rule.dtype.is_floating_point, "rule", f"expected an integer tensor, got {rule.dtype}")
    device = target_probs.device
    for name, tensor in (("draft_tokens", draft_tokens), ("cu_num_draft", cu), ("rule", rule),
                         ("param", param), ("param2", param2), ("uniforms", uniforms),
                         ("sample_u", sample_u), ("draft_probs", draft_probs), ("noise_rows", noise_rows)):
        need(tensor is None or tensor.device == device, name,
             f"on {tensor.device if tensor is not None else None}, expected {device} (target_probs' device)")


def _check_values(draft_tokens, cu, target_probs, draft_probs, rule, param, param2, max_k):
    """All value checks in one host sync."""
    vocab = target_probs.shape[1]
    k = cu[1:].to(torch.int64) - cu[:-1].to(torch.int64)
    r = rule.to(torch.int64)
    false = torch.zeros((), dtype=torch.bool, device=cu.device)
    needs_q = torch.isin(r, torch.tensor([int(x) for x in NEEDS_DRAFT_PROBS], dtype=torch.int64, device=r.device))
    flags = torch.stack([
        cu[0] != 0,
        (k < 0).any() if k.numel() else false,
        (k > max_k).any() if k.numel() else false,
        cu[-1] != draft_tokens.shape[0],
        ((draft_tokens < 0) | (draft_tokens >= vocab)).any(),
        ~torch.isin(r, rule_ids(r.device).to(torch.int64)).all() if r.numel() else false,
        (needs_q & (k > 0)).any() if draft_probs is None else false,
        *bad_param_flags(r, param, param2),
    ]).tolist()
    messages = [
        ("cu_num_draft", "cu_num_draft[0] must be 0"),
        ("cu_num_draft", "must be non-decreasing"),
        ("max_k", f"a row has more than max_k = {max_k} drafts"),
        ("cu_num_draft", f"cu_num_draft[-1] must equal num_tokens = {draft_tokens.shape[0]}"),
        ("draft_tokens", f"token ids must lie in [0, {vocab})"),
        ("rule", f"rule ids must be one of {sorted(int(x) for x in RULES)}"),
        ("draft_probs", "required by rows with drafts under "
                        + ", ".join(rule_name(x) for x in NEEDS_DRAFT_PROBS)),
        *bad_param_messages(),
    ]
    for bad, (field, msg) in zip(flags, messages):
        if bad:
            raise ValueError(f"{field}: {msg}")


def _check_noise_rows(sample_u, noise_rows):
    """Noise-row ids in range (one host sync)."""
    if bool(((noise_rows < 0) | (noise_rows >= sample_u.shape[0])).any()):
        raise ValueError(f"noise_rows: noise row ids must lie in [0, {sample_u.shape[0]})")
