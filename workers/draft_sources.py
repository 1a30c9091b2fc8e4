"""Draft sources: where a row's draft comes from in a decode step, and the registry that names them.

A decision maker names one source per row (`workers.decisions.DraftIntent.source`, a [B] int64
host tensor of source **codes**); the engine asks each source named in a step to `propose` the
drafts of its rows and verifies the drafts of all rows together, in one target forward.

- ``none`` (code 0): no draft; the row decodes one token autoregressively;
- ``diffusion`` (code 1): the block-diffusion drafter denoises ``[anchor, MASK x span]`` in the
  row's ``steps`` passes (workers/drafting.py), recording the distribution q of each token;
- ``suffix`` (code 2): the row copies the continuation of its longest match in text already seen
  (workers/suffix.py).

A **point-mass** source's drafts carry no distribution (q = 1 at the drafted token), so the
engine verifies them with exact rules only (GREEDY at T = 0, MATCH when sampling:
`kernels.rules.enforce_rules`), whatever the decision maker answers: such a source cannot change
the output distribution, only how many tokens a step emits.

**Adding a source**: a module with a class that has the `DraftSource` attributes and methods
(`PointMassSource` holds the defaults a copy-like source needs), and one `register(...)` line at
the end of this module, or a `register` call by whoever uses it (tests/test_draft_sources.py
registers a toy source from the test). Requests then name it (`DecodeKnobs.source`, a pin) and
decision makers answer its code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from workers.decisions import RowState
    from workers.step_batch import RequestState, StepBatch

NONE_CODE = 0       # no draft
DIFFUSION_CODE = 1  # the block-diffusion drafter
SUFFIX_CODE = 2     # the suffix drafter's copy


@dataclass(frozen=True)
class Proposal:
    """The drafts a source proposed for ``n`` rows, padded to a width ``W`` (at most the engine's
    `width`): target token ids, each token's confidence (its probability under the source: a
    diffusion draft's max of q, a suffix token's vote share; 0 past a row's draft), and the drafted
    tokens per row (the most the row may verify). Diffusion proposals also carry q over the draft
    vocabulary with entropy and margin (None for point masses)."""

    tokens: torch.Tensor                # [n, W] int64
    confidence: torch.Tensor            # [n, W] float32
    lengths: torch.Tensor               # [n] int64 (host)
    q: torch.Tensor | None = None       # [n, W, Vd] float32
    entropy: torch.Tensor | None = None  # [n, W] float32
    margin: torch.Tensor | None = None   # [n, W] float32


class DraftSource(Protocol):
    """One kind of draft. ``engine`` is the `workers.engine.Engine` asking (its `width`,
    `block`, `suffix`, `drafting` ...)."""

    name: str          # what requests and reports call it (`DecodeKnobs.source`, `decode_stats`)
    code: int          # its code in `DraftIntent.source` (>= 0, unique)
    point_mass: bool   # its drafts are point masses: exact rules only
    needs: str         # what an engine needs for it, for the error of a request naming it where it cannot draft

    def width(self, engine) -> int:
        """The longest draft it proposes on ``engine`` (0: it cannot draft there)."""
        ...

    def facts(self, engine, requests: list[RequestState]) -> dict:
        """`RowState` fields it adds before the decision, for every running row (`{}`: none)."""
        ...

    def ready(self, engine, rows: RowState) -> torch.Tensor:
        """[B] bool (host): rows that have a draft from it this step (a row without one, e.g. an
        empty suffix draft, drafts nothing)."""
        ...

    def propose(self, engine, batch: StepBatch, idx: list[int], with_features: bool) -> Proposal:
        """The drafts of rows ``idx`` of ``batch`` (host ints; the rows whose applied intent names
        it). ``with_features``: a reader wants confidence, entropy and margin (else zeros may do)."""
        ...


class PointMassSource:
    """Defaults of a source whose drafts are point masses and which adds no facts: a subclass sets
    `name` and `code` and implements `draft(engine, request, limit) -> list[int]` (at most
    ``limit`` target ids; confidence 1 each)."""

    point_mass = True
    needs = "nothing"

    def width(self, engine) -> int:
        return engine.width

    def facts(self, engine, requests) -> dict:
        return {}

    def ready(self, engine, rows) -> torch.Tensor:
        return torch.ones(rows.batch_size, dtype=torch.bool)

    def draft(self, engine, request, limit: int) -> list[int]:
        raise NotImplementedError

    def propose(self, engine, batch, idx, with_features) -> Proposal:
        W = self.width(engine)
        tokens = torch.zeros(len(idx), W, dtype=torch.int64)
        lengths = torch.zeros(len(idx), dtype=torch.int64)
        for j, i in enumerate(idx):  # host lists of at most W tokens per row
            drafted = self.draft(engine, batch.requests[i], W)[:W]
            tokens[j, : len(drafted)] = torch.tensor(drafted, dtype=torch.int64)
            lengths[j] = len(drafted)
        confidence = (torch.arange(W)[None] < lengths[:, None]).float()
        return Proposal(tokens, confidence, lengths)


class NoDraft:
    """``none``: the row drafts nothing."""

    name, code, point_mass, needs = "none", NONE_CODE, False, "nothing"

    def width(self, engine) -> int:
        return 0

    def facts(self, engine, requests) -> dict:
        return {}

    def ready(self, engine, rows) -> torch.Tensor:
        return torch.zeros(rows.batch_size, dtype=torch.bool)

    def propose(self, engine, batch, idx, with_features) -> Proposal:
        n = len(idx)
        return Proposal(torch.zeros(n, 0, dtype=torch.int64), torch.zeros(n, 0), torch.zeros(n, dtype=torch.int64))


class DiffusionSource:
    """``diffusion``: the block-diffusion drafter's denoising (workers/drafting.py
    `DrafterContext.draft`) over the first `StepBatch.span` positions of its block, in each row's
    ``steps`` passes; its drafts carry q."""

    name, code, point_mass, needs = "diffusion", DIFFUSION_CODE, False, "a drafter"

    def width(self, engine) -> int:
        return engine.block if engine.drafter is not None else 0

    def facts(self, engine, requests) -> dict:
        return {}

    def ready(self, engine, rows) -> torch.Tensor:
        return torch.full((rows.batch_size,), engine.drafter is not None, dtype=torch.bool)

    def propose(self, engine, batch, idx, with_features) -> Proposal:
        from workers.sampling import draft_features

        context, span = engine.drafting, batch.span or engine.block
        context.flush(batch.requests, idx)
        tokens, q = context.draft(batch, idx, span)                                   # [n, span], [n, span, Vd]
        if with_features:
            confidence, entropy, margin = draft_features(q)
        else:  # nobody reads them: zeros, as for rows that do not draft
            confidence = entropy = margin = torch.zeros(len(idx), span, device=tokens.device)
        return Proposal(tokens, confidence, torch.full((len(idx),), span, dtype=torch.int64), q, entropy, margin)


class SuffixSource:
    """``suffix``: each row's suffix draft (workers/suffix.py), computed for every row before the
    decision where a reader wants its facts (`suffix_len`, `suffix_score`, `suffix_match`,
    `suffix_vote`); its confidence is each token's vote share."""

    name, code, point_mass, needs = "suffix", SUFFIX_CODE, True, "the engine's suffix drafter (EngineConfig.suffix)"

    def width(self, engine) -> int:
        return engine.width if engine.suffix is not None else 0

    def facts(self, engine, requests) -> dict:
        for r in requests:
            r.suffix_draft = engine.suffix.propose(r.suffix_index)
        tokens, vote, lengths = self._padded(requests, engine.width)
        return dict(suffix_len=lengths, suffix_score=torch.tensor([r.suffix_draft.score for r in requests]),
                    suffix_match=torch.tensor([r.suffix_draft.match_len for r in requests]), suffix_vote=vote)

    def ready(self, engine, rows) -> torch.Tensor:
        if rows.suffix_len is None:  # not computed this step: no row copies
            return torch.zeros(rows.batch_size, dtype=torch.bool)
        return rows.suffix_len > 0

    def propose(self, engine, batch, idx, with_features) -> Proposal:
        tokens, vote, lengths = self._padded([batch.requests[i] for i in idx], engine.width)
        return Proposal(tokens, vote, lengths)

    @staticmethod
    def _padded(requests, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The requests' suffix drafts (`RequestState.suffix_draft`) padded: tokens [n, width]
        int64, vote shares [n, width] float32 and lengths [n] int64 (CPU)."""
        import numpy as np

        n = len(requests)
        tok, conf = np.zeros((n, width), np.int64), np.zeros((n, width), np.float32)
        lengths = np.zeros(n, np.int64)
        for i, req in enumerate(requests):
            d = req.suffix_draft
            tok[i, : len(d.tokens)], conf[i, : len(d.probs)], lengths[i] = d.tokens, d.probs, len(d.tokens)
        return torch.from_numpy(tok), torch.from_numpy(conf), torch.from_numpy(lengths)


# -- the registry ---------------------------------------------------------------------------------
_BY_NAME: dict[str, DraftSource] = {}
_BY_CODE: dict[int, DraftSource] = {}


def register(source: DraftSource) -> DraftSource:
    """Add ``source``; its name and code must be new (a ValueError names the clash)."""
    if source.name in _BY_NAME or source.code in _BY_CODE:
        raise ValueError(f"draft source {source.name!r} (code {source.code}): name or code already registered")
    if not isinstance(source.code, int) or source.code < 0:
        raise ValueError(f"draft source {source.name!r}: code must be an int >= 0, got {source.code!r}")
    _BY_NAME[source.name], _BY_CODE[source.code] = source, source
    return source


def unregister(name: str) -> None:
    """Remove the source called ``name`` (the three built-in ones stay)."""
    if name in ("none", "diffusion", "suffix"):
        raise ValueError(f"draft source {name!r} is built in")
    source = _BY_NAME.pop(name)
    del _BY_CODE[source.code]


def by_name(name: str) -> DraftSource:
    if name not in _BY_NAME:
        raise ValueError(f"unknown draft source {name!r} (one of {', '.join(_BY_NAME)})")
    return _BY_NAME[name]


def by_code(code: int) -> DraftSource:
    return _BY_CODE[code]


def codes() -> tuple[int, ...]:
    """The registered sources' codes, in registration order."""
    return tuple(_BY_CODE)


def names() -> tuple[str, ...]:
    """The registered sources' names, in registration order."""
    return tuple(_BY_NAME)


def point_mass(codes: list[int]) -> torch.Tensor:
    """[B] bool (host): whether each row's source (``codes``, host ints) drafts point masses."""
    return torch.tensor([_BY_CODE[c].point_mass for c in codes], dtype=torch.bool)


register(NoDraft())
register(DiffusionSource())
register(SuffixSource())
