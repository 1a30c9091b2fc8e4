"""Online corrections of what the policy predicts, each learned from what steps did: `observe()`
takes a step's evidence, the other methods answer queries.

- `SuffixAcceptance`: accepted over table-predicted tokens of the suffix drafts taken.
- `DiffusionAcceptance`: accepted over prior-predicted extra tokens of the plan's diffusion
  drafts, per temperature class and step count.
- `StepCosts`: what steps took beyond the cost tables (residuals per kind of step and batch
  bucket, the drafting path's fixed extra, the suffix choice's cost ratio), and the measured
  plain step.

Each is kept because an interleaved A/B measured it helping on some workload and load (the
measurement is in its docstring). The acceptance corrections learn only from rows whose draft was
the policy's choice: rows a request pinned are left out (`chosen_only`).
"""

from __future__ import annotations

import math

import torch

from policies.common import STALE_STEPS

SUFFIX_DECAY = 0.98   # per drafting step: the recalibration forgets over ~50 such steps
SUFFIX_PRIOR = 8.0    # tokens at ratio 1 before any suffix draft is seen
SUFFIX_IDLE_DECAY = 0.995  # per step without suffix drafts: a low ratio fades (half-life ~140 steps)
DIFFUSION_DECAY = 0.98  # per step with diffusion drafts: the plan's recalibration forgets over ~50 of them
DIFFUSION_PRIOR = 8.0   # tokens at ratio 1 before any diffusion draft is seen
DIFFUSION_IDLE_DECAY = 0.995  # per step without diffusion drafts: the evidence fades back to ratio 1


def batch_bucket(batch: int) -> int:
    """The power-of-two bucket of a batch size: 1, 2, 4 (3–4), 8 (5–8), 16 ..."""
    return 1 << max(int(batch) - 1, 0).bit_length()


def context_bucket(length: int) -> int:
    """The power-of-two bucket of a batch's longest context: 512 (up to 512 tokens), 1024, 2048 ..."""
    return max(512, 1 << max(int(length) - 1, 0).bit_length())


def verified_drafts(outcome) -> bool:
    """Whether some row verified drafts in the step of `outcome` (it took the drafting path): the
    engine's host answer where the outcome carries it (``any_verified``), else read from the tensor."""
    known = getattr(outcome, "any_verified", None)
    return bool((torch.as_tensor(outcome.verified) > 0).any()) if known is None else known


def chosen_only(suffix_expect: torch.Tensor | None, diffusion_expect: tuple | None, pinned: torch.Tensor):
    """A step's expectations ([B] suffix rows' predicted tokens; ([B] diffusion rows' predicted
    extra tokens, [B] grid index)) with the rows in ``pinned`` [B] bool set to 0, so that
    `SuffixAcceptance` and `DiffusionAcceptance` skip them: a pinned row's draft was its
    request's choice, not the policy's, and its outcome says nothing of what the policy predicted."""
    if (suffix_expect is None and diffusion_expect is None) or not bool(pinned.any()):
        return suffix_expect, diffusion_expect
    if suffix_expect is not None and len(suffix_expect) == len(pinned):
        suffix_expect = torch.where(pinned, 0.0, suffix_expect)
    if diffusion_expect is not None and len(diffusion_expect[0]) == len(pinned):
        diffusion_expect = (torch.where(pinned, 0.0, diffusion_expect[0]), diffusion_expect[1])
    return suffix_expect, diffusion_expect


class SuffixAcceptance:
    """Accepted over table-predicted tokens of the suffix drafts taken so far (sums decayed by
    `SUFFIX_DECAY` per drafting step, with a prior of `SUFFIX_PRIOR` tokens at ratio 1), clipped
    to [0.25, 2]. Steps without suffix drafts decay the sums too (`SUFFIX_IDLE_DECAY`), so a
    ratio that stopped all drafting returns towards 1 and drafts are retried on new evidence.
    The table is fitted on one set of prompts; on others a copy may run on less (or more) than
    it says. Measured on SmolLM2's edit workload at batch 1, the static table's drafts won fewer
    tokens than predicted and cost more than plain steps saved; the ratio scales every slot's
    acceptance, so the choice prices drafts at what they win here."""

    def __init__(self):
        self.won, self.predicted, self.drafts = 0.0, 0.0, 0

    def ratio(self) -> float:
        r = (self.won + SUFFIX_PRIOR) / (self.predicted + SUFFIX_PRIOR)
        return min(max(r, 0.25), 2.0)

    def observe(self, expect: torch.Tensor | None, accepted) -> None:
        """A step's suffix rows: ``expect`` [B] their table-predicted accepted tokens (0: no
        suffix draft; None: none this step), ``accepted`` [B] what each row won."""
        B = len(accepted)
        taken = None if expect is None or B != len(expect) else expect > 0
        if taken is None or not bool(taken.any()):  # forget slowly: the ratio drifts back to 1, so drafts get retried
            self.won *= SUFFIX_IDLE_DECAY
            self.predicted *= SUFFIX_IDLE_DECAY
            return
        won = torch.as_tensor(accepted).cpu().float()                                 # [B]
        self.won = SUFFIX_DECAY * self.won + float(won[taken].sum())
        self.predicted = SUFFIX_DECAY * self.predicted + float(expect[taken].sum())
        self.drafts += int(taken.sum())


