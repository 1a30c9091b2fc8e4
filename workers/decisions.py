"""The decision interface between the engine and whoever chooses the knobs (contracts §5).

Every decode step the engine asks a `DecisionMaker` in two phases and then tells it what ran:
1. `before_draft(rows) -> DraftIntent`: per row, the **draft source** (`DraftIntent.source`: a
   code of workers/draft_sources.py: none, diffusion, suffix, ...) and the diffusion passes
   `steps` of diffusion rows; and the **span**: the most drafted tokens any diffusion row may
   verify this step, so the drafter denoises only that many positions of its block (a pass over
   `[anchor, MASK x span]` instead of `[anchor, MASK x K]`: on this CPU 2.6 ms instead of 4.0 at
   one row, 8.8 instead of 17.6 at eight, for span 4 of 16; 0 = the whole block).
   `rows.suffix_len / suffix_score / suffix_match` describe each row's suffix draft when the
   engine has a suffix drafter and the decision maker reads them (``reads_suffix = True``) or a
   row's knobs ask for suffix drafts;
2. `after_draft(rows, intent, draft) -> VerifyDecision`: after drafting, the draft length `k` to
   verify and the acceptance rule with its parameters, from features of the draft distributions
   only (never the sampled tokens: the choice must not anticipate the draw, or exactness breaks).
   Not asked on a step where no row drafts: there is nothing to verify;
3. `observe(record)`: the step's `workers.step_record.StepRecord` (rows, intent, plan, outcome,
   phase times).

Between 1 and 2 the engine applies the requests' pins (`DecodeKnobs.pinned`, workers/pins.py) to
the intent, drops sources a row has no draft from (an empty suffix draft), and sets the span it
really denoises (the whole block on an engine whose drafter programs have the block's shape:
`RowState.fixed_span`). `after_draft` and `observe` receive that **applied** intent, so what a
decision maker learns matches what ran. The engine never imports policies or the controller; it
is handed an object with these three methods and two declarations (`reads_draft_features`,
`reads_suffix`). `StaticDecisions` (the default) returns each request's own `DecodeKnobs`.

Exact rule per row (what `lossless` rows always get, see docs/engine.md):
- temperature 0: GREEDY;
- sampled, and the recorded draft probabilities are true conditionals (s = 1, or left-to-right
  commits): REJECTION;
- otherwise (most-confident-first commits with s > 1, or point-mass drafts such as suffix copies): MATCH.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kernels.rules import LENIENT_RULE, exact_rules  # noqa: F401  (exact_rules: re-exported)
from workers import draft_sources
from workers.draft_sources import DIFFUSION_CODE, NONE_CODE
from workers.request import DecodeKnobs

if TYPE_CHECKING:
    from workers.step_record import StepRecord
RECENT_NONE = -1.0  # the recent acceptance of a row that has not verified any draft yet


def next_recent_accept(prev: float, accepted: int, verified: int) -> float:
    """A row's *recent acceptance* after a pass that verified ``verified`` drafts and accepted the
    first ``accepted`` of them: an EMA (0.7 / 0.3) of the per-position acceptance estimate
    ``a / (a + 1)`` (``1`` when all ``k`` were accepted), the geometric estimate of the
    conditional acceptance ``c`` of a draft position, whatever draft length ``k`` was verified.
    ``prev`` is `RECENT_NONE` before the row's first verified draft; a pass without drafts
    leaves it unchanged."""
    if verified <= 0:
        return prev
    sample = 1.0 if accepted >= verified else accepted / (accepted + 1.0)
    return sample if prev < 0 else 0.7 * prev + 0.3 * sample


@dataclass(frozen=True)
class RowState:
    """The running rows at the start of a step (host-side CPU tensors `[B]`, lists of length B).

    position: committed sequence length L (prompt + generated - 1: the anchor is not cached yet);
    generated: tokens generated so far; recent_accept: per-position acceptance of the row's recent
    verified diffusion drafts (`next_recent_accept`; `RECENT_NONE` = none verified yet; suffix
    drafts do not move it: their acceptance is read from their match, and a failed copy says
    nothing about what the drafter would have drafted);
    tvd_spent: total variation spent so far; remaining: tokens the row may still emit;
    block_size: the widest draft the engine verifies (the drafter's K; the suffix drafter's cap
    without a drafter; 0 = no drafting at all).
    suffix_len / suffix_score / suffix_match / suffix_vote: the row's suffix draft this step
    (tokens, expected accepted tokens, match length, each token's vote share: the share of the
    draft's candidates that voted for it, 0 past the draft; workers/suffix.py), None when not
    computed.
    packed_verify: the engine's verification forward costs each row's own positions (anchor +
    drafts: `EngineConfig.pack`) rather than every row padded to the longest draft.
    decode_ms: wall ms since each row's first token, at the start of this step: what a client's
    time per output token counts (decode steps, and other requests' prefills between them);
    None where there is no wall clock (a trace replay).
    closed: a **closed batch**: no request waits and the engine's caller promised that none joins
    until these rows have all finished (`Engine.closed`: an offline batch). A row that finishes
    early then frees a slot nobody takes: the batch ends with its slowest row.
    fixed_span: the engine's drafter programs have the whole block's shape (a compiled engine):
    it denoises the whole block whatever `DraftIntent.span` asks, so a decision maker need not
    work one out."""

    request_ids: list[str]
    knobs: list[DecodeKnobs]
    targets: list[object]
    position: torch.Tensor       # [B] int64
    generated: torch.Tensor      # [B] int64
    temperature: torch.Tensor    # [B] float32
    recent_accept: torch.Tensor  # [B] float32
    tvd_spent: torch.Tensor      # [B] float32
    remaining: torch.Tensor      # [B] int64
    batch_size: int
    block_size: int
    has_drafter: bool = True                  # False: only suffix drafts (or none) are possible
    suffix_len: torch.Tensor | None = None    # [B] int64
    suffix_score: torch.Tensor | None = None  # [B] float32
    suffix_match: torch.Tensor | None = None  # [B] int64
    suffix_vote: torch.Tensor | None = None   # [B, W] float32, W >= the longest suffix draft
    packed_verify: bool = False               # the target verifies each row's own positions, not the padded batch
    decode_ms: torch.Tensor | None = None     # [B] float32 wall ms since the row's first token
    closed: bool = False                      # a closed batch: nothing waits, nothing will join
    fixed_span: bool = False                  # the drafter denoises its whole block whatever span is asked


@dataclass(frozen=True)
class DraftIntent:
    """What a decision maker asks of drafting before any draft exists (`before_draft`), and, as
    the engine applied it (pins, empty drafts, the span really denoised), what drafting did.

    source: each row's draft source code (workers/draft_sources.py: `NONE_CODE`,
    `DIFFUSION_CODE`, `SUFFIX_CODE`, ...); steps: the diffusion passes of diffusion rows (0
    elsewhere); span: the block positions the drafter denoises (0 = the whole block; in an
    applied intent, the positions it did denoise)."""

    source: torch.Tensor  # [B] int64 (host)
    steps: torch.Tensor   # [B] int64 (host)
    span: int = 0

    @classmethod
    def none(cls, batch: int) -> "DraftIntent":
        """No row drafts (autoregressive decoding)."""
        zeros = torch.zeros(batch, dtype=torch.int64)
        return cls(zeros, zeros)


@dataclass(frozen=True)
class DraftFeatures:
    """Features of this step's drafts. Rows that did not draft have zero features; point-mass
    rows (e.g. suffix copies) have, as confidence, each drafted token's probability under their
    source (a suffix token's vote share, workers/suffix.py; entropy and margin 0).
    confidence = max prob of q, entropy of q (nats), margin = top-1 minus top-2 prob of q, per
    drafted position: [B, K] on the engine's device; steps (diffusion passes, 0 on other rows),
    exact_rule (the engine's exact rule per row), conditional and source (each row's source code,
    the applied intent's; None: diffusion where steps > 0, no draft elsewhere): [B], known before
    drafting, host (CPU) tensors, so that a decision maker that reads only them (as
    `StaticDecisions` does) answers on the host and costs no device sync."""

    steps: torch.Tensor        # [B] int64 (host)
    confidence: torch.Tensor   # [B, K] float32
    entropy: torch.Tensor      # [B, K] float32
    margin: torch.Tensor       # [B, K] float32
    exact_rule: torch.Tensor   # [B] int32 (host)
    conditional: torch.Tensor  # [B] bool: q are true conditionals (REJECTION is exact) (host)
    source: torch.Tensor | None = None  # [B] int64 (host)

    def to_host(self) -> "DraftFeatures":
        """The same features on the CPU, read in one packed copy (one host sync on a GPU): a
        decision maker that decides on the host pays that one read instead of one per value it
        reads, and its CPU answer then costs the engine no further sync."""
        K = self.confidence.shape[1]
        packed = torch.cat([self.confidence, self.entropy, self.margin], 1).cpu()  # [B, 3K]
        return DraftFeatures(self.steps.cpu(), packed[:, :K], packed[:, K : 2 * K], packed[:, 2 * K :],
                             self.exact_rule.cpu(), self.conditional.cpu(),
                             None if self.source is None else self.source.cpu())


@dataclass(frozen=True)
class VerifyDecision:
    draft_len: torch.Tensor  # [B] int64
    rule: torch.Tensor       # [B] int32
    param: torch.Tensor      # [B] float32
    param2: torch.Tensor     # [B] float32


@dataclass(frozen=True)
class StepOutcome:
    """What a step did: accepted drafts, verified drafts (k), TVD added, per row; wall time of the
    step and the number of token positions in the target forward; ``any_verified``: whether some
    row verified drafts, as the host knows it (None: read it from ``verified``)."""

    accepted: torch.Tensor  # [B] int64
    verified: torch.Tensor  # [B] int64
    tvd: torch.Tensor       # [B] float32
    step_time: float
    num_tokens: int
    any_verified: bool | None = None


class DecisionMaker(Protocol):
    """What the engine asks each step (the module docstring). Two declarations, read once a step:
    ``reads_draft_features``: `after_draft` reads ``draft.confidence / entropy / margin`` (False:
    the engine skips computing them, a top-2 and an entropy over [B, K, V], unless it writes
    traces); ``reads_suffix``: `before_draft` reads the rows' suffix drafts (the engine then
    computes them for every row; else only for rows whose knobs ask for suffix drafts)."""

    reads_draft_features: bool
    reads_suffix: bool

    def before_draft(self, rows: RowState) -> DraftIntent: ...
    def after_draft(self, rows: RowState, intent: DraftIntent, draft: DraftFeatures) -> VerifyDecision: ...
    def observe(self, record: StepRecord) -> None: ...


class StaticDecisions:
    """Each request's own knobs, every step: source knobs.source ('none' where draft_len = 0, or
    diffusion in 0 steps),
    diffusion in knobs.steps passes, k = knobs.draft_len, span the longest draft_len of a
    diffusion row; lossless -> the exact rule; `tvd=E` -> EPS_TVD with budget E where the draft
    probabilities are true conditionals (its TVD report needs them), the exact rule otherwise.
    It never reads the draft features; it reads suffix drafts only where a row's knobs ask for
    them (the engine computes them for those rows anyway)."""

    reads_draft_features = False
    reads_suffix = False

    def before_draft(self, rows: RowState) -> DraftIntent:
        source, steps = [], []  # host lists: no tensor is read
        for kn in rows.knobs:
            code = draft_sources.by_name(kn.source).code if kn.draft_len > 0 else NONE_CODE
            if code == DIFFUSION_CODE and kn.steps <= 0:
                code = NONE_CODE
            source.append(code)
            steps.append(kn.steps if code == DIFFUSION_CODE else 0)
        span = 0 if rows.fixed_span else max((kn.draft_len for kn, s in zip(rows.knobs, steps) if s > 0), default=0)
        return DraftIntent(torch.tensor(source, dtype=torch.int64), torch.tensor(steps, dtype=torch.int64), span)

    def after_draft(self, rows: RowState, intent: DraftIntent, draft: DraftFeatures) -> VerifyDecision:
        dev = draft.steps.device  # the host: reads only host tensors, answers on the host
        k = torch.tensor([kn.draft_len for kn in rows.knobs], dtype=torch.int64, device=dev)
        eps = torch.tensor([kn.tvd_budget for kn in rows.knobs], dtype=torch.float32, device=dev)
        temp = rows.temperature.to(dev)
        lenient = (eps > 0) & (temp > 0) & draft.conditional
        rule = torch.where(lenient, int(LENIENT_RULE), draft.exact_rule).to(torch.int32)
        return VerifyDecision(draft_len=torch.where(intent.source.to(dev) != NONE_CODE, k, 0), rule=rule,
                              param=torch.where(lenient, eps, 0.0), param2=torch.zeros_like(eps))

    def observe(self, record: StepRecord) -> None:
        return None
