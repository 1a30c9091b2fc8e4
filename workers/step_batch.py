"""Batch state: the requests the engine runs and the one object a decode step hands around.

Words:
- **request state** (`RequestState`): one request's tokens, committed length, counters and
  generator; `Engine.running[i]` owns **cache slot** i of the target and drafter caches.
- **step batch** (`StepBatch`): the running rows at the start of one decode step, built once per
  step, frozen: per-row tensors on the engine's device (lengths, anchors, sampling parameters,
  diffusion steps, exact rules) with their host copies, and the decision makers' view
  (`rows`, a `workers.decisions.RowState`). After the draft is chosen the step adds its
  **plan** (`StepPlan`: draft lengths, rules, the ragged layout of the verification batch), again
  frozen (`StepBatch.planned`). Drafting, verification, the decision makers, the commit and the
  traces read the same object; nothing re-derives the layout.
- **step result** (`StepResult`): what the step's one host read returned, as named fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kernels.layout import RaggedLayout
from kernels.rules import Rule
from workers.decisions import RECENT_NONE, RowState
from workers.decode_log import DecodeLog, source_name  # noqa: F401  (source_name: re-exported)
from workers.pins import NO_PINS, RowPins
from workers.request import DecodeKnobs, SamplingParams


def common_value(values: list[int]) -> int | None:
    """The value shared by all of `values`, or None if they differ."""
    first = values[0]
    return first if all(v == first for v in values) else None


@dataclass(eq=False)  # compared by identity
class RequestState:
    """One request in the engine (waiting or running)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    knobs: DecodeKnobs
    targets: object
    stop_ids: tuple[int, ...]
    generator: torch.Generator | None  # None: greedy (T = 0), draws nothing
    output: list[int] = field(default_factory=list)
    length: int = 0            # committed length L
    ctx_len: int = 0           # positions < ctx_len have drafter-context K/V; [ctx_len, L) are stashed
    passes: int = 0            # target forward passes that emitted tokens for this request
    accepted: int = 0
    verified: int = 0
    tvd: float = 0.0
    recent_accept: float = RECENT_NONE
    t_arrive: float = 0.0      # when it was added (perf_counter)
    t_start: float = 0.0
    t_first: float = 0.0       # when its first token (the prefill's) was emitted
    t_last: float = 0.0
    last_knobs: tuple = (0, 0, 0, int(Rule.GREEDY))  # source code, steps, draft_len, rule of the latest step
    apos: list[float] = field(default_factory=list)  # accept_per_position
    ema_before: float = RECENT_NONE  # recent_accept before the latest step (traces)
    suffix_index: object = None  # workers.suffix.TokenIndex over prompt + output
    suffix_draft: object = None  # this step's workers.suffix.SuffixDraft
    pins: RowPins = NO_PINS      # the knobs the caller pinned, as the engine applies them (workers/pins.py)
    log: DecodeLog = field(default_factory=DecodeLog)  # what each decode step did (`decode_stats`)


@dataclass(frozen=True)
class StepPlan:
    """What a decode step decided per row after drafting: `draft_len` (k verified), the `rule`
    each row verifies with and its parameters, on the device and as host lists, and the ragged
    `layout` of the verification batch (None when no row verifies a draft or every row is
    GREEDY: those run on the padded [B, k_max + 1] layout)."""

    draft_len: torch.Tensor      # [B] int64
    rule: torch.Tensor           # [B] int32
    param: torch.Tensor          # [B] float32
    param2: torch.Tensor         # [B] float32
    draft_len_host: list[int]
    rule_host: list[int]
    param_host: list[float]
    param2_host: list[float]
    layout: RaggedLayout | None = None

    @property
    def max_k(self) -> int:
        return max(self.draft_len_host)

    @property
    def all_greedy(self) -> bool:
        return all(r == int(Rule.GREEDY) for r in self.rule_host)

    @classmethod
    def no_drafts(cls, requests: list[RequestState]) -> "StepPlan":
        """The plan of a step in which no row drafts (host tensors): k = 0, each row's exact rule
        (GREEDY at T = 0, REJECTION otherwise) with parameters 0."""
        B = len(requests)
        rules = [int(Rule.REJECTION if r.params.temperature > 0 else Rule.GREEDY) for r in requests]
        zeros = torch.zeros(B)
        return cls(torch.zeros(B, dtype=torch.int64), torch.tensor(rules, dtype=torch.int32), zeros, zeros,
                   [0] * B, rules, [0.0] * B, [0.0] * B)