class DiffusionAcceptance:
    """[2, S] (greedy rows, sampled rows) × (each step count of the grid): tokens the diffusion
    drafts taken so far won over the extra tokens the plan's prior predicted for them (sums
    decayed by `DIFFUSION_DECAY` per step with such drafts, `DIFFUSION_IDLE_DECAY` per step
    without, with a prior of `DIFFUSION_PRIOR` tokens at ratio 1), clipped to [0.25, 2]. The plan
    scales the prior's survival curves by it. The prior is fitted on traces of one drafter and
    workload, drafting every row with the whole block; measured live on SmolLM2's mixed workload
    at one request, greedy drafts of two denoising steps won 0.72 extra tokens where the plan
    predicted 1.00, one step 0.95 where it predicted 0.80, so without the ratio the plan paid
    for a second drafter pass on most greedy steps.

    The sums are flat lists of 2 · S host floats (cell ``class · S + level``): a step updates one
    or a few cells, which costs a dozen small tensor operations and no arithmetic worth one."""

    def __init__(self):
        self.won: list[float] | None = None
        self.predicted: list[float] | None = None
        self.drafts = 0

    def sums(self, S: int) -> tuple[list[float], list[float]]:
        """(won, predicted), made (zeros) at first use and again when the grid's size changed."""
        if self.won is None or len(self.won) != 2 * S:
            self.won, self.predicted = [0.0] * (2 * S), [0.0] * (2 * S)
        return self.won, self.predicted

    def ratio(self, S: int) -> torch.Tensor:
        won, predicted = (torch.tensor(x, dtype=torch.float64).view(2, -1) for x in self.sums(S))
        return ((won + DIFFUSION_PRIOR) / (predicted + DIFFUSION_PRIOR)).clamp(0.25, 2.0)

    def observe(self, S: int, found, accepted, temperature) -> None:
        """``found``: ([B] plan-predicted extra tokens per diffusion row, 0 for others, [B] grid
        index) or None; ``accepted`` [B] what each row won; ``temperature`` [B]. A cell without
        such drafts this step lets its evidence fade."""
        won_sums, predicted_sums = self.sums(S)
        B = len(accepted)
        expect, level = found if found is not None else (None, None)
        cells = {}  # flat (class, step) cell -> [tokens won, tokens predicted] this step
        if expect is not None and B == len(expect):
            for e, lv, a, t in zip(expect.tolist(), level.tolist(), torch.as_tensor(accepted).tolist(),
                                   temperature.tolist()):
                if e > 0 and math.isfinite(e):  # the row verified a diffusion draft the plan predicted
                    cell = cells.setdefault((t > 0) * S + min(lv, S - 1), [0.0, 0.0])
                    cell[0] += a
                    cell[1] += e
                    self.drafts += 1
        for c in range(len(won_sums)):
            w, p = cells.get(c, (0.0, 0.0))
            decay = DIFFUSION_DECAY if c in cells else DIFFUSION_IDLE_DECAY
            won_sums[c] = decay * won_sums[c] + w
            predicted_sums[c] = decay * predicted_sums[c] + p


