"""`adaptive`: our controller. Per pass and per row it picks diffusion steps, draft length and
leniency to maximise the batch's *weighted* goodput, where a row's weight grows with how far it is
behind its latency target (and with its priority).

Before drafting (`_steps`): for each row and each candidate ``s`` in ``steps_grid`` the prior head
predicts the survival curve; a planned prefix (slots worth more than the current marginal cost of
a token) gives the expected tokens ``E[r, s]`` and tokens verified. Rows are then raised level by
level (s = 0 → s₁ → s₂ …): at each level the rows that gain most are admitted while the batch rate

    Θ_w = Σ_r w_r E[r, s_r] / step_ms(tokens, rows per drafter pass)

rises (the DSpark greedy, generalised from slots to steps). ``s = 0`` (no draft: the row decodes
autoregressively this step) is a candidate when ``allow_no_draft`` (default): with a weak drafter or
a cheap target step, drafting may cost more than the tokens it wins (a row goes without drafts
only where that is predicted to be ``no_draft_margin`` better). A row that has not verified any
draft yet reads as the *typical* recent acceptance of its temperature class (greedy or sampled,
fitted on traces that drafted every row: `AcceptancePredictor.typical_recent`; not updated from
what this policy observes, which only sees the rows it chose to draft); a row that has
not verified diffusion drafts for ``n`` steps has its recent acceptance (the prior's main feature, frozen
while it does not draft) pulled toward that typical value by ``1 − idle_decay^n``, so it is
offered drafting again whenever typical rows of its class are worth drafting. The prior's survival
curves are scaled, per temperature class and step count, by what the plan's diffusion drafts have
won against what it predicted for them (`diffusion_accept_ratio`, recalibrated online).

After drafting (`_verify`): each ε row gets the ε-TVD rule with its leniency (its ε, capped by
the total budget left, only where the draft probabilities are true conditionals and T > 0);
lossless rows get their exact rule. Survival under that rule, times the row weight, ranks every
slot of the batch and `greedy_prefix` admits slots while Θ_w rises. Sampled lossless rows whose
draft features may depend on their own earlier draws (REJECTION after s > 1 left-to-right
denoising) are decided by a per-row threshold instead: position ``j`` is verified iff
``w_r a_{r,j} ≥ λ``, with ``λ`` fixed before drafting, so that the decision at ``j`` reads only
positions ``≤ j`` (non-anticipating).

Suffix drafts (every step, over the plan): rows may take their suffix draft (workers/suffix.py:
tokens copied from text they have seen, free to make). With ``c₁`` the acceptance of its first
token and ``c`` of each later one, by its match length (`suffix_accept`: a table fitted on traces,
adapt/suffix_fit.py; ``m / (m + 3)`` for both without one), scaled per token by its vote share
``v_i`` (the share of the draft's candidates that voted for it: ``s(v_i)``, 1 when unanimous, a
contested token a fifth to two-fifths as likely; the table's ``vote_scale``), and recalibrated
online by what the drafts taken so far won (`suffix_accept_ratio`; and by what each request's own
drafts won, `suffix_row_ratio`), slot ``j`` of the draft is
accepted with probability ``a_j = Π_{i≤j} min(1, c_i · s(v_i))`` (``c_1 = c₁``, later ``c_i = c``;
without vote shares ``c₁ · c^(j−1)``) and verifying its first ``k`` tokens wins ``Σ_{j≤k} a_j``.
Where the target verifies the batch padded to its longest row (GPU), the policy picks one cap
``k_c`` for the batch: every row whose suffix draft beats its plan fills up to ``k_c`` slots
(slots within the plan's own padding are free). Where it verifies each row's own positions
(packed, CPU), every row gets its own length: the slots of all rows are ranked by their worth
``w_r · a_{r,j}`` and the batch takes the best ``m`` of them, so a long confident copy drafts many
tokens while a weak match in the same step drafts few or none. Either way the choice maximises the
batch's weighted tokens per ms under the cost model (taking nothing keeps the plan). On a GPU,
where slots are nearly free, long caps win; on a CPU each slot costs compute, and only slots
worth more than what they cost are taken.

Decision cadence (``hold_max``, ``hold_share``): deciding costs host time every step (the plan,
the suffix choice, and the engine's suffix proposals for every row), which on a small target is
a tenth of a ~3 ms step. Where a full decision costs at least ``hold_share`` of one row's share
of a plain step (``plain_ms / B``; EMAs of both, measured) and it keeps every row plain (no
diffusion, no suffix draft), the policy *holds* that answer for the next ``h`` steps while the
batch keeps the same requests: ``h`` = 1, 2, 4, … up to ``hold_max`` over consecutive plain
decisions, back to deciding every step as soon as one drafts. A row's share, not the whole
step: deciding delays every row of the step, while what it may catch (one row's copy) wins that
row's tokens. On SmolLM2 on a 2-core CPU deciding took ~1.5 ms of a ~55 ms 8-row step: 3 % of
the step, 22 % of a row's share; holding there took the policy from 0.91x to 0.95-0.96x
autoregressive decoding at batch 8 (interleaved runs of equal-length requests), while at batch 1
(1 ms of a ~38 ms step) it decides every step. (On a larger target deciding is ~2 % of a step
and holding would only react late to copies.) While holding it reads no suffix drafts (the
engine skips proposing them) and answers without computing anything. Requests leaving the batch
keep the hold; requests joining it keep it too where the batch has at least ``hold_joins_rows``
(8) rows (they take plain steps until it runs out: at 8 requests a join comes every few
steps and ended half the holds; at 2 and 4 requests holding through joins lost 1–3 %), else a
join ends it. A held step still tells the policy its outcome (latency
book-keeping, the online cost model).

Draft span (``span_headroom``): the drafter denoises only the block positions a row may verify
(`draft_span`, asked by the engine before drafting): the plan's longest diffusion draft plus
``span_headroom`` (1) positions, not the whole block of 16. On SmolLM2 the first
k positions of a truncated block draft as well as the whole block's (greedy τ within ±1.5 % for
k = 1…8), and a pass over 5 positions instead of 17 costs 2.6 instead of 4.0 ms at one
row, 8.8 instead of 17.6 ms at eight. One position of headroom rather than two: on the
compiled target a forward over 5–6 positions costs ~1 ms (5 %) more than over 3–4 at one row, for
the few tokens a diffusion draft wins that far; measured +1.3 % goodput at one request on the
mixed workload (three interleaved runs: +2.4, +2.2, −1.0 %; 14 of 20 rounds ahead), a small gain
at the edge of what these runs resolve.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from kernels.rules import Rule
from policies.adaptive_settings import AdaptiveSettings, check_settings
from policies.base import Policy, make_verify_decision, no_draft_decision, outcome_ms, rows_per_pass
from policies.common import STALE_STEPS, lenient_eps
from policies.greedy import greedy_prefix
from policies.static import rules_from


SUFFIX_DECAY = 0.98   # per drafting step: the recalibration forgets over ~50 such steps
SUFFIX_PRIOR = 8.0    # tokens at ratio 1 before any suffix draft is seen
SUFFIX_IDLE_DECAY = 0.995  # per step without suffix drafts: a low ratio fades (half-life ~140 steps)
DIFFUSION_DECAY = 0.98  # per step with diffusion drafts: the plan's recalibration forgets over ~50 of them
DIFFUSION_PRIOR = 8.0   # tokens at ratio 1 before any diffusion draft is seen
DIFFUSION_IDLE_DECAY = 0.995  # per step without diffusion drafts: the evidence fades back to ratio 1


class AdaptivePolicy(Policy):
    name = "adaptive"

    def __init__(self, settings: AdaptiveSettings | None = None, **kwargs):
        """``settings`` (an `AdaptiveSettings`) and/or its fields as keywords (which override
        it); the other keywords are `Policy`'s (predictor, cost, block_size, online_cost). A bad
        setting is a `ValueError` naming it."""
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in AdaptiveSettings.model_fields}
        super().__init__(**kwargs)
        base = settings.model_dump() if settings is not None else {}
        self.settings = check_settings({**base, **own})
        self._apply(self.settings)
        self.typical_span: float | None = None  # EMA of the spans answered (`_span`): what drafting costs now
        self._span_now: int | None = None  # this step's span (None: not asked, the whole block)
        self._flat_now: bool | None = None  # whether this step verifies every drafted slot, as `_span` found (None: not asked)
        # ``_reach``: (request ids, [B] bool) of the latest plan (`_reachable`)
        self._reach = None
        # EMAs of a full decision's host time (ms) and of a plain step's time (ms): holding pays
        # only where deciding is a noticeable share of a step
        self.decide_ms: float | None = None
        self.plain_ms: float | None = None
        self._hold_key, self._hold_left, self._plain_run = frozenset(), 0, 0  # see "Decision cadence" above
        self.held_steps = 0
        # online recalibration of suffix acceptance (see `suffix_accept_ratio`): decayed sums of the
        # tokens the taken suffix drafts won and of what the table predicted they would
        self.suffix_won, self.suffix_predicted, self.suffix_drafts = 0.0, 0.0, 0
        self._suffix_expect = None  # [B] this step's table-predicted accepted tokens per suffix row (0: none)
        self._suffix_k = None  # [B] this step's suffix draft lengths (0 = the row does not take its suffix draft)
        # online recalibration of the plan's diffusion acceptance (see `diffusion_accept_ratio`):
        # decayed sums, per temperature class (greedy, sampled) and step count of `steps_grid`
        # ([2, S]), of the tokens diffusion drafts won and of what the plan's prior predicted they would
        self.diffusion_won = self.diffusion_predicted = None  # 2 · S host floats, made at first use
        self.diffusion_drafts = 0
        self._diffusion_expect = None  # ([B] prior-predicted extra tokens per diffusion row (0: none), [B] grid index)
        # measured / predicted step time of steps that widened the batch for suffix drafts and of
        # steps that kept the plan (EMAs): the cost model's table misses what grows with context
        # length and rows (attention over long prompts, acceptance), so the choice corrects it
        self.suffix_cost_ratio = {"wide": 1.0, "plan": 1.0}
        # EMAs of measured − predicted step ms per kind of step ("plain": no drafts; "diffusion":
        # some row verified a diffusion draft; "suffix": only suffix drafts; "draft": either) and
        # batch-size bucket (`batch_bucket`): {(kind, bucket): ms}
        self.step_residual: dict[tuple[str, int], float] = {}
        self._residual_recent: dict[tuple[str, int], list[float]] = {}  # key -> its last 3 raw residuals
        self._residual_seen: dict[tuple[str, int], int] = {}  # key -> `_observed` when last updated (or halved)
        self._observed = 0  # steps observed
        self._batch = 1  # rows of the latest step observed
        self._source_of = None  # (outcome, its `_step_source`) of the latest step observed
        self._suffix_pred = None  # (table ms, widened?, fixed drafting ms charged, predicted ms) of this step's choice
        # per (plan | wide, batch bucket): [steps, Σ predicted ms, Σ measured ms] of suffix choices
        self.suffix_calibration: dict[tuple[str, int], list[float]] = {}
        self._plan = None
        # λ: weighted value of the marginal verified slot at the last step's optimum (tokens), fixed
        # before the next step's drafting; 0 until the first step
        self.threshold = torch.tensor(0.0)

    def _apply(self, settings: AdaptiveSettings) -> None:
        """Each setting as an attribute of the same name (``steps_grid`` sorted, without repeats;
        ``sla_clock`` into the request book)."""
        for name in AdaptiveSettings.model_fields:
            setattr(self, name, getattr(settings, name))
        self.steps_grid = tuple(sorted(set(settings.steps_grid)))

    def update(self, predictor=None, cost=None, **settings) -> None:
        """`Policy.update`, the policy's settings validated together (`check_settings`)."""
        own = {k: settings.pop(k) for k in list(settings) if k in AdaptiveSettings.model_fields}
        if own:
            self.settings = check_settings({**self.settings.model_dump(), **own})
            self._apply(self.settings)
        super().update(predictor, cost, **settings)

    @property
    def sla_clock(self) -> str:
        """How a row's time per token is measured against its target: "wall" (as the client
        measures it, other requests' prefills included; `RequestBook`) or "decode" (the sum of the
        decode steps it took part in, which misses other requests' prefills)."""
        return "wall" if self.book.wall_clock else "decode"

    @sla_clock.setter
    def sla_clock(self, value: str) -> None:
        if value not in ("wall", "decode"):
            raise ValueError(f"sla_clock: must be 'wall' or 'decode', got {value!r}")
        self.book.wall_clock = value == "wall"

    def weights(self, ctx) -> torch.Tensor:
        """[B] what a row's *extra* tokens (drafted tokens it wins beyond the one every step
        emits) are worth: 1, more for higher priority, up to 1 + 2·sla_weight when far behind
        target, times the row's weight in a closed batch (`_closed_time`, or `_tail` under
        ``closed_model = "weight"``) (computed once per step and kept in ``ctx``)."""
        if "w" not in ctx:
            ctx["w"] = self._urgency(ctx)
            if "tail" in ctx:
                ctx["w"] = ctx["w"] * ctx["tail"]
        return ctx["w"]

    def base_weights(self, ctx) -> torch.Tensor:
        """[B] what the one token a row emits in every step is worth: `weights`, except in a
        closed batch under ``closed_model = "time"``, where a plain step's tokens are worth the
        whole step (`_closed_time`)."""
        if "tail_base" not in ctx:
            return self.weights(ctx)
        if "w_base" not in ctx:
            ctx["w_base"] = self._urgency(ctx) * ctx["tail_base"]
        return ctx["w_base"]

    def _urgency(self, ctx) -> torch.Tensor:
        """[B] 1, more for higher priority, up to 1 + 2·sla_weight when far behind target (kept in
        ``ctx``: `weights` and `base_weights` both read it); with `sla_reach`, lateness counts
        only for rows whose target is within reach (``ctx["reach"]``, set by the plan)."""
        if "urgency" not in ctx:
            behind = (ctx["lateness"] - self.sla_slack).clamp(0.0, 2.0)
            if "reach" in ctx:
                behind = torch.where(ctx["reach"].to(behind.device), behind, torch.zeros_like(behind))
            ctx["urgency"] = ((1.0 + self.priority_weight * ctx["priority"]).clamp_min(0.1)
                              * (1.0 + self.sla_weight * behind))
        return ctx["urgency"]

    def _ctx(self, rows, device) -> dict:
        ctx = super()._ctx(rows, device)
        if self.sla_reach and "reach" not in ctx and self._reach is not None and self._reach[0] == tuple(rows.request_ids):
            ctx["reach"] = self._reach[1]
        if "tail" not in ctx and getattr(rows, "closed", False):
            if self.closed_model == "time" and len(rows.request_ids) > 1:
                ctx["tail"], ctx["tail_base"] = (t.to(ctx["lateness"].device) for t in self._closed_time(rows))
            else:
                ctx["tail"] = self._tail(rows).to(ctx["lateness"].device)
        return ctx

    def _closed_time(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """([B] extra-token weights, [B] base weights) of a **closed batch** valued by the time its
        tokens save (``closed_model = "time"``). With the cost model's plain step of ``B`` rows
        ``T_B = T0 + B·δ`` (``δ`` what one more row adds, ``T0`` the rest; ``T_B`` measured
        (`plain_ms`), ``T_1`` the cost model's with its residual), the batch's time is
        ``T0`` per step until its last row exits plus ``δ`` per step for each row still running.
        So a row's extra token saves ``δ`` (its own share of a later step), and the extra token of
        the batch's *unique* last row (the most tokens left, ahead of the next row by ``gap``)
        also saves ``T0`` (a whole later step), counted in full for ``gap`` >= 2 and in part
        below; a plain step is worth its whole ``T_B``. In units of an open batch's token
        (``T_B / B``): every row's base weight is 1 (the batch's plain step is worth ``B``, as in
        an open batch), a row's extra tokens weigh ``B·δ / T_B`` (on SmolLM2 here at 8 rows
        ~0.4–0.5: half what they are worth where a freed slot is refilled) and the unique last
        row's ``B·(δ + T0·min(1, gap / 2)) / T_B`` (up to ~5). Rows level at the end (several with the
        most left) end together, so none of them alone shortens the batch: their extra tokens
        weigh ``B·δ / T_B`` like the others'."""
        B = len(rows.request_ids)
        # a plain step of B rows as measured, of one row as the table and its residual say
        T_B = max(self._plain_step_ms(B), 1e-3)
        T_1 = float(self.cost.step_ms_at(1.0)) + self.step_residual.get(("plain", 1), 0.0)
        delta = min(max((T_B - T_1) / (B - 1), 0.0), T_B / B)
        T0 = T_B - B * delta
        left = rows.remaining.float().cpu()                                                  # [B]
        top = left.max()
        last = left >= top                                                              # [B] the most left
        extra = torch.full((B,), B * delta / T_B)
        if int(last.sum()) == 1:
            gap = float(top - left[~last].max())
            extra = torch.where(last, B * (delta + T0 * min(1.0, gap / 2.0)) / T_B, extra)
        return extra, torch.ones(B)

    def _tail(self, rows) -> torch.Tensor:
        """[B] what a row's tokens are worth in a **closed batch** (`RowState.closed`: nothing waits,
        nothing will join): 1 for the rows with the most tokens left (the batch's *tail*: the batch
        ends when they do), ``closed_weight`` for rows ahead of them. A token of a row ahead only
        brings its exit forward, which saves what that row adds to each later step (on SmolLM2
        here ~3 ms of an 8-row step of ~55 ms, under half of a row's ~7 ms share), not a step of the
        batch; so drafting for rows ahead (above all copying long suffix drafts, which widen the
        whole step) is worth a fraction of what it is worth where a waiting or arriving request
        would take the freed slot. Measured without it (8 equal-length requests): the
        policy widened steps by 21 % for 3 % fewer steps, 0.935x autoregressive decoding, while its
        mean request latency was 9 % lower."""
        B = len(rows.request_ids)
        if self.closed_weight >= 1.0 or B < 2:
            return torch.ones(B)
        left = rows.remaining.float().cpu()                                              # [B]
        return torch.where(left >= left.max(), torch.ones(B), torch.full((B,), self.closed_weight))

    def _flat(self, B: int, K: int, rpp: list[int]) -> bool:
        """True when verifying every drafted slot costs under ``flat_share`` more than verifying none."""
        if self.flat_share <= 0:
            return False
        lo = self.cost.step_ms_at(float(B), rpp)
        hi = self.cost.step_ms_at(float(B * (K + 1)), rpp)
        return hi <= lo * (1.0 + self.flat_share)

    # -- before drafting ---------------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """True while the policy holds a plain decision (the next step decides nothing)."""
        return self._hold_left > 0

    def _holds(self, rows) -> bool:
        """Whether this step keeps the held plain answer: a hold is on, and the batch holds no
        request the held decision did not see, or it has at least ``hold_joins_rows`` rows
        (requests that join take plain steps until the hold runs out, at most ``hold_max``)."""
        if self._hold_left <= 0:
            return False
        joins_held = self.hold_joins_rows is not None and len(rows.request_ids) >= self.hold_joins_rows
        return joins_held or self._hold_key.issuperset(rows.request_ids)

    def choose_steps(self, rows) -> torch.Tensor:
        if self._holds(rows):
            t0 = time.thread_time()
            self._hold_left -= 1
            self.held_steps += 1
            steps = torch.zeros(len(rows.request_ids), dtype=torch.int64, device=rows.temperature.device)
            self.last_steps, self._suffix_k, self._suffix_pred = steps, torch.zeros_like(steps), None
            self._diffusion_expect, self._flat_now = None, None
            self.decision_s += time.thread_time() - t0
            self.steps_decided += 1
            return steps
        # a request joined during a hold: the engine proposed no suffix drafts for this step
        broke, self._hold_left = self._hold_left > 0, 0
        before = self.decision_s
        steps = super().choose_steps(rows)
        ms = 1e3 * (self.decision_s - before)
        self.decide_ms = ms if self.decide_ms is None else 0.9 * self.decide_ms + 0.1 * ms
        plain = not bool((steps != 0).any())
        saw_all = getattr(rows, "suffix_len", None) is not None or not (self.use_suffix and broke)
        # deciding costs every row of the step; what it may catch (a copy) is one row's tokens
        share = self.plain_ms / len(rows.request_ids) if self.plain_ms is not None else None
        dear = self.hold_share == 0 or (share is not None and self.decide_ms >= self.hold_share * share)
        if plain and self.hold_max > 0 and saw_all and dear:
            # a plain decision made with every source in view: hold it for 1, 2, 4, ... steps
            self._plain_run += 1
            self._hold_left = min(self.hold_max, 1 << min(self._plain_run - 1, 16))
            self._hold_key = frozenset(rows.request_ids)
        elif not plain:
            self._plain_run = 0
        return steps

    def _span(self, rows, steps: list[int]) -> int:
        """`draft_span`: the longest draft the plan gives a diffusion row, plus ``span_headroom``
        positions (after drafting, confident drafts may verify a little past the plan: on
        SmolLM2's mixed workload no row verified past plan + 2, docs/controller.md); the
        whole block where verifying every slot is nearly free (`_flat`), with ``span_headroom``
        None, or without a plan for these rows."""
        K = int(getattr(rows, "block_size", 0) or self.block_size)
        diffusing = [s > 0 for s in steps]                                             # [B] host
        rpp = rows_per_pass(steps)
        plan = self._plan
        if (self.span_headroom is None or plan is None or plan[0] != tuple(rows.request_ids)
                or not any(diffusing) or self._flat(len(diffusing), K, rpp)):
            span = K
        else:
            toks = plan[4].tolist()  # verified positions per row, bonus included
            planned = int(max(t for t, d in zip(toks, diffusing) if d)) - 1
            span = max(1, min(K, planned + self.span_headroom))
        self.typical_span = span if self.typical_span is None else 0.8 * self.typical_span + 0.2 * span
        self._span_now = span
        # whether `choose_verify` will verify every drafted slot (`_flat` at this span): then it
        # reads no draft features, and the engine need not compute them (`reads_draft_features`)
        self._flat_now = any(diffusing) and self._flat(len(diffusing), span, rpp)
        return span

    @property
    def reads_draft_features(self) -> bool:
        """Whether this step's `choose_verify` reads the drafts' features (confidence, entropy,
        margin: a top-2 and an entropy over [B, span, Vd] that the engine computes only for a
        reader, workers/engine.py): not where `_span` found that it will verify every drafted
        slot (`_flat`), which needs no predictor."""
        return self._flat_now is not True

    def _price_span(self, K: int) -> None:
        """Let the cost model price drafting passes at the span this policy drafts (`typical_span`;
        before any, the headroom over a 3-token plan), so the plan and the suffix choice weigh
        what a pass costs now (`CostModel.span_scale`)."""
        if hasattr(self.cost, "span"):
            guess = K if self.span_headroom is None else min(K, 3 + self.span_headroom)
            self.cost.span = round(self.typical_span) if self.typical_span is not None else guess

    def stats(self) -> dict:
        out = super().stats()
        out["held_share"] = self.held_steps / max(self.steps_decided, 1)
        # suffix drafts taken and the online recalibration of their acceptance (`suffix_accept_ratio`)
        out["suffix_accept"] = {"drafts": self.suffix_drafts, "ratio": round(self.suffix_accept_ratio, 3)}
        # diffusion drafts taken and the plan's online recalibration per class (`diffusion_accept_ratio`)
        ratio = self.diffusion_accept_ratio.tolist()                                   # [2, S]
        out["diffusion_accept"] = {"drafts": self.diffusion_drafts, "ratio": {
            cls: {str(st): round(r, 3) for st, r in zip(self.steps_grid, ratio[i])} for i, cls in enumerate(("greedy", "sampled"))}}
        # what each kind of step took beyond the cost tables (`step_residual`), per batch bucket
        out["step_residual"] = {f"{k}@{b}": round(v, 2) for (k, b), v in sorted(self.step_residual.items())}
        # what each suffix choice predicted its step would take against what it took, per kind
        # (plan: no widening; wide: widened by suffix drafts) and batch bucket
        out["suffix_calibration"] = {f"{k}@{b}": {"steps": int(n), "predicted_ms": round(p / n, 2), "measured_ms": round(m / n, 2)}
                                     for (k, b), (n, p, m) in sorted(self.suffix_calibration.items()) if n}
        return out

    def _steps(self, rows, ctx):
        B = len(rows.request_ids)
        K = int(getattr(rows, "block_size", 0) or self.block_size)
        self._suffix_k, self._suffix_expect, self._span_now, self._flat_now = None, None, None, None
        self._diffusion_expect = None
        if B == 0 or K == 0:
            return torch.zeros(B, dtype=torch.int64)
        if not getattr(rows, "has_drafter", True):  # suffix drafts only (an engine without a drafter)
            steps, extra, toks = torch.zeros(B, dtype=torch.int64), torch.zeros(B), torch.ones(B)
        elif len(self.steps_grid) == 1 and not self.allow_no_draft:
            steps = torch.full((B,), self.steps_grid[0], dtype=torch.int64)
            extra, toks = torch.full((B,), float("inf")), torch.full((B,), float(K + 1))
        else:
            # the step plan moves slowly (recent acceptance, lateness): re-plan every few steps
            # while the batch keeps the same requests
            key = tuple(rows.request_ids)
            if self._plan is not None and self._plan[0] == key and self._plan[1] < self.replan_every:
                self._plan = (key, self._plan[1] + 1, *self._plan[2:])
            else:
                self._plan = (key, 1, *self._plan_steps(rows, ctx, B, K))
            steps, extra, toks = self._plan[2], self._plan[3], self._plan[4]
        plan = self._plan
        raw = plan[5:7] if plan is not None and len(plan) > 6 and plan[0] == tuple(rows.request_ids) else None
        if self.use_suffix and getattr(rows, "suffix_len", None) is not None and bool((rows.suffix_len > 0).any()):
            steps = self._take_suffix(rows, ctx, steps, extra, toks)
        if raw is not None:  # what the plan's prior predicts the diffusion rows that stay will win
            self._diffusion_expect = (torch.where(steps.cpu() > 0, raw[0], torch.zeros_like(raw[0])), raw[1])
        return steps

    @property
    def reads_suffix(self) -> bool:
        """The engine computes suffix drafts for this policy's next step (workers/decisions.py):
        not while it holds a plain decision."""
        return self.use_suffix and self._hold_left == 0

    def _take_suffix(self, rows, ctx, steps: torch.Tensor, extra: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
        """Rows whose suffix draft beats their planned choice take it (see the module docstring).
        steps [B]: the plan; extra [B]: the expected extra tokens of each row's planned draft (0
        for rows without one); toks [B]: the plan's verified positions per row. Sets
        ``_suffix_k`` [B].

        Candidates are draft lengths for every row at once (`suffix_candidates`): one cap for
        the batch where the engine pads rows to the longest (``B · (k_max + 1)`` positions), and
        on a packed engine (``rows.packed_verify``: each row costs its own positions) the
        prefixes of all rows' suffix slots ranked by marginal gain ``w_r · a_{r,j}``, so a long
        confident copy takes many slots while a weak match takes few or none. The candidate
        that maximises the batch's weighted tokens per ms
        ``(E_plan + Σ_{r switching} w_r · (win_r(k_r) − extra_r)) / step_ms(positions)`` wins (a
        diffusion row that switches no longer pays its drafter passes). Only rows whose copy wins
        more than their plan (``win_r > extra_r``) switch.

        With ``suffix_first`` every row that has a suffix draft takes the whole of it, whatever its
        plan (static suffix drafting's choice, kept where the suffix drafter has nothing)."""
        from workers.decisions import SUFFIX

        B = len(rows.request_ids)
        n = rows.suffix_len.cpu()                                                      # [B]
        Ks = int(n.max())
        vote = getattr(rows, "suffix_vote", None) if self.suffix_vote else None
        by_table = suffix_draft_accept(self.suffix_accept, rows.suffix_match.cpu(),    # [B, Ks] accepted, 0 past the draft
                                       None if vote is None else vote.cpu()[:, :Ks], n, rows.temperature.cpu() > 0)
        if self.suffix_first:  # copy first: as static suffix drafting, over the plan where a draft exists
            take = n > 0
            self._suffix_pred = None
            self._suffix_k = torch.where(take, n, 0).to(torch.int64)
            self._suffix_expect = torch.where(take, by_table.sum(1), 0.0)               # [B] before recalibration
            return torch.where(take, SUFFIX, steps)
        w = self.weights(ctx).cpu()                                                    # [B]
        slot = (by_table * self.suffix_row_ratio(ctx)[:, None]).clamp(max=1.0)         # recalibrated online
        win = torch.cat([torch.zeros(B, 1), slot.cumsum(1)], 1)                        # [B, Ks + 1] expected accepted
        packed = bool(getattr(rows, "packed_verify", False))
        if not self._copy_may_win(w, win, extra):  # every candidate is the plan: the same answer, fewer operations
            return self._keep_plan(steps, toks, packed)
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
        verified, raw = self._candidate_ms(steps, diffusing, toks, k, take, stay, packed)  # [C] positions, [C] ms
        wide = verified > verified[0]
        ratio = self.suffix_cost_ratio
        ms = raw * torch.where(wide, ratio["wide"], ratio["plan"])
        fixed = torch.zeros_like(ms)                                                   # [C] drafting path's fixed ms
        if not bool(diffusing.any()):  # the plan drafts nothing: taking a suffix draft takes the drafting path
            fixed = torch.where(take.any(0), self.draft_overhead_at(B, "suffix"), 0.0)
        ms = ms + fixed
        planned = float((self.base_weights(ctx).cpu() + w * plan_extra).sum())
        value = (planned + gain.sum(0)) / ms.clamp_min(1e-6)                          # [C] weighted tokens per ms
        if self.sla_guard:
            got = torch.where(take, expect, kept_extra)                                # [B, C]
            keeps = keeps_targets(ctx, ms, 1.0 + got, rows.remaining, self.sla_slack, self._behind_veto(B))
            value = torch.where(keeps, value, 0.0)
        best = int(torch.argmax(value))
        # taking drafts must be predicted `suffix_margin` better than the plan (default 0: with
        # calibrated costs, any margin only declines drafts that pay; measured 1.05x on
        # mixed at 1 request without it, against 0.99x with 5 %)
        if best == 0 or value[best] <= value[0] * (1.0 + self.suffix_margin):
            self._suffix_k = torch.zeros(B, dtype=torch.int64)
            self._suffix_pred = (float(raw[0]), False, float(fixed[0]), float(ms[0]))
            return steps
        self._suffix_pred = (float(raw[best]), bool(wide[best]), float(fixed[best]), float(ms[best]))
        self._suffix_k = torch.where(take[:, best], k[:, best], 0).to(torch.int64)
        table_win = torch.cat([torch.zeros(B, 1), by_table.cumsum(1)], 1).gather(1, self._suffix_k[:, None])[:, 0]
        self._suffix_expect = torch.where(take[:, best], table_win, 0.0)               # [B] before recalibration
        return torch.where(take[:, best], SUFFIX, steps)

    def _copy_may_win(self, w: torch.Tensor, win: torch.Tensor, extra: torch.Tensor) -> bool:
        """Whether some candidate of `_take_suffix` may take a suffix draft: a row whose whole
        copy (``win`` [B, Ks + 1], its last column) is expected to win more than its plan's extra
        tokens (``extra`` [B]) and whose tokens count (``w`` [B] > 0)."""
        return bool(((w > 0) & (win[:, -1] > extra.clamp(min=0))).any())

    def _candidate_ms(self, steps, diffusing, toks, k, take, stay, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """([C] verified positions, [C] table ms) of `_take_suffix`'s candidate steps: steps [B] the
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
        return verified, self.cost.step_ms(verified.double(), rpp if top else None).float()

    def _keep_plan(self, steps: torch.Tensor, toks: torch.Tensor, packed: bool) -> torch.Tensor:
        """`_take_suffix`'s answer where no row takes its suffix draft: the plan ``steps`` [B],
        with the plan's predicted step (its candidate column 0) kept for the cost correction."""
        B = steps.shape[0]
        none = torch.zeros(B, 1, dtype=torch.int64)                                    # [B, 1] no suffix draft
        diffusing = steps > 0                                                          # [B]
        _, raw = self._candidate_ms(steps, diffusing, toks, none, none.bool(), diffusing[:, None], packed)  # [1]
        ms = raw * self.suffix_cost_ratio["plan"]
        self._suffix_k = torch.zeros(B, dtype=torch.int64)
        self._suffix_pred = (float(raw[0]), False, 0.0, float(ms[0]))
        return steps

    @property
    def suffix_accept_ratio(self) -> float:
        """Accepted over table-predicted tokens of the suffix drafts taken so far (sums decayed by
        `SUFFIX_DECAY` per drafting step, with a prior of `SUFFIX_PRIOR` tokens at ratio 1),
        clipped to [0.25, 2]; 1 with ``suffix_recalibrate`` off. Steps without suffix drafts decay
        the sums too (`SUFFIX_IDLE_DECAY`), so a ratio that stopped all drafting returns towards 1
        and drafts are retried on new evidence. The table is fitted on one set of
        prompts; on others a copy may run on less (or more) than it says. Measured on SmolLM2's
        edit workload at batch 1, the static table's drafts won fewer tokens than
        predicted and cost more than plain steps saved; the ratio scales every slot's
        acceptance, so the choice prices drafts at what they win here."""
        if not self.suffix_recalibrate:
            return 1.0
        r = (self.suffix_won + SUFFIX_PRIOR) / (self.suffix_predicted + SUFFIX_PRIOR)
        return min(max(r, 0.25), 2.0)

    def suffix_row_ratio(self, ctx) -> torch.Tensor:
        """[B] the recalibration each row's suffix slots get: `suffix_accept_ratio` (every
        request's drafts; a ratio per request measured no gain in interleaved runs,
        docs/benchmarks.md)."""
        return torch.full_like(ctx["suffix_won"].cpu(), self.suffix_accept_ratio)

    def _learn_suffix_accept(self, rows, outcome) -> None:
        """Add this step's suffix rows' accepted and table-predicted tokens to the decayed sums
        (decayed: old evidence fades)."""
        expect, self._suffix_expect = self._suffix_expect, None
        B = len(outcome.accepted)
        taken = None if expect is None or B != len(expect) else expect > 0
        if taken is None or not bool(taken.any()):  # forget slowly: the ratio drifts back to 1, so drafts get retried
            self.suffix_won *= SUFFIX_IDLE_DECAY
            self.suffix_predicted *= SUFFIX_IDLE_DECAY
            return
        won = torch.as_tensor(outcome.accepted).cpu().float()                         # [B]
        self.suffix_won = SUFFIX_DECAY * self.suffix_won + float(won[taken].sum())
        self.suffix_predicted = SUFFIX_DECAY * self.suffix_predicted + float(expect[taken].sum())
        self.suffix_drafts += int(taken.sum())

    @property
    def diffusion_accept_ratio(self) -> torch.Tensor:
        """[2, S] (greedy rows, sampled rows) × (each step count of ``steps_grid``): tokens the
        diffusion drafts taken so far won over the extra tokens the plan's prior predicted for
        them (sums decayed by `DIFFUSION_DECAY` per step with such drafts, `DIFFUSION_IDLE_DECAY`
        per step without, with a prior of `DIFFUSION_PRIOR` tokens at ratio 1), clipped to
        [0.25, 2]; ones with ``diffusion_recalibrate`` off. The plan scales the prior's survival
        curves by it, so the planned extra tokens that the level greedy (which step count) and
        the suffix choice (`_take_suffix`) weigh are what diffusion drafts win here. The prior is
        fitted on traces of one drafter and workload, drafting every row with the whole block;
        measured live on SmolLM2's mixed workload at one request, greedy drafts of two
        denoising steps won 0.72 extra tokens where the plan predicted 1.00, one step 0.95 where
        it predicted 0.80 (the shipped drafter gains nothing from a second step), so without
        the ratio the plan paid for a second drafter pass on most greedy steps."""
        won, predicted = (torch.tensor(x, dtype=torch.float64).view(2, -1) for x in self._diffusion_sums())
        if not self.diffusion_recalibrate:
            return torch.ones_like(won)
        return ((won + DIFFUSION_PRIOR) / (predicted + DIFFUSION_PRIOR)).clamp(0.25, 2.0)

    def _diffusion_sums(self) -> tuple[list[float], list[float]]:
        """(won, predicted): the decayed sums of `diffusion_accept_ratio`, flat lists of 2 · S
        host floats (cell ``class · S + level``, class 1 for sampled rows), made (zeros) at first
        use and again when ``steps_grid`` changed. Host numbers, not tensors: a step updates one or
        a few cells, which costs a dozen small tensor operations and no arithmetic worth one."""
        S = len(self.steps_grid)
        if self.diffusion_won is None or len(self.diffusion_won) != 2 * S:
            self.diffusion_won, self.diffusion_predicted = [0.0] * (2 * S), [0.0] * (2 * S)
        return self.diffusion_won, self.diffusion_predicted

    def _learn_diffusion_accept(self, rows, outcome) -> None:
        """Add this step's diffusion rows' accepted tokens and plan-predicted extra tokens (before
        recalibration) to the decayed sums of their class and step count; a cell without such
        drafts this step lets its evidence fade."""
        won_sums, predicted_sums = self._diffusion_sums()
        found, self._diffusion_expect = self._diffusion_expect, None
        B = len(outcome.accepted)
        expect, level = found if found is not None else (None, None)
        cells = {}  # flat (class, step) cell -> [tokens won, tokens predicted] this step
        if expect is not None and B == len(expect):
            S = len(won_sums) // 2
            for e, lv, a, t in zip(expect.tolist(), level.tolist(), torch.as_tensor(outcome.accepted).tolist(),
                                   rows.temperature.tolist()):
                if e > 0 and math.isfinite(e):  # the row verified a diffusion draft the plan predicted
                    cell = cells.setdefault((t > 0) * S + min(lv, S - 1), [0.0, 0.0])
                    cell[0] += a
                    cell[1] += e
                    self.diffusion_drafts += 1
        for c in range(len(won_sums)):
            w, p = cells.get(c, (0.0, 0.0))
            decay = DIFFUSION_DECAY if c in cells else DIFFUSION_IDLE_DECAY
            won_sums[c] = decay * won_sums[c] + w
            predicted_sums[c] = decay * predicted_sums[c] + p

    def draft_overhead_at(self, batch: int, source: str = "diffusion", credit: bool | None = None) -> float:
        """The fixed extra ms of a step of `batch` rows that verifies drafts of ``source``
        ("diffusion": some row drafts by diffusion; "suffix": only suffix drafts) over one that
        verifies none, beyond what the cost model predicts for both (decisions, features, rule
        resolution, attention over the drafted positions, the acceptance path): the difference
        of the two kinds' residual EMAs in the batch's size bucket (`batch_bucket`), else in the
        nearest bucket that saw both kinds, times the ratio of the two buckets where that one is
        smaller (`overhead_scales`: the cost grows with the rows; measured: the first
        drafting steps of 31 rows, priced from 4-row steps, took 1.3–1.5x their prediction,
        207 ms for 136 predicted); 0 until some bucket did (so a source not tried yet is tried).
        Per batch size, because it grows with the batch: on SmolLM2 on a 2-core CPU without
        native bf16 one row verifying 2 drafts added ~1 ms to a 1-row step and
        ~45–80 ms to an 8-row one, which the verify table, indexed by positions only, does not
        see. One estimate over every drafting step ("draft") prices both sources: one per source
        measured worse live at 2 and 8 requests (at 8 rows the combined estimate, which diffusion
        steps make dear, kept copies from widening the batch; docs/benchmarks.md).

        A **credit** (``credit``, default ``draft_credit``, on): where drafting steps ran *under*
        the tables by more than plain steps did, diffusion plans get the difference back as a
        negative extra, at most one drafter pass of the batch (`CostModel.draft_ms_at`). A start-up
        profile that overprices drafting (measured: diffusion steps 12 ms under the tables, drafted
        on 0.5–44 % of steps) is then corrected within a few drafting steps instead of the tables'
        slow online correction, which only drafting steps move. The tables themselves always learn
        the measured time (`_table_ms` takes no credit), so the residual, and the credit with it,
        fades as they catch up. Suffix steps get none (they run no drafter pass to overprice)."""
        res = self.step_residual
        credit = self.draft_credit if credit is None else credit
        key = "draft"
        both = [b for (kind, b) in res if kind == key and ("plain", b) in res]
        if not both:
            return 0.0
        bucket = batch_bucket(batch)
        b = min(both, key=lambda x: (abs(x.bit_length() - bucket.bit_length()), x))
        extra = res[(key, b)] - res[("plain", b)]
        if extra >= 0:
            return (bucket / b if self.overhead_scales and b < bucket else 1.0) * extra
        if not credit or source != "diffusion":
            return 0.0
        return max(extra, -self.cost.draft_ms_at([batch]))

    @property
    def draft_overhead_ms(self) -> float:
        """`draft_overhead_at` the latest step's batch size, for diffusion drafting."""
        return self.draft_overhead_at(self._batch)

    def _step_source(self, outcome) -> str:
        """What kind of step ``outcome`` was: "plain" (no drafts verified), "suffix" (only suffix
        drafts: the decision had no diffusion row) or "diffusion"."""
        known = self._source_of
        if known is not None and known[0] is outcome:  # asked twice per step (`_table_ms`, `observe`)
            return known[1]
        steps = self.last_steps
        if not verified_drafts(outcome):
            source = "plain"
        else:
            source = "suffix" if steps is not None and not bool((steps > 0).any()) else "diffusion"
        self._source_of = (outcome, source)
        return source

    def _table_ms(self, outcome, step_ms: float) -> float:
        """A step that verified drafts teaches the cost tables its time less `draft_overhead_at`
        its batch size and source, which this policy charges separately: else the tables absorb
        the drafting path's fixed cost too (measured on the demo pair: a verify table steep from
        1 to 2 tokens per row and the fixed cost counted twice)."""
        source = self._step_source(outcome)
        if source != "plain":
            return max(step_ms - self.draft_overhead_at(len(outcome.accepted), source, credit=False), 1e-3)
        return step_ms

    def observe(self, rows, outcome) -> None:
        predicted = None  # this step's cost as predicted before `super().observe` nudges the tables
        if self.online_cost and self.last_steps is not None:
            predicted = self.cost.step_ms_at(float(outcome.num_tokens), rows_per_pass(self.last_steps))
        super().observe(rows, outcome)
        measured = outcome_ms(outcome)
        drafted = verified_drafts(outcome)
        if measured > 0 and not drafted:
            self.plain_ms = measured if self.plain_ms is None else 0.9 * self.plain_ms + 0.1 * measured
        self._batch = len(outcome.accepted)
        self._observed += 1
        if predicted is not None and measured > 0:
            source = self._step_source(outcome)
            bucket = batch_bucket(self._batch)
            for kind in (source,) if source == "plain" else (source, "draft"):  # "draft": every drafting step
                self._learn_residual((kind, bucket), measured - predicted)
            self._halve_stale_penalties(bucket)
        self._learn_suffix_accept(rows, outcome)
        self._learn_diffusion_accept(rows, outcome)
        if self._suffix_pred is not None and self.online_cost:  # correct the choice's cost by what the step took
            chosen_ms, wide, fixed_ms, predicted_ms = self._suffix_pred
            self._suffix_pred = None
            if chosen_ms > 0 and measured > 0:
                key = "wide" if wide else "plan"
                cal = self.suffix_calibration.setdefault((key, batch_bucket(self._batch)), [0, 0.0, 0.0])
                cal[0], cal[1], cal[2] = cal[0] + 1, cal[1] + predicted_ms, cal[2] + measured
                # the ratio corrects what the fixed drafting cost, charged separately, does not
                # explain (else that cost is counted twice: once scaled into the ratio, once added)
                r = min(max((measured - fixed_ms) / chosen_ms, 0.25), 4.0)
                self.suffix_cost_ratio[key] = 0.8 * self.suffix_cost_ratio[key] + 0.2 * r

    def _learn_residual(self, key: tuple[str, int], r: float) -> None:
        """Move ``key``'s residual EMA toward the median of its last three raw residuals (the
        first estimate: the median of the first three), so that one stalled step (a page fault, a
        noisy neighbour: hundreds of ms) teaches nothing, while a real extra cost, which every
        step of the kind pays, is learned as before: the drafting path's extra cost may be
        several times the table's prediction at 8 rows (`draft_overhead_at`), so bounding the
        residual by the prediction, as the tables do (`adapt.cost_model.RESIDUAL_BOUND`), would
        not serve here."""
        recent = self._residual_recent.setdefault(key, [])
        recent.append(float(r))
        del recent[:-3]
        self._residual_seen[key] = self._observed
        if len(recent) < 3:
            return
        m = sorted(recent)[1]
        prev = self.step_residual.get(key)
        self.step_residual[key] = m if prev is None else 0.9 * prev + 0.1 * m

    def _halve_stale_penalties(self, bucket: int) -> None:
        """Halve each drafting kind's residual excess over the plain steps' in ``bucket`` (a *stale
        penalty*) that no step of its kind has measured for `STALE_STEPS` (128) steps; again after
        as many more. A penalty is only ever measured on steps of its kind, so one learned in a
        slow spell of the machine (the plain steps after it relearn theirs) would otherwise price
        that kind out for good. At most one such re-try per `STALE_STEPS` steps."""
        res, seen = self.step_residual, self._residual_seen
        plain = res.get(("plain", bucket))
        if plain is None:
            return
        for kind in ("diffusion", "suffix", "draft"):
            key = (kind, bucket)
            if res.get(key, plain) > plain and self._observed - seen.get(key, 0) >= STALE_STEPS:
                res[key] = plain + 0.5 * (res[key] - plain)
                seen[key] = self._observed

    def _with_suffix(self, decision, rows, draft):
        """The verify decision with suffix rows' draft lengths (chosen in `_take_suffix`) and exact rules."""
        from workers.decisions import SUFFIX

        suffix = draft.steps == SUFFIX
        if self._suffix_k is None or not bool(suffix.any()):
            return decision
        dev = decision.draft_len.device
        k = torch.where(suffix, self._suffix_k.to(dev), decision.draft_len)
        rule = torch.where(suffix, draft.exact_rule.to(decision.rule.dtype), decision.rule)
        zero = torch.zeros_like(decision.param)
        return make_verify_decision(k, rule, torch.where(suffix, zero, decision.param), rows,
                                    torch.where(suffix, zero, decision.param2))

    def _plan_steps(self, rows, ctx, B: int, K: int) -> tuple[torch.Tensor, ...]:
        """(steps [B], expected extra tokens [B] of each row's planned draft (0 for rows without
        one), planned verified positions [B] (bonus included), the same extra tokens as the prior
        predicts them before `diffusion_accept_ratio` [B], each row's index in ``steps_grid`` [B]
        (these two: what the recalibration learns from))."""
        dev = rows.temperature.device
        self._price_span(K)
        pred = self._predictor_on(dev)
        temp = rows.temperature.to(dev)
        recent = self._recent(rows, ctx["idle"], pred).to(dev)                        # [B]
        grid = torch.tensor(self.steps_grid, device=dev)                              # [S]
        S = grid.numel()
        cond = (grid[None, :] <= 1) | ctx["left_to_right"][:, None]                   # [B, S]
        match = (temp[:, None] > 0) & ~cond
        eps = torch.where(temp > 0, torch.minimum(ctx["eps"], ctx["budget_left"] / K), torch.zeros_like(temp))
        eps = torch.where(cond, eps[:, None], torch.zeros_like(eps)[:, None])          # [B, S]
        raw = pred.prior_survival(grid, K, temp, recent, match, eps)                    # [B, S, K]
        ratio = self.diffusion_accept_ratio.float().to(dev)[(temp > 0).long()]          # [B, S] recalibrated online
        surv = (raw * ratio[:, :, None]).clamp(max=1.0)                                 # [B, S, K]
        if self.sla_reach:  # lateness weighs only where the target is within reach (before the weights)
            reach = self._reachable(rows, ctx, surv.sum(-1).amax(1).cpu(), B)
            self._reach = (tuple(rows.request_ids), reach)
            for key in ("urgency", "w", "w_base"):
                ctx.pop(key, None)
            ctx["reach"] = reach
        w = self.weights(ctx)                                                         # [B] extra tokens' worth
        w_base = self.base_weights(ctx)                                               # [B] the step's own token's
        keep = w[:, None, None] * surv >= self._lambda(float(w_base.sum()), B).to(dev)  # planned prefix
        gain = w_base[:, None] + w[:, None] * (surv * keep).sum(-1)                   # [B, S]
        toks = 1.0 + keep.sum(-1).float()                                             # [B, S]
        # level by level (s = 0 -> s_1 -> s_2 ...): admit the rows that gain most while Θ_w rises
        if self.allow_no_draft:
            cur_gain, cur_tok, prev_s, first = w_base.clone(), torch.ones(B, device=dev), 0, 0
            level = torch.full((B,), -1, dtype=torch.int64, device=dev)
            fixed_draft = 0.0
        else:
            cur_gain, cur_tok, prev_s, first = gain[:, 0].clone(), toks[:, 0].clone(), self.steps_grid[0], 1
            level = torch.zeros(B, dtype=torch.int64, device=dev)
            fixed_draft = prev_s * self.cost.draft_ms_at([B])
        pass_ms = self.cost.draft_ms(torch.arange(B + 1, dtype=torch.float64)[:, None])  # [B+1]: a pass of n rows
        fixed_extra = self.draft_overhead_at(B, "diffusion")
        for i in range(first, S):
            s = self.steps_grid[i]
            eligible = level == i - 1
            d_gain = torch.where(eligible, gain[:, i] - cur_gain, torch.zeros_like(cur_gain))
            order = torch.argsort(torch.where(eligible, d_gain, torch.full_like(d_gain, -1e9)), descending=True)
            d_tok = (toks[:, i] - cur_tok)[order].cpu()
            g = torch.cat([torch.zeros(1), d_gain[order].cpu().cumsum(0)])              # [B+1]
            t = torch.cat([torch.zeros(1), d_tok.cumsum(0)])
            ms = self.cost.step_ms(float(cur_tok.sum()) + t) + fixed_draft + (s - prev_s) * pass_ms
            # a step in which some row drafts takes the drafting path: its fixed extra cost
            if bool((level >= 0).any()):
                ms = ms + fixed_extra
            else:
                ms[1:] = ms[1:] + fixed_extra
            theta = (float(cur_gain.sum()) + g) / ms.float().clamp_min(1e-6)
            count = int(eligible.sum())
            if self.sla_guard and self.sla_guard_plan:  # candidates that push a row off its target are worth 0
                theta = torch.where(self._plan_keeps(rows, ctx, ms.float(), order, cur_gain, gain[:, i], w_base, w),
                                    theta, 0.0)
            if i == 0 and self.allow_no_draft:
                # drafting stays the default: rows stay without drafts only where that is predicted
                # to be at least `no_draft_margin` better (the prior is noisy for a single row)
                theta[0] = theta[0] / (1.0 + self.no_draft_margin)
            n_star = int(torch.argmax(theta[: count + 1]))
            if n_star == 0:
                break
            chosen = order[:n_star]
            cur_gain[chosen], cur_tok[chosen], level[chosen] = gain[chosen, i], toks[chosen, i], i
            fixed_draft = fixed_draft + (s - prev_s) * self.cost.draft_ms_at([n_star])
            prev_s = s
        steps = torch.where(level >= 0, grid[level.clamp_min(0)], torch.zeros_like(level))
        # (a closed batch may weigh a row's extra tokens at 0: then it has none planned)
        extra = torch.where(level >= 0, planned_extra(cur_gain, w_base, w), torch.zeros_like(w))
        raw_extra = (raw * keep).sum(-1).gather(1, level.clamp_min(0)[:, None])[:, 0]   # [B] before the ratio
        raw_extra = torch.where(level >= 0, raw_extra, torch.zeros_like(raw_extra))
        return (steps, extra.cpu(), torch.where(level >= 0, cur_tok, torch.ones_like(cur_tok)).cpu(),
                raw_extra.float().cpu(), level.clamp_min(0).cpu())

    def _plan_keeps(self, rows, ctx, ms: torch.Tensor, order: torch.Tensor, cur_gain: torch.Tensor,
                    new_gain: torch.Tensor, w_base: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """[B + 1] `keeps_targets` for a level of the plan: candidate ``n`` admits the first ``n``
        rows of ``order`` to the level, at ``ms`` [B + 1] predicted; each row's expected tokens are
        its one token plus its planned extra tokens (`planned_extra`; ``cur_gain`` [B] before the
        level, ``new_gain`` [B] admitted to it)."""
        B = len(order)
        rank = torch.argsort(order.cpu())                                               # [B] place in `order`
        w_base, w = w_base.cpu(), w.cpu()
        now = 1.0 + planned_extra(cur_gain.cpu(), w_base, w)                            # [B] expected tokens
        then = 1.0 + planned_extra(new_gain.cpu(), w_base, w)
        n = torch.arange(B + 1)                                                         # [C] rows admitted
        tokens = torch.where(rank[:, None] < n[None, :], then[:, None], now[:, None])   # [B, C]
        return keeps_targets(ctx, ms.cpu(), tokens, rows.remaining, self.sla_slack, self._behind_veto(B))

    def _plain_step_ms(self, B: int) -> float:
        """A plain step of ``B`` rows: as measured (`plain_ms`, while the latest step had ``B``
        rows; the tables are indexed by positions and miss what grows with rows and context:
        attention), else the cost table's."""
        return float(self.plain_ms if self.plain_ms is not None and self._batch == B else self.cost.step_ms_at(float(B)))

    def _reachable(self, rows, ctx, best_extra: torch.Tensor, B: int) -> torch.Tensor:
        """[B] whether each row can still meet its TPOT target: the pace its remaining tokens need,
        ``(T · (n + R) − elapsed) / R`` ms per token (``R`` = ``rows.remaining``), is no faster
        than a plain step of this batch (measured, `plain_ms`, else the cost table) bringing it
        ``1 + best_extra`` tokens [B] (its most expected extra tokens of a draft, over the whole
        block at the best step count). A row out of reach gains nothing from being weighted up:
        the tokens its weight buys cost the batch's throughput and meet no target. Measured
        (load 32): drafting for ~11 rows two to three times behind a 39 ms target, in
        90 ms plain steps, took steps to 218 ms for 45 tokens (0.21 tokens/ms against 0.35
        plain). Rows without a target count as within reach (their weight is 1 anyway)."""
        T = ctx["tpot_ms"].cpu()                                                       # [B] inf = none
        left = rows.remaining.cpu().float().clamp_min(1.0)                              # [B]
        n, elapsed = ctx["tokens"].cpu().float(), ctx["elapsed_ms"].cpu().float()       # [B]
        need = (T * (n + left) - elapsed) / left                                        # [B] ms per token
        return ~torch.isfinite(T) | (need * (1.0 + best_extra.float()) >= self._plain_step_ms(B))

    def _behind_veto(self, B: int) -> bool:
        """Whether rows behind their target veto what slows them in a step of ``B`` rows
        (`keeps_targets`' ``behind``): with `sla_guard_behind`, in batches of at least
        `sla_guard_behind_rows` rows."""
        return self.sla_guard_behind and B >= self.sla_guard_behind_rows

    def _lambda(self, base: float, B: int) -> torch.Tensor:
        """λ as a plan reads it: the last drafting step's (`threshold`), but never below what a
        plain step of ``B`` rows earns for the ms one more verified token costs (``base`` its
        weighted tokens: ``base / step_ms(B) · dms``; the batch's best rate is at least the plain
        step's). Before the first drafting step, and long after the last, this floor is the
        threshold: at λ = 0 a plan would verify the whole block, whose cost on a CPU (a 17-token
        step at ~2x a plain one on SmolLM2) prices drafting out for good, since a plan that never
        drafts never learns a λ (measured: the policy drafted on 0 % or on ~75 % of steps of the
        same run by how the start-up profile priced a 17-token step)."""
        plain = max(float(self.cost.step_ms_at(float(B))), 1e-6)
        dms = max((float(self.cost.step_ms_at(B + 8.0)) - plain) / 8.0, 0.0)
        return torch.maximum(self.threshold, torch.tensor(base / plain * dms))

    def _recent(self, rows, idle: torch.Tensor, pred) -> torch.Tensor:
        """[B] recent acceptance as the prior should read it: the class's typical value for rows
        without verified drafts; pulled toward it by ``1 − idle_decay^idle`` for rows that have not
        verified drafts for ``idle`` [B] steps."""
        recent = rows.recent_accept.float().cpu()
        by_class = getattr(pred, "typical_recent", None)                              # [2] greedy, sampled
        by_class = by_class.cpu() if by_class is not None else torch.full((2,), 0.5)
        typical = by_class[(rows.temperature.cpu() > 0).long()]                       # [B]
        pull = 1.0 - self.idle_decay ** idle.cpu()
        return torch.where(recent >= 0, recent + (typical - recent) * pull, typical)

    # -- after drafting ----------------------------------------------------------------------------
    def _verify(self, rows, draft, ctx):
        return self._with_suffix(self._verify_drafts(rows, draft, ctx), rows, draft)

    def _verify_drafts(self, rows, draft, ctx):
        B, K = draft.confidence.shape
        dev = draft.confidence.device
        rpp = rows_per_pass(draft.steps)
        max_s = len(rpp)
        if max_s == 0:  # no row drafted: every row emits its one target token
            return no_draft_decision(rows, dev)
        span = min(K, self._span_now or K)  # the positions the drafter denoised (0 confidence past them)
        flat = self._flat_now  # as `_span` found it where it was asked (then the engine computed no features)
        if flat is None:
            flat = self._flat(B, span, rpp)
        if flat:
            # verifying every drafted slot costs nearly nothing more (memory-bound, or a short span
            # on a CPU): verify them all, without evaluating the predictor
            k = torch.where(draft.steps > 0, span, 0).to(torch.int64)
            eps = lenient_eps(ctx["eps"], ctx["budget_left"], k, draft.steps, draft.conditional)
            eps = torch.where(rows.temperature.to(dev) > 0, eps, torch.zeros_like(eps))
            rule, param = rules_from(draft, eps)
            return make_verify_decision(k, rule, param, rows)
        pred = self._predictor_on(dev)
        w = self.weights(ctx).to(dev)
        base = self.base_weights(ctx).to(dev).sum()                                   # the tokens every row emits
        temp = rows.temperature.to(dev)
        drafted = draft.steps > 0
        eps = lenient_eps(ctx["eps"], ctx["budget_left"], torch.full((B,), K, device=dev), draft.steps,
                          draft.conditional)
        eps = torch.where(temp > 0, eps, torch.zeros_like(eps))                     # [B]
        match = (draft.exact_rule == int(Rule.MATCH)) & (eps == 0)
        a = pred.survival(draft.confidence, draft.entropy, draft.margin, temp, rows.recent_accept.to(dev),
                          draft.steps, match, eps) * drafted[:, None]                 # [B, K]
        values = w[:, None] * torch.cummin(a, dim=1).values                           # [B, K]
        # rows whose features may depend on their own earlier draws: a per-row threshold fixed before drafting
        draft_ms = self.cost.draft_ms_at(rpp)
        cost_fn = lambda tokens: self.cost.step_ms(tokens.cpu()).to(dev) + draft_ms  # noqa: E731
        if max_s > 1 and bool(ctx["left_to_right"].any()):
            sensitive = (temp > 0) & (eps == 0) & (draft.exact_rule == int(Rule.REJECTION)) & (draft.steps > 1)
            lam = self._lambda(float(base), B).to(dev)
            k_sens = torch.where(sensitive, (values >= lam).sum(1), torch.zeros(B, dtype=torch.int64, device=dev))
            sens_gain = (values * (values >= lam) * sensitive[:, None]).sum()
            k_greedy, theta = greedy_prefix(values * (~sensitive)[:, None], base + sens_gain, B + k_sens.sum(),
                                            cost_fn, "argmax")
            k = torch.where(sensitive, k_sens, k_greedy).to(torch.int64)
        else:
            k, theta = greedy_prefix(values, base, B, cost_fn, "argmax")
        # λ for the next step: Θ_w at the optimum times the marginal ms of one more verified token
        tokens = float(B + k.sum())
        dms = (self.cost.step_ms_at(tokens + 8.0) - self.cost.step_ms_at(tokens)) / 8.0
        lam = theta.cpu().float() * max(dms, 0.0)
        if bool(torch.isfinite(lam)):  # a non-finite λ would keep every later plan from drafting
            self.threshold = lam
        eps = torch.where(k > 0, eps, torch.zeros_like(eps))
        rule, param = rules_from(draft, eps)
        return make_verify_decision(k, rule, param, rows)


def batch_bucket(batch: int) -> int:
    """The power-of-two bucket of a batch size: 1, 2, 4 (3–4), 8 (5–8), 16 ..."""
    return 1 << max(int(batch) - 1, 0).bit_length()


def verified_drafts(outcome) -> bool:
    """Whether some row verified drafts in the step of `outcome` (it took the drafting path): the
    engine's host answer where the outcome carries it (``any_verified``), else read from the tensor."""
    known = getattr(outcome, "any_verified", None)
    return bool((torch.as_tensor(outcome.verified) > 0).any()) if known is None else known


def planned_extra(gain: torch.Tensor, w_base: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[B] the extra tokens a plan expects of each row from its weighted gain ``gain`` [B]
    (``w_base`` [B] for the one token every step emits, ``w`` [B] per extra token; a row whose
    extra tokens weigh 0, in a closed batch, has none)."""
    return (gain - w_base) / w.clamp_min(1e-9)


def keeps_targets(ctx: dict, ms: torch.Tensor, tokens: torch.Tensor,
                  remaining: torch.Tensor | None = None, slack: float = 1.0, behind: bool = False) -> torch.Tensor:
    """[C] whether candidate step ``c`` (predicted ``ms`` [C], expected tokens per row ``tokens``
    [B, C], column 0 the plan) keeps every row that meets its TPOT target under the plan within
    ``slack`` times it (a headroom for what the prediction does not know: the prefills to come,
    the noise of step times). A row with ``elapsed`` ms and ``n`` tokens so far meets a target
    ``T`` after a step of ``t`` ms that brings it ``e`` tokens when both
      - now: ``elapsed + t ≤ T · (n + e)``, and
      - at the end (with ``remaining`` [B], the tokens it may still emit): ``elapsed + t +
        (remaining − e) · pace ≤ T · (n + remaining)``, finishing at the plan's step time
        plus the batch's stall per token so far (``Σ stall_ms / Σ n`` over the rows: time outside
        decode steps, other requests' prefills; 0 under the decode clock). The batch's rate, not
        the row's own: one prefill early in a row's life would read as a stall of hundreds of ms
        per token for the rest of it.
    A protected row (one that meets ``T`` = its target under the plan) must meet ``slack · T``
    under the candidate; with ``slack < 1`` a protected row already past ``slack · T`` under the
    plan rules out every widening step (the plan, column 0, stays the choice). Rows without a
    target do not constrain; rows already behind it under the plan do not either (their weight in
    the objective does), unless ``behind``: then such a row vetoes every candidate that lowers its
    own expected tokens per ms (``tokens / ms`` below the plan's), so drafting for others (or a
    draft of its own that is not predicted to pay) does not put it further behind."""
    target = ctx["tpot_ms"].cpu()[:, None]                                            # [B, 1] inf = none
    elapsed, count = ctx["elapsed_ms"].cpu()[:, None], ctx["tokens"].cpu()[:, None]   # [B, 1]
    finish = left = None
    if remaining is not None:
        left = remaining.cpu().float()[:, None]                                       # [B, 1]
        rate = ctx["stall_ms"].cpu().sum() / count.sum().clamp_min(1.0)               # [] stall ms per token
        pace = ms[0] + rate                                                           # [] ms per later token
        finish = elapsed + ms[None, :] + (left - tokens).clamp_min(0.0) * pace        # [B, C]

    def meets(T: torch.Tensor) -> torch.Tensor:                                        # [B, C]
        ok = elapsed + ms[None, :] <= T * (count + tokens)
        return ok if finish is None else ok & (finish <= T * (count + left))

    protected = meets(target)[:, :1]                                                  # [B, 1]
    keeps = ~(protected & ~meets(slack * target)).any(0)                              # [C]
    if behind:
        late = torch.isfinite(target) & ~protected                                    # [B, 1] behind under the plan
        rate = tokens / ms.clamp_min(1e-6)[None, :]                                   # [B, C] own tokens per ms
        keeps = keeps & ~(late & (rate < rate[:, :1] * (1.0 - 1e-6))).any(0)
    return keeps


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


def check_suffix_accept(table: dict | None, nested: bool = False) -> dict | None:
    """A fitted suffix acceptance table ``{"match": [m_0 < m_1 < ...], "accept": [c_0, c_1, ...],
    "first": [c₁_0, c₁_1, ...], "vote": [v_0 < v_1 < ...], "vote_scale": [s_0, s_1, ...],
    "sampled": {...}}`` checked (for match lengths >= m_i and < m_{i+1}: c₁_i the first drafted
    token's acceptance, c_i each later token's given the ones before it; without "first", c_i
    for every token: a geometric law; a token whose vote share is >= v_j and < v_{j+1} has its
    acceptance scaled by s_j, capped at 1; "sampled", optional: a table of the same form (without
    its own "sampled") for sampled rows, T > 0, the outer one then being for greedy rows:
    adapt/suffix_fit.py); None = the built-in ``m / (m + 3)``."""
    if table is None:
        return None
    where = "suffix_accept.sampled" if nested else "suffix_accept"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected an object")
    match, accept, first = table.get("match"), table.get("accept"), table.get("first")
    vote, scale = table.get("vote"), table.get("vote_scale")
    if not (isinstance(match, list) and isinstance(accept, list) and match and len(match) == len(accept)):
        raise ValueError(f"{where}: expected {{'match': [...], 'accept': [...]}} of equal, non-zero length")
    if first is not None and not (isinstance(first, list) and len(first) == len(match)):
        raise ValueError(f"{where}: 'first' must be a list as long as 'match'")
    if any(b <= a for a, b in zip(match, match[1:])) or not all(0.0 <= c <= 1.0 for c in accept + (first or [])):
        raise ValueError(f"{where}: match must increase and accept (first) lie in [0, 1]")
    if (vote is None) != (scale is None):
        raise ValueError(f"{where}: 'vote' and 'vote_scale' come together")
    if vote is not None and not (isinstance(vote, list) and isinstance(scale, list) and vote and len(vote) == len(scale)
                                 and all(b > a for a, b in zip(vote, vote[1:]))
                                 and all(0.0 <= x <= 1.0 for x in vote + scale)):
        raise ValueError(f"{where}: 'vote' must increase within [0, 1] and 'vote_scale' (in [0, 1]) be as long")
    if nested and table.get("sampled") is not None:
        raise ValueError(f"{where}: a sampled table has no 'sampled' table of its own")
    out = {"match": [int(m) for m in match], "accept": [float(c) for c in accept]}
    if first is not None:
        out["first"] = [float(c) for c in first]
    if vote is not None:
        out["vote"], out["vote_scale"] = [float(v) for v in vote], [float(x) for x in scale]
    if table.get("sampled") is not None:
        out["sampled"] = check_suffix_accept(table["sampled"], nested=True)
    return out


def suffix_accept_of(table: dict | None, match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] first drafted token's acceptance, [B] each later token's) of suffix drafts with match
    lengths ``match`` [B]: slot ``j`` of a draft is accepted with probability ``c₁ · c^(j−1)``."""
    m = match.float()
    if table is None:
        c = m / (m + 3.0)
        return c, c
    idx = (torch.bucketize(m, _floats(table["match"]), right=True) - 1).clamp(min=0)
    later = _floats(table["accept"])[idx]
    first = _floats(table["first"])[idx] if "first" in table else later
    return first, later


def suffix_slot_accept(table: dict | None, match: torch.Tensor, vote: torch.Tensor | None, Ks: int,
                       sampled: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Ks] each slot's acceptance given the slots before it were accepted, for suffix drafts
    with match lengths ``match`` [B] and vote shares ``vote`` [B, Ks] (or None): ``c₁`` for the
    first slot, ``c`` for the later ones (`suffix_accept_of`), times the table's ``vote_scale`` of
    each slot's share (when both the table and ``vote`` have them), capped at 1. Rows with
    ``sampled`` [B] (T > 0) read the table's ``"sampled"`` table where it has one."""
    cond = _slot_accept(table, match, vote, Ks)
    if table is None or table.get("sampled") is None or sampled is None or not bool(sampled.any()):
        return cond
    return torch.where(sampled[:, None], _slot_accept(table["sampled"], match, vote, Ks), cond)


def suffix_draft_accept(table: dict | None, match: torch.Tensor, vote: torch.Tensor | None, n: torch.Tensor,
                        sampled: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Ks] the probability that slot j of each suffix draft is accepted (its first j slots
    all are: the running product of `suffix_slot_accept`), 0 past the draft's length ``n`` [B];
    ``Ks = max(n)``. Row sums: the tokens a draft verified at full length is expected to win."""
    Ks = int(n.max())
    cond = suffix_slot_accept(table, match, vote, Ks, sampled)                         # [B, Ks] given the slots before
    return cond.cumprod(1) * (torch.arange(Ks)[None] < n[:, None])


def _slot_accept(table: dict | None, match: torch.Tensor, vote: torch.Tensor | None, Ks: int) -> torch.Tensor:
    """`suffix_slot_accept` by one table (its own ``"sampled"`` table not read)."""
    c1, c = suffix_accept_of(table, match)                                             # [B], [B]
    first = torch.arange(Ks)[None] == 0                                                # [1, Ks]
    cond = torch.where(first, c1[:, None], c[:, None])                                 # [B, Ks]
    if vote is None or table is None or "vote" not in table:
        return cond
    idx = (torch.bucketize(vote.float().contiguous(), _floats(table["vote"]), right=True) - 1).clamp(min=0)  # [B, Ks]
    return (cond * _floats(table["vote_scale"])[idx]).clamp(max=1.0)


def _floats(values: list[float]) -> torch.Tensor:
    """A table column as a float32 tensor, made once per distinct column (every step reads them)."""
    return _float_tensor(tuple(values))


@functools.lru_cache(maxsize=64)
def _float_tensor(values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)
