"""The draft source of each row: its diffusion plan, or its suffix draft (tokens copied from
text it has seen, workers/suffix.py: free to make) where that is predicted to pay.

With ``c₁`` the acceptance of a copy's first token and ``c`` of each later one, by its match
length (`suffix_table`), scaled per token by its vote share and recalibrated online
(`calibration.SuffixAcceptance`), slot ``j`` is accepted with probability
``a_j = Π_{i≤j} min(1, c_i · s(v_i))`` and verifying its first ``k`` tokens wins ``Σ_{j≤k} a_j``.
Where the target verifies the batch padded to its longest row (GPU), one cap ``k_c`` for the
batch; where it verifies each row's own positions (packed, CPU), the slots of all rows ranked by
their worth ``w_r · a_{r,j}``. Either way the choice maximises the batch's weighted tokens per ms
under the cost model (taking nothing keeps the plan).
"""

from __future__ import annotations

import torch

from .guards import behind_veto, keeps_targets
from .objective import base_weights, weights
from .plan import StepDecision
from .suffix_table import suffix_draft_accept


def take_suffix(p, rows, ctx, steps: torch.Tensor, extra: torch.Tensor, toks: torch.Tensor,
                shortcut: bool = True) -> tuple[torch.Tensor, StepDecision]:
    """Rows whose suffix draft beats their planned choice take it (see the module docstring).
    steps [B]: the plan; extra [B]: the expected extra tokens of each row's planned draft (0
    for rows without one); toks [B]: the plan's verified positions per row. Returns which rows
    take their suffix draft ([B] bool; the others keep their plan) and the choice (``suffix_k`` [B],
    ``suffix_expect`` [B], ``suffix_pred``). ``shortcut``: answer from the plan alone where no
    copy may win (`copy_may_win`; False only to test that it changes nothing).

    Candidates are draft lengths for every row at once (`suffix_candidates`): one cap for
    the batch where the engine pads rows to the longest (``B · (k_max + 1)`` positions), and
    on a packed engine (``rows.packed_verify``: each row costs its own positions) the
    prefixes of all rows' suffix slots ranked by marginal gain ``w_r · a_{r,j}``, so a long
    confident copy takes many slots while a weak match takes few or none. The candidate
    that maximises the batch's weighted tokens per ms
    ``(E_plan + Σ_{r switching} w_r · (win_r(k_r) − extra_r)) / step_ms(positions)`` wins (a
    diffusion row that switches no longer pays its drafter passes). Only rows whose copy wins
    more than their plan (``win_r > extra_r``) switch. Where the plan drafts nothing, its step is
    priced without the decision's host time, which holding that plain answer saves and a copy
    does not (``hold_price``, `cadence.Cadence.saving`).

    With ``suffix_first`` every row that has a suffix draft takes the whole of it, whatever its
    plan (static suffix drafting's choice, kept where the suffix drafter has nothing)."""
    B = len(rows.request_ids)
    n = rows.suffix_len.cpu()                                                      # [B]
    Ks = int(n.max())
    vote = getattr(rows, "suffix_vote", None) if p.suffix_vote else None
    by_table = suffix_draft_accept(p.suffix_accept, rows.suffix_match.cpu(),    # [B, Ks] accepted, 0 past the draft
                                   None if vote is None else vote.cpu()[:, :Ks], n, rows.temperature.cpu() > 0)
    if p.suffix_first:  # copy first: as static suffix drafting, over the plan where a draft exists
        take = n > 0
        choice = StepDecision(suffix_k=torch.where(take, n, 0).to(torch.int64),
                              suffix_expect=torch.where(take, by_table.sum(1), 0.0))  # [B] before recalibration
        return take, choice
    w = weights(p, ctx).cpu()                                                    # [B]
    slot = (by_table * p.suffix_accept_ratio).clamp(max=1.0)                       # recalibrated online
    win = torch.cat([torch.zeros(B, 1), slot.cumsum(1)], 1)                        # [B, Ks + 1] expected accepted
    packed = bool(getattr(rows, "packed_verify", False))
    if shortcut and not copy_may_win(w, win, extra):  # every candidate is the plan: the same answer, fewer operations
        return keep_plan(p, steps, toks, packed)
    k = suffix_candidates(n, w[:, None] * slot, packed)                            # [B, C] draft length per candidate
    expect = win.gather(1, k)                                                      # [B, C] expected accepted
    over = expect - extra.clamp(min=0)[:, None]                                    # [B, C] (inf plan: -inf)
    # rows switch to their copy only where it wins more than their plan
    take = w[:, None] * over > 0                                                   # [B, C] takes its suffix draft
    plan_extra = extra.clamp(min=0).nan_to_num(posinf=0.0)                          # [B] the plan's extra tokens
    diffusing = steps > 0
    stay = diffusing[:, None] & ~take                                              # [B, C] keeps its diffusion draft
    gain = torch.where(take, w[:, None] * over, 0.0)                               # [B, C] (< 0: fewer tokens)
    kept_extra = plan_extra[:, None]                                               # [B, C] the plan's extra tokens kept
    verified, raw = candidate_ms(p, steps, diffusing, toks, k, take, stay, packed)  # [C] positions, [C] ms
    wide = verified > verified[0]
    ratio = p.costs.suffix_cost_ratio
    ms = raw * torch.where(wide, ratio["wide"], ratio["plan"])
    fixed = torch.zeros_like(ms)                                                   # [C] drafting path's fixed ms
    if not bool(diffusing.any()):  # the plan drafts nothing: taking a suffix draft takes the drafting path
        fixed = torch.where(take.any(0), p.draft_overhead_at(B, "suffix"), 0.0)
    ms = ms + fixed
    priced = ms                                                                    # [C] ms the choice compares
    if p.hold_price and not bool(diffusing.any()):  # a copy ends a hold: the plain plan, held, pays no decision
        priced = ms.clone()
        priced[0] = ms[0] - min(p.cadence.saving(p, B, p.costs.plain_ms), 0.5 * float(ms[0]))
    planned = float((base_weights(p, ctx).cpu() + w * plan_extra).sum())
    value = (planned + gain.sum(0)) / priced.clamp_min(1e-6)                      # [C] weighted tokens per ms
    if p.sla_guard:
        got = torch.where(take, expect, kept_extra)                                # [B, C]
        keeps = keeps_targets(ctx, ms, 1.0 + got, rows.remaining, p.sla_slack, behind_veto(p, B))
        value = torch.where(keeps, value, 0.0)
    best = int(torch.argmax(value))
    # taking drafts must be predicted `suffix_margin` better than the plan (default 0: with
    # calibrated costs, any margin only declines drafts that pay; measured 1.05x on
    # mixed at 1 request without it, against 0.99x with 5 %)
    if best == 0 or value[best] <= value[0] * (1.0 + p.suffix_margin):
        return torch.zeros(B, dtype=torch.bool), StepDecision(suffix_k=torch.zeros(B, dtype=torch.int64),
                                                              suffix_pred=(float(raw[0]), False, float(fixed[0]), float(ms[0])))
    suffix_k = torch.where(take[:, best], k[:, best], 0).to(torch.int64)
    table_win = torch.cat([torch.zeros(B, 1), by_table.cumsum(1)], 1).gather(1, suffix_k[:, None])[:, 0]
    choice = StepDecision(suffix_k=suffix_k, suffix_expect=torch.where(take[:, best], table_win, 0.0),  # before recalibration
                          suffix_pred=(float(raw[best]), bool(wide[best]), float(fixed[best]), float(ms[best])))
    return take[:, best], choice


