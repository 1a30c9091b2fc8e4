"""The suffix drafter: free drafts copied from text the request has already seen.

Words used here:
- **match**: the longest suffix of a request's sequence (prompt + output so far) that also occurs
  earlier, in the request's own sequence or in recent outputs of other requests; its length is
  the **match length**. Every earlier occurrence of it is a **candidate**.
- **suffix draft**: the tokens that followed the candidates, chosen position by position by
  majority vote among the candidates still agreeing with the draft so far. Each drafted token
  carries the share of those candidates that voted for it (its *conditional probability*), and
  the draft stops where the running product of these falls below `min_prob`, or at
  ``match_len * max_factor + offset`` tokens (SuffixDecoding / ArcticInference's cap).
- **score**: the sum of the running probabilities, SuffixDecoding's estimate of the expected
  number of accepted tokens.

A suffix draft is a point mass (q = 1 at the drafted token), so it is verified exactly with
GREEDY at temperature 0 and MATCH when sampling (accepted with probability p(x); see
docs/engine.md): its tokens never change the output distribution.

Data structure: an n-gram index (`TokenIndex`: the `KEY` tokens before each position -> the
positions, most recent last) per request, plus one bounded global index over the outputs of
finished requests (`RecentOutputs`, first in first out). Appending a token costs one dict update;
a draft costs one lookup and a few small numpy operations over at most `max_candidates`
candidates (`adapt bench suffix` measures both).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

KEY = 2               # tokens in an index key: the shortest match that can propose
MAX_MATCH = 32        # match lengths are counted up to this
SEPARATOR = -1        # between outputs in the global index: no match crosses it


@dataclass(frozen=True)
class SuffixConfig:
    """max_draft: tokens per draft at most; min_prob: stop the draft where the running
    probability falls below it; max_factor / offset: draft cap = match_len * max_factor + offset;
    max_candidates: most recent occurrences voted on; global_tokens: capacity of the index of
    recent outputs (0 = off)."""

    max_draft: int = 16
    min_prob: float = 0.1
    max_factor: float = 1.0
    offset: int = 0
    max_candidates: int = 16
    global_tokens: int = 1 << 16


@dataclass(frozen=True)
class SuffixDraft:
    """A row's proposal: tokens [k] and their conditional probabilities [k] (k may be 0);
    match_len, candidates and where it came from ('request' | 'global' | 'none')."""

    tokens: np.ndarray
    probs: np.ndarray
    match_len: int
    candidates: int
    origin: str

    @property
    def score(self) -> float:
        """Expected accepted tokens: the sum of running probabilities."""
        return float(np.cumprod(self.probs).sum()) if len(self.probs) else 0.0


EMPTY = SuffixDraft(np.zeros(0, np.int64), np.zeros(0, np.float32), 0, 0, "none")


class TokenIndex:
    """A growing token sequence with an index from each `KEY`-token window to the positions that
    follow it (the continuation positions, most recent last, at most `max_candidates` kept)."""

    def __init__(self, max_candidates: int = 16, capacity: int = 256):
        self.buf = np.empty(max(capacity, 16), dtype=np.int64)
        self.size = 0
        self.keys: dict[bytes, deque] = {}
        self.max_candidates = max_candidates

    def extend(self, tokens) -> None:
        new = np.asarray(tokens, dtype=np.int64)
        old, end = self.size, self.size + len(new)
        if end > len(self.buf):
            grown = np.empty(max(end, 2 * len(self.buf)), dtype=np.int64)
            grown[:old] = self.buf[:old]
            self.buf = grown
        self.buf[old:end] = new
        self.size = end
        keys, buf = self.keys, self.buf
        for p in range(max(old, KEY), end):  # position p continues the window buf[p - KEY : p]
            k = buf[p - KEY : p].tobytes()
            hits = keys.get(k)
            if hits is None:
                keys[k] = hits = deque(maxlen=self.max_candidates)
            hits.append(p)

    def tail(self, n: int) -> np.ndarray:
        return self.buf[max(0, self.size - n) : self.size]

    def candidates(self, tail: np.ndarray) -> tuple[np.ndarray, int]:
        """Continuation positions of the longest earlier match of `tail` (a sequence's last
        tokens, newest last; possibly from another sequence) and the match length (0: none)."""
        if len(tail) < KEY:
            return np.zeros(0, np.int64), 0
        hits = self.keys.get(tail[-KEY:].tobytes())
        if not hits:
            return np.zeros(0, np.int64), 0
        cand = np.fromiter(hits, dtype=np.int64, count=len(hits))          # [C]
        extra = min(len(tail), MAX_MATCH) - KEY
        if extra > 0:  # extend each match backwards, token by token, up to MAX_MATCH
            j = np.arange(extra)
            idx = cand[:, None] - KEY - 1 - j[None]                          # [C, extra]
            want = tail[::-1][KEY : KEY + extra]                             # [extra]
            eq = (self.buf[np.maximum(idx, 0)] == want[None]) & (idx >= 0)
            lengths = KEY + np.cumprod(eq, axis=1).sum(1)
        else:
            lengths = np.full(len(cand), KEY)
        best = int(lengths.max())
        return cand[lengths == best], best

    def continuations(self, cand: np.ndarray, k: int) -> np.ndarray:
        """[C, k] the tokens after each candidate position (SEPARATOR past the end)."""
        idx = cand[:, None] + np.arange(k)[None]
        out = self.buf[np.minimum(idx, self.size - 1)]
        return np.where(idx < self.size, out, SEPARATOR)


class RecentOutputs:
    """The global index: outputs of finished requests, separated, the oldest dropped first once
    more than `capacity` tokens are held (rebuilt from the newest half, amortised O(1) a token)."""

    def __init__(self, capacity: int, max_candidates: int = 16):
        self.capacity = capacity
        self.max_candidates = max_candidates
        self.outputs: deque[np.ndarray] = deque()
        self.held = 0
        self.index = TokenIndex(max_candidates)

    def add(self, tokens) -> None:
        seq = np.asarray(list(tokens) + [SEPARATOR], dtype=np.int64)
        if self.capacity <= 0 or len(seq) < KEY + 2:
            return
        seq = seq[-self.capacity :]
        self.outputs.append(seq)
        self.held += len(seq)
        if self.held > self.capacity:
            while self.held > self.capacity // 2:
                self.held -= len(self.outputs.popleft())
            self.index = TokenIndex(self.max_candidates, self.held)
            for s in self.outputs:
                self.index.extend(s)
        else:
            self.index.extend(seq)


def vote(conts: np.ndarray, limit: int, min_prob: float) -> tuple[np.ndarray, np.ndarray]:
    """Draft tokens and conditional probabilities from candidate continuations conts [C, k]:
    at each position the majority token among candidates agreeing so far (ties: the most
    recent candidate, the last row), until the running probability drops below `min_prob`, a
    continuation ends (SEPARATOR), or `limit` tokens."""
    C = len(conts)
    if C == 1:  # one candidate: its continuation, probability 1, up to its end
        row = conts[0, :limit]
        stop = np.flatnonzero(row == SEPARATOR)
        n = int(stop[0]) if len(stop) else len(row)
        return row[:n].copy(), np.ones(n, np.float32)
    alive = np.ones(C, dtype=bool)
    tokens, probs, run = [], [], 1.0
    for j in range(min(limit, conts.shape[1])):
        col = conts[alive, j]
        vals, counts = np.unique(col, return_counts=True)
        top = counts.max()
        winners = vals[counts == top]
        tok = winners[0] if len(winners) == 1 else col[::-1][np.isin(col[::-1], winners)][0]
        p = top / len(col)
        if tok == SEPARATOR or run * p < min_prob:
            break
        run *= p
        tokens.append(tok)
        probs.append(p)
        alive &= conts[:, j] == tok
    return np.asarray(tokens, np.int64), np.asarray(probs, np.float32)


class SuffixDrafter:
    """Suffix drafts for the engine's requests: one `TokenIndex` per request (prompt + output) and
    the shared `RecentOutputs`. Host-side and cheap; no model."""

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.recent = RecentOutputs(self.config.global_tokens, self.config.max_candidates)

    def new_index(self, prompt) -> TokenIndex:
        index = TokenIndex(self.config.max_candidates, 2 * len(prompt) + 64)
        index.extend(prompt)
        return index

    def forget_outputs(self) -> None:
        """Drop every remembered output of finished requests (e.g. between benchmark runs, so
        that a repeated prompt cannot copy its own earlier answer)."""
        self.recent = RecentOutputs(self.config.global_tokens, self.config.max_candidates)

    def finish(self, output) -> None:
        """Remember a finished request's output for other requests' drafts."""
        self.recent.add(output)

    def propose(self, index: TokenIndex, limit: int | None = None) -> SuffixDraft:
        """The draft for the sequence held by `index`: the longer of its own match and the recent
        outputs' match (its own on a tie), at most `limit` tokens."""
        cfg = self.config
        limit = cfg.max_draft if limit is None else min(limit, cfg.max_draft)
        if limit <= 0:
            return EMPTY
        tail = index.tail(MAX_MATCH)
        best = None
        for origin, where in (("request", index), ("global", self.recent.index)):
            cand, m = where.candidates(tail)
            if m and (best is None or m > best[2]):
                best = (where, cand, m, origin)
        if best is None:
            return EMPTY
        where, cand, m, origin = best
        cap = min(limit, int(m * cfg.max_factor + cfg.offset))
        if cap <= 0:
            return EMPTY
        cand = cand[-cfg.max_candidates :]
        tokens, probs = vote(where.continuations(cand, cap), cap, cfg.min_prob)
        return SuffixDraft(tokens, probs, m, len(cand), origin)