@dataclass(frozen=True)
class StepBatch:
    """The running rows of one decode step (see the module docstring). Tensors are [B] on the
    engine's device unless marked host (CPU tensors: what the decision makers and the plan read
    without a device sync); `*_host` are Python lists."""

    requests: tuple[RequestState, ...]  # requests[i] owns cache slot i
    rows: RowState                      # the decision makers' view (host tensors)
    lengths: torch.Tensor               # [B] int64 committed length L
    lengths_host: list[int]
    anchors: torch.Tensor               # [B] int64 last emitted token (sits at position L)
    temperature: torch.Tensor           # [B] float32
    top_k: torch.Tensor | None          # [B] int64, None when no sampled row restricts to top-k
    top_p: torch.Tensor | None          # [B] float32, None when no sampled row uses top-p
    source: torch.Tensor                # [B] int64 (host) draft source code (workers/draft_sources.py)
    source_host: list[int]
    steps: torch.Tensor                 # [B] int64 (host) s: diffusion passes of diffusion rows, 0 elsewhere
    steps_host: list[int]
    point_mass: torch.Tensor            # [B] bool (host): the row's draft is a point mass (exact rules only)
    left_to_right: torch.Tensor         # [B] bool commit order of the diffusion drafter
    conditional: torch.Tensor           # [B] bool (host): q are the proposal's true conditionals
    exact_rule: torch.Tensor            # [B] int32 (host) the row's exact rule (kernels.rules.exact_rules)
    lossless: torch.Tensor              # [B] bool (host)
    span: int = 0                       # block positions the drafter denoises this step (`DraftIntent.span`); 0 = its K
    plan: StepPlan | None = None

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def common_length(self) -> int | None:
        """The committed length shared by every row, or None."""
        return common_value(self.lengths_host)

    @property
    def diffusion_rows(self) -> list[int]:
        """Rows the diffusion drafter drafts for this step (s > 0)."""
        return [i for i, s in enumerate(self.steps_host) if s > 0]

    def planned(self, plan: StepPlan) -> "StepBatch":
        return dataclasses.replace(self, plan=plan)

    @classmethod
    def without_drafts(cls, requests: list[RequestState], rows: RowState) -> "StepBatch":
        """The host record of a step in which no row drafted (autoregressive decoding), as the
        commit and the traces read it: s = 0 and `StepPlan.no_drafts` (CPU tensors)."""
        B = len(requests)
        lengths = [r.length for r in requests]
        no = torch.zeros(B, dtype=torch.bool)
        plan = StepPlan.no_drafts(requests)
        zeros = torch.zeros(B, dtype=torch.int64)
        return cls(requests=tuple(requests), rows=rows, lengths=torch.tensor(lengths), lengths_host=lengths,
                   anchors=torch.tensor([r.output[-1] for r in requests]), temperature=rows.temperature, top_k=None,
                   top_p=None, source=zeros, source_host=[0] * B, steps=zeros, steps_host=[0] * B, point_mass=no,
                   left_to_right=no,
                   conditional=~no, exact_rule=plan.rule, lossless=~no, plan=plan)


def sampling_tensors(requests, device):
    """(temperature [B], top_k [B] or None, top_p [B] or None) on `device`; top-k / top-p are
    None unless a sampled row uses them."""
    temp = torch.tensor([float(r.params.temperature) for r in requests], device=device)
    top_k = top_p = None
    if any(r.params.top_k > 0 and r.params.temperature > 0 for r in requests):
        top_k = torch.tensor([r.params.top_k for r in requests], device=device)
    if any(r.params.top_p < 1.0 and r.params.temperature > 0 for r in requests):
        top_p = torch.tensor([float(r.params.top_p) for r in requests], device=device)
    return temp, top_k, top_p


@dataclass(frozen=True)
class StepResult:
    """What a decode step produced per row, read back in its one host sync: the `tokens` emitted,
    drafts `accepted`, `tvd` spent, `accept_per_position` (None when no draft was verified: the
    counters did not change) and, when tracing, `features` (confidence, entropy, margin: 3 K
    values)."""

    tokens: list[list[int]]
    accepted: list[int]
    tvd: list[float]
    accept_per_position: list[list[float]] | None
    features: list[list[float]]

    @classmethod
    def unpack(cls, host: list[list[float]], Tq: int, Kc: int, feature_width: int) -> "StepResult":
        """Parse the packed host rows of `workers.verification`: per row [tokens (Tq), accepted,
        emitted, tvd, (accept_per_position (Kc), positions verified if Kc), features]."""
        base = Tq + 3 + (Kc + 1 if Kc else 0)
        return cls(tokens=[[int(t) for t in row[: int(row[Tq + 1])]] for row in host],
                   accepted=[int(row[Tq]) for row in host], tvd=[row[Tq + 2] for row in host],
                   accept_per_position=[row[Tq + 3 : Tq + 3 + int(row[Tq + 3 + Kc])] for row in host] if Kc else None,
                   features=[row[base : base + feature_width] for row in host])