def copy_may_win(w: torch.Tensor, win: torch.Tensor, extra: torch.Tensor) -> bool:
    """Whether some candidate of `take_suffix` may take a suffix draft: a row whose whole
    copy (``win`` [B, Ks + 1], its last column) is expected to win more than its plan's extra
    tokens (``extra`` [B]) and whose tokens count (``w`` [B] > 0)."""
    return bool(((w > 0) & (win[:, -1] > extra.clamp(min=0))).any())


def candidate_ms(p, steps, diffusing, toks, k, take, stay, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """([C] verified positions, [C] table ms) of `take_suffix`'s candidate steps: steps [B] the
    plan, diffusing [B] its rows with s > 0; toks [B] its verified positions per row; k [B, C] suffix draft lengths; take [B, C]
    rows that take their suffix draft; stay [B, C] rows that keep their diffusion draft."""
    B = steps.shape[0]
    if packed:  # each row costs its own positions
        own = torch.where(take, 1 + k, torch.where(stay, toks[:, None].long(), 1))  # [B, C]
        verified = own.sum(0)                                                      # [C] positions
    else:  # rows padded to the longest
        k_stay = ((toks[:, None] * stay).amax(0) - 1).clamp_min(0).long()          # [C]
        verified = B * (torch.maximum((k * take).amax(0), k_stay) + 1)             # [C] positions
    top = int(steps.max()) if bool(diffusing.any()) else 0
    passes = torch.arange(1, top + 1)                                              # [top]
    rpp = ((steps[:, None] * stay)[:, :, None] >= passes).sum(0)                   # [C, top] rows per pass
    return verified, p.cost.step_ms(verified.double(), rpp if top else None).float()


def keep_plan(p, steps: torch.Tensor, toks: torch.Tensor, packed: bool) -> tuple[torch.Tensor, StepDecision]:
    """`take_suffix`'s answer where no row takes its suffix draft (every row keeps its plan
    ``steps`` [B]), with the plan's predicted step (its candidate column 0) kept for the cost correction."""
    B = steps.shape[0]
    none = torch.zeros(B, 1, dtype=torch.int64)                                    # [B, 1] no suffix draft
    diffusing = steps > 0                                                          # [B]
    _, raw = candidate_ms(p, steps, diffusing, toks, none, none.bool(), diffusing[:, None], packed)  # [1]
    ms = raw * p.costs.suffix_cost_ratio["plan"]
    return torch.zeros(B, dtype=torch.bool), StepDecision(suffix_k=torch.zeros(B, dtype=torch.int64),
                                                          suffix_pred=(float(raw[0]), False, 0.0, float(ms[0])))


def suffix_candidates(n: torch.Tensor, marginal: torch.Tensor, packed: bool) -> torch.Tensor:
    """[B, C] suffix draft lengths per row for each candidate choice (column 0: none).

    n [B]: each row's suffix draft length; marginal [B, Ks]: what each slot of it is worth
    (``w_r · a_{r,j}``, non-increasing along a row, 0 past the draft). Padded (every row costs the
    longest row's positions): one cap ``k_c`` = 0..Ks for the batch, each row filling
    ``min(n_r, k_c)``. Packed (each row costs its own positions): the slots of all rows ranked
    by worth, candidate ``m`` taking the ``m`` best (within a row always a prefix)."""
    B, Ks = marginal.shape
    if not packed:
        return torch.minimum(n[:, None], torch.arange(Ks + 1)[None]).long()           # [B, Ks + 1]
    live = marginal > 0                                                               # [B, Ks]
    order = torch.argsort(torch.where(live, marginal, -1.0).flatten(), descending=True, stable=True)
    order = order[: int(live.sum())]                                                  # [M] best slots first
    pick = torch.zeros(B, order.numel() + 1, dtype=torch.int64)                       # [B, M + 1]
    pick[order // Ks, torch.arange(1, order.numel() + 1)] = 1
    return pick.cumsum(1)                                                             # [B, M + 1]
