"""The plan before drafting: each row's diffusion steps ``s`` (0: no draft this step), and the
span the drafter denoises.

For each row and each candidate ``s`` of ``steps_grid`` the prior head predicts the survival
curve; a *planned prefix* (slots worth more than λ, the current marginal value of a verified
slot) gives the expected tokens ``E[r, s]`` and the positions verified. Rows are then raised
level by level (s = 0 → s₁ → s₂ …): at each level the rows that gain most are admitted while the
batch's weighted rate ``Θ_w = Σ_r w_r E[r, s_r] / step_ms`` rises (the DSpark greedy,
generalised from slots to steps). Only rows that plan more tokens at the next level are
candidates, and a step that drafts is never priced under its verify alone, whatever credit the
drafting path has earned (`calibration.StepCosts.draft_overhead_at`): else a row with nothing to
verify could be "admitted" for a step the credit made cheaper than not drafting. The answer is
a frozen `Plan`, kept for ``replan_every`` steps while the batch holds the same requests.

``s = 0`` (no draft: the row decodes autoregressively this step) is a candidate when
``allow_no_draft``: with a weak drafter or a cheap target step, drafting may cost more than the
tokens it wins (a row goes without drafts only where that is predicted to be
``no_draft_margin`` better). A row that has not verified any draft yet reads as the *typical*
recent acceptance of its temperature class (`AcceptancePredictor.typical_recent`, fitted on
traces that drafted every row); a row that has not verified diffusion drafts for ``n`` steps has
its recent acceptance pulled toward that typical value by ``1 − idle_decay^n``, so it is offered
drafting again whenever typical rows of its class are worth drafting. The prior's survival
curves are scaled, per temperature class and step count, by what the plan's diffusion drafts
have won against what it predicted (`calibration.DiffusionAcceptance`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from policies.base import rows_per_pass

from .guards import plan_keeps, reachable
from .objective import base_weights, planned_extra, weights


@dataclass(frozen=True)
class Plan:
    """A plan for the batch of requests ``key`` (their ids, in row order), made ``age`` steps ago
    (1: this step). steps [B] diffusion steps per row; extra [B] expected extra tokens of each
    row's planned draft (0 without one); toks [B] planned verified positions (bonus included);
    raw_extra [B] the extra tokens as the prior predicts them before `diffusion_accept_ratio`
    and level [B] each row's index in ``steps_grid`` (these two: what the recalibration learns
    from; None where the plan did not price the rows); reach [B] bool whether each row's target
    is within reach (`sla_reach`; None: not asked)."""

    key: tuple
    age: int
    steps: torch.Tensor
    extra: torch.Tensor
    toks: torch.Tensor
    raw_extra: torch.Tensor | None = None
    level: torch.Tensor | None = None
    reach: torch.Tensor | None = None

    def aged(self) -> "Plan":
        return replace(self, age=self.age + 1)


@dataclass(frozen=True)
class StepDecision:
    """What one step decided, passed from phase to phase (`before_draft` → `after_draft` →
    `observe`): suffix_k [B] suffix draft lengths (0: the row takes none;
    None: no suffix choice made); suffix_expect [B] their table-predicted accepted tokens
    (before recalibration); suffix_pred (table ms, widened?, fixed drafting ms, predicted ms) of
    the suffix choice, for its cost correction; diffusion_expect ([B] prior-predicted extra
    tokens of the diffusion rows that stay, [B] grid index); span the positions the drafter
    denoises and flat whether every drafted slot is verified (`span`; None: not asked)."""

    suffix_k: torch.Tensor | None = None
    suffix_expect: torch.Tensor | None = None
    suffix_pred: tuple | None = None
    diffusion_expect: tuple | None = None
    span: int | None = None
    flat: bool | None = None


def plan_steps(p, rows, ctx, B: int, K: int) -> Plan:
    """A new `Plan` for ``rows`` (``p``: the policy, its settings, cost model and corrections)."""
    dev = rows.temperature.device
    price_span(p, K)
    pred = p._predictor_on(dev)
    temp = rows.temperature.to(dev)
    recent = recent_accept(p, rows, ctx["idle"], pred).to(dev)                        # [B]
    grid = torch.tensor(p.steps_grid, device=dev)                              # [S]
    S = grid.numel()
    cond = (grid[None, :] <= 1) | ctx["left_to_right"][:, None]                   # [B, S]
    match = (temp[:, None] > 0) & ~cond
    eps = torch.where(temp > 0, torch.minimum(ctx["eps"], ctx["budget_left"] / K), torch.zeros_like(temp))
    eps = torch.where(cond, eps[:, None], torch.zeros_like(eps)[:, None])          # [B, S]
    raw = pred.prior_survival(grid, K, temp, recent, match, eps)                    # [B, S, K]
    ratio = p.diffusion_accept_ratio.float().to(dev)[(temp > 0).long()]          # [B, S] recalibrated online
    surv = (raw * ratio[:, :, None]).clamp(max=1.0)                                 # [B, S, K]
    reach = None
    if p.sla_reach:  # lateness weighs only where the target is within reach (before the weights)
        reach = reachable(rows, ctx, surv.sum(-1).amax(1).cpu(), p.costs.plain_step_ms(B, p.cost))
        for key in ("urgency", "w", "w_base"):
            ctx.pop(key, None)
        ctx["reach"] = reach
    w = weights(p, ctx)                                                         # [B] extra tokens' worth
    w_base = base_weights(p, ctx)                                               # [B] the step's own token's
    keep = w[:, None, None] * surv >= lam(p, float(w_base.sum()), B).to(dev)  # planned prefix
    gain = w_base[:, None] + w[:, None] * (surv * keep).sum(-1)                   # [B, S]
    toks = 1.0 + keep.sum(-1).float()                                             # [B, S]
    # level by level (s = 0 -> s_1 -> s_2 ...): admit the rows that gain most while Θ_w rises
    if p.allow_no_draft:
        cur_gain, cur_tok, prev_s, first = w_base.clone(), torch.ones(B, device=dev), 0, 0
        level = torch.full((B,), -1, dtype=torch.int64, device=dev)
        fixed_draft = 0.0
    else:
        cur_gain, cur_tok, prev_s, first = gain[:, 0].clone(), toks[:, 0].clone(), p.steps_grid[0], 1
        level = torch.zeros(B, dtype=torch.int64, device=dev)
        fixed_draft = prev_s * p.cost.draft_ms_at([B])
    pass_ms = p.cost.draft_ms(torch.arange(B + 1, dtype=torch.float64)[:, None])  # [B+1]: a pass of n rows
    fixed_extra = p.draft_overhead_at(B, "diffusion")
    for i in range(first, S):
        s = p.steps_grid[i]
        # a row is raised only where it plans more tokens (a row that plans no verified draft
        # would pay a drafter pass for nothing)
        eligible = (level == i - 1) & (gain[:, i] > cur_gain)
        d_gain = torch.where(eligible, gain[:, i] - cur_gain, torch.zeros_like(cur_gain))
        order = torch.argsort(torch.where(eligible, d_gain, torch.full_like(d_gain, -1e9)), descending=True)
        d_tok = (toks[:, i] - cur_tok)[order].cpu()
        g = torch.cat([torch.zeros(1), d_gain[order].cpu().cumsum(0)])              # [B+1]
        t = torch.cat([torch.zeros(1), d_tok.cumsum(0)])
        verify_ms = p.cost.step_ms(float(cur_tok.sum()) + t)                           # [B+1] the verify alone
        ms = verify_ms + fixed_draft + (s - prev_s) * pass_ms
        # a step in which some row drafts takes the drafting path: its fixed extra cost
        if bool((level >= 0).any()):
            ms = ms + fixed_extra
        else:
            ms[1:] = ms[1:] + fixed_extra
        # a credit (a negative extra) lowers what drafting adds, never a step below its verify
        ms = torch.maximum(ms, verify_ms)
        theta = (float(cur_gain.sum()) + g) / ms.float().clamp_min(1e-6)
        count = int(eligible.sum())
        if p.sla_guard and p.sla_guard_plan:  # candidates that push a row off its target are worth 0
            theta = torch.where(plan_keeps(p, rows, ctx, ms.float(), order, cur_gain, gain[:, i], w_base, w),
                                theta, 0.0)
        if i == 0 and p.allow_no_draft:
            # drafting stays the default: rows stay without drafts only where that is predicted
            # to be at least `no_draft_margin` better (the prior is noisy for a single row); a
            # negative margin weighs against drafting instead (a machine where drafts lose)
            theta[0] = theta[0] / (1.0 + p.no_draft_margin)
        n_star = int(torch.argmax(theta[: count + 1]))
        if n_star == 0:
            break
        chosen = order[:n_star]
        cur_gain[chosen], cur_tok[chosen], level[chosen] = gain[chosen, i], toks[chosen, i], i
        fixed_draft = fixed_draft + (s - prev_s) * p.cost.draft_ms_at([n_star])
        prev_s = s
    steps = torch.where(level >= 0, grid[level.clamp_min(0)], torch.zeros_like(level))
    # (a closed batch may weigh a row's extra tokens at 0: then it has none planned)
    extra = torch.where(level >= 0, planned_extra(cur_gain, w_base, w), torch.zeros_like(w))
    raw_extra = (raw * keep).sum(-1).gather(1, level.clamp_min(0)[:, None])[:, 0]   # [B] before the ratio
    raw_extra = torch.where(level >= 0, raw_extra, torch.zeros_like(raw_extra))
    return Plan(tuple(rows.request_ids), 1, steps, extra.cpu(),
                torch.where(level >= 0, cur_tok, torch.ones_like(cur_tok)).cpu(), raw_extra.float().cpu(),
                level.clamp_min(0).cpu(), reach)


def lam(p, base: float, B: int) -> torch.Tensor:
    """λ as a plan reads it: the last drafting step's (`threshold`), but never below what a
    plain step of ``B`` rows earns for the ms one more verified token costs (``base`` its
    weighted tokens: ``base / step_ms(B) · dms``; the batch's best rate is at least the plain
    step's). Before the first drafting step, and long after the last, this floor is the
    threshold: at λ = 0 a plan would verify the whole block, whose cost on a CPU (a 17-token
    step at ~2x a plain one on SmolLM2) prices drafting out for good, since a plan that never
    drafts never learns a λ (measured: the policy drafted on 0 % or on ~75 % of steps of the
    same run by how the start-up profile priced a 17-token step)."""
    plain = max(float(p.cost.step_ms_at(float(B))), 1e-6)
    dms = max((float(p.cost.step_ms_at(B + 8.0)) - plain) / 8.0, 0.0)
    return torch.maximum(p.threshold, torch.tensor(base / plain * dms))


def recent_accept(p, rows, idle: torch.Tensor, pred) -> torch.Tensor:
    """[B] recent acceptance as the prior should read it: the class's typical value for rows
    without verified drafts; pulled toward it by ``1 − idle_decay^idle`` for rows that have not
    verified drafts for ``idle`` [B] steps."""
    recent = rows.recent_accept.float().cpu()
    by_class = getattr(pred, "typical_recent", None)                              # [2] greedy, sampled
    by_class = by_class.cpu() if by_class is not None else torch.full((2,), 0.5)
    typical = by_class[(rows.temperature.cpu() > 0).long()]                       # [B]
    pull = 1.0 - p.idle_decay ** idle.cpu()
    return torch.where(recent >= 0, recent + (typical - recent) * pull, typical)


def flat(p, B: int, K: int, rpp: list[int]) -> bool:
    """True when verifying every drafted slot costs under ``flat_share`` more than verifying none."""
    if p.flat_share <= 0:
        return False
    lo = p.cost.step_ms_at(float(B), rpp)
    hi = p.cost.step_ms_at(float(B * (K + 1)), rpp)
    return hi <= lo * (1.0 + p.flat_share)


def price_span(p, K: int) -> None:
    """Let the cost model price drafting passes at the span this policy drafts (`typical_span`;
    before any, the headroom over a 3-token plan), so the plan and the suffix choice weigh
    what a pass costs now (`CostModel.span_scale`)."""
    if hasattr(p.cost, "span"):
        guess = K if p.span_headroom is None else min(K, 3 + p.span_headroom)
        p.cost.span = round(p.typical_span) if p.typical_span is not None else guess


def span_of(p, rows, steps: list[int]) -> tuple[int, bool]:
    """(the intent's span, whether `after_draft` will verify every drafted slot at it): the longest
    draft the plan gives a diffusion row, plus ``span_headroom`` positions (after drafting,
    confident drafts may verify a little past the plan: on SmolLM2's mixed workload no row
    verified past plan + 2, docs/controller.md); the whole block where verifying every slot is
    nearly free (`flat`), with ``span_headroom`` None, or without a plan for these rows. Where
    every drafted slot is verified, `after_draft` reads no draft features and the engine need
    not compute them (`reads_draft_features`).

    On SmolLM2 the first k positions of a truncated block draft as well as the whole block's
    (greedy τ within ±1.5 % for k = 1…8), and a pass over 5 positions instead of 17 costs 2.6
    instead of 4.0 ms at one row, 8.8 instead of 17.6 ms at eight. One position of headroom
    rather than two: on the compiled target a forward over 5–6 positions costs ~1 ms (5 %) more
    than over 3–4 at one row; measured +1.3 % goodput at one request on the mixed workload
    (three interleaved runs: +2.4, +2.2, −1.0 %), a small gain at the edge of what these runs
    resolve."""
    K = int(getattr(rows, "block_size", 0) or p.block_size)
    diffusing = [s > 0 for s in steps]                                             # [B] host
    rpp = rows_per_pass(steps)
    plan = p._plan
    if (p.span_headroom is None or plan is None or plan.key != tuple(rows.request_ids)
            or not any(diffusing) or flat(p, len(diffusing), K, rpp)):
        span = K
    else:
        toks = plan.toks.tolist()  # verified positions per row, bonus included
        planned = int(max(t for t, d in zip(toks, diffusing) if d)) - 1
        span = max(1, min(K, planned + p.span_headroom))
    return span, any(diffusing) and flat(p, len(diffusing), span, rpp)