class StepCosts:
    """What steps took beyond the cost tables, learned online.

    - ``step_residual``: EMAs of measured − predicted step ms per kind of step ("plain": no
      drafts; "diffusion": some row verified a diffusion draft; "suffix": only suffix drafts;
      "draft": either) and batch-size bucket (`batch_bucket`): {(kind, bucket): ms}.
    - ``plain_ms``: EMA of a plain step's measured ms (the tables miss what grows with rows and
      context: attention).
    - ``suffix_cost_ratio``: measured / predicted ms of steps the suffix choice widened ("wide")
      and of steps that kept the plan ("plan"); the tables miss what grows with context length
      and rows (measured on SmolLM2 with 400–800-token edit prompts: widened 8-row steps took
      ~1.35x the table's time), so the choice scales its predictions by them.

    The residuals and ``plain_ms`` are kept per **context bucket** (`context_bucket` of the
    batch's longest row; `use_context` switches): the tables are profiled over short contexts,
    and what a step takes beyond them grows with the context (attention over the cache). With one
    set for every context, ~1,800-token documents to summarise taught residuals (drafting steps
    ~15 ms over the tables, plain ones ~4 ms, in a probe) that then priced diffusion drafts for
    the chat requests after them; per bucket, chat in that mix measured 1.146x (`--workload
    longdoc-chat`, docs/benchmarks.md). The cost tables' own online correction (`CostModel.observe`)
    is one for every context: a copy per bucket measured no gain (0.990x on the documents, 0.999x
    on chat; results/ab/smollm2/longdoc-tables-context/)."""

    def __init__(self):
        self.step_residual: dict[tuple[str, int], float] = {}
        self.recent: dict[tuple[str, int], list[float]] = {}  # key -> its last 3 raw residuals
        self.seen: dict[tuple[str, int], int] = {}  # key -> `observed` when last updated (or halved)
        self.plain_ms: float | None = None
        self.context = context_bucket(0)  # the context bucket the four above belong to
        self._by_context: dict[int, tuple] = {}  # the other buckets' (step_residual, recent, seen, plain_ms)
        self.observed = 0  # steps observed
        self.batch = 1  # rows of the latest step observed
        self.suffix_cost_ratio = {"wide": 1.0, "plan": 1.0}
        # per (plan | wide, batch bucket): [steps, Σ predicted ms, Σ measured ms] of suffix choices
        self.suffix_calibration: dict[tuple[str, int], list[float]] = {}
        self._source_of = None  # (outcome, its `step_source`) of the latest step asked about

    def use_context(self, length: int) -> None:
        """Price and learn in the bucket of a batch whose longest row holds ``length`` tokens."""
        bucket = context_bucket(length)
        if bucket == self.context:
            return
        self._by_context[self.context] = (self.step_residual, self.recent, self.seen, self.plain_ms)
        self.step_residual, self.recent, self.seen, self.plain_ms = self._by_context.pop(bucket, ({}, {}, {}, None))
        self.context = bucket

    def plain_step_ms(self, B: int, cost) -> float:
        """A plain step of ``B`` rows: as measured (`plain_ms`, while the latest step had ``B``
        rows), else the cost table's."""
        return float(self.plain_ms if self.plain_ms is not None and self.batch == B else cost.step_ms_at(float(B)))

    def draft_overhead_at(self, batch: int, source: str, credit: bool, scales: bool, cost) -> float:
        """The fixed extra ms of a step of `batch` rows that verifies drafts of ``source`` over
        one that verifies none, beyond what the cost model predicts for both (decisions,
        features, rule resolution, attention over the drafted positions, the acceptance path):
        the difference of the drafting and plain residual EMAs in the batch's bucket, else in the
        nearest bucket that saw both, times the ratio of the two buckets where that one is
        smaller (``scales``, `overhead_scales`: measured, the first drafting steps of 31 rows,
        priced from 4-row steps, took 1.3–1.5x their prediction, 207 ms for 136 predicted); 0
        until some bucket did (so a source not tried yet is tried). Per batch size, because it
        grows with the batch: on SmolLM2 on a 2-core CPU one row verifying 2 drafts added ~1 ms
        to a 1-row step and ~45–80 ms to an 8-row one, which the verify table, indexed by
        positions only, does not see. One estimate over every drafting step ("draft") prices
        both sources: one per source measured worse live at 2 and 8 requests (at 8 rows the
        combined estimate, which diffusion steps make dear, kept copies from widening the batch;
        docs/benchmarks.md).

        A **credit** (``credit``, `draft_credit`): where drafting steps ran *under* the tables by
        more than plain steps did, diffusion plans get the difference back as a negative extra,
        at most one drafter pass of the batch. A start-up profile that overprices drafting
        (measured: diffusion steps 12 ms under the tables, drafted on 0.5–44 % of steps) is then
        corrected within a few drafting steps instead of the tables' slow online correction. The
        tables themselves always learn the measured time (`table_ms` takes no credit), so the
        residual, and the credit with it, fades as they catch up. Suffix steps get none."""
        res = self.step_residual
        key = "draft"
        both = [b for (kind, b) in res if kind == key and ("plain", b) in res]
        if not both:
            return 0.0
        bucket = batch_bucket(batch)
        b = min(both, key=lambda x: (abs(x.bit_length() - bucket.bit_length()), x))
        extra = res[(key, b)] - res[("plain", b)]
        if extra >= 0:
            return (bucket / b if scales and b < bucket else 1.0) * extra
        if not credit or source != "diffusion":
            return 0.0
        return max(extra, -cost.draft_ms_at([batch]))

    def step_source(self, outcome, steps) -> str:
        """What kind of step ``outcome`` was: "plain" (no drafts verified), "suffix" (only suffix
        drafts: the decision ``steps`` had no diffusion row) or "diffusion"."""
        known = self._source_of
        if known is not None and known[0] is outcome:  # asked twice per step (`table_ms`, `observe`)
            return known[1]
        if not verified_drafts(outcome):
            source = "plain"
        else:
            source = "suffix" if steps is not None and not bool((steps > 0).any()) else "diffusion"
        self._source_of = (outcome, source)
        return source

    def observe(self, outcome, measured: float, predicted: float | None, source: str) -> None:
        """A step: its measured ms, the cost tables' prediction before they learned from it
        (None: not predicted) and its kind (`step_source`)."""
        if measured > 0 and not verified_drafts(outcome):
            self.plain_ms = measured if self.plain_ms is None else 0.9 * self.plain_ms + 0.1 * measured
        self.batch = len(outcome.accepted)
        self.observed += 1
        if predicted is not None and measured > 0:
            bucket = batch_bucket(self.batch)
            for kind in (source,) if source == "plain" else (source, "draft"):  # "draft": every drafting step
                self._learn_residual((kind, bucket), measured - predicted)
            self._halve_stale_penalties(bucket)

    def observe_choice(self, pred: tuple, measured: float) -> None:
        """Correct the suffix choice's cost by what its step took: ``pred`` = (table ms, widened?,
        fixed drafting ms charged, predicted ms) of the choice made."""
        chosen_ms, wide, fixed_ms, predicted_ms = pred
        if chosen_ms > 0 and measured > 0:
            key = "wide" if wide else "plan"
            cal = self.suffix_calibration.setdefault((key, batch_bucket(self.batch)), [0, 0.0, 0.0])
            cal[0], cal[1], cal[2] = cal[0] + 1, cal[1] + predicted_ms, cal[2] + measured
            # the ratio corrects what the fixed drafting cost, charged separately, does not
            # explain (else that cost is counted twice: once scaled into the ratio, once added)
            r = min(max((measured - fixed_ms) / chosen_ms, 0.25), 4.0)
            self.suffix_cost_ratio[key] = 0.8 * self.suffix_cost_ratio[key] + 0.2 * r

    def _learn_residual(self, key: tuple[str, int], r: float) -> None:
        """Move ``key``'s residual EMA toward the median of its last three raw residuals (the
        first estimate: the median of the first three), so that one stalled step (a page fault,
        a noisy neighbour: hundreds of ms) teaches nothing, while a real extra cost, which every
        step of the kind pays, is learned: the drafting path's extra cost may be several times
        the table's prediction at 8 rows, so bounding the residual by the prediction, as the
        tables do, would not serve here."""
        recent = self.recent.setdefault(key, [])
        recent.append(float(r))
        del recent[:-3]
        self.seen[key] = self.observed
        if len(recent) < 3:
            return
        m = sorted(recent)[1]
        prev = self.step_residual.get(key)
        self.step_residual[key] = m if prev is None else 0.9 * prev + 0.1 * m

    def _halve_stale_penalties(self, bucket: int) -> None:
        """Halve each drafting kind's residual excess over the plain steps' in ``bucket`` (a *stale
        penalty*) that no step of its kind has measured for `STALE_STEPS` (128) steps; again after
        as many more. A penalty is only ever measured on steps of its kind, so one learned in a
        slow spell of the machine would otherwise price that kind out for good."""
        res, seen = self.step_residual, self.seen
        plain = res.get(("plain", bucket))
        if plain is None:
            return
        for kind in ("diffusion", "suffix", "draft"):
            key = (kind, bucket)
            if res.get(key, plain) > plain and self.observed - seen.get(key, 0) >= STALE_STEPS:
                res[key] = plain + 0.5 * (res[key] - plain)
                seen[key] = self.observed
