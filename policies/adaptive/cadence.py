"""Decision cadence (``hold_max``, ``hold_share``): holding a plain decision for a few steps.

Deciding costs host time every step (the plan, the suffix choice, and the engine's suffix
proposals for every row), which on a small target is a tenth of a ~3 ms step. Where a full
decision costs at least ``hold_share`` of one row's share of a plain step (``plain_ms / B``;
EMAs of both, measured) and it keeps every row plain (no diffusion, no suffix draft), the policy
*holds* that answer for the next ``h`` steps while the batch keeps the same requests: ``h`` = 1,
2, 4, … up to ``hold_max`` over consecutive plain decisions, back to deciding every step as soon
as one drafts. A row's share, not the whole step: deciding delays every row of the step, while
what it may catch (one row's copy) wins that row's tokens. On SmolLM2 on a 2-core CPU deciding
took ~1.5 ms of a ~55 ms 8-row step: 3 % of the step, 22 % of a row's share; holding there took
the policy from 0.91x to 0.95-0.96x autoregressive decoding at batch 8 (interleaved runs of
equal-length requests). At batch 1 with ~9 ms steps deciding takes ~0.5 ms, at the threshold:
about half the steps are held there, and never holding one row measured the same speed
(results/ab/smollm2/hold-min-rows/). While
holding it reads no suffix drafts (the engine skips proposing them) and answers without
computing anything. Requests leaving the batch keep the hold; requests joining it keep it too
where the batch has at least ``hold_joins_rows`` (8) rows (at 8 requests a join comes every few
steps and ended half the holds; at 2 and 4 requests holding through joins lost 1–3 %), else a
join ends it. A held step still tells the policy its outcome. A copy ends a hold, so the suffix
choice prices the plain plan without what holding saves (`saving`, ``hold_price``: on edit
prompts at 8 rows one-token copies lost in the rounds they ran, 0.908 / 0.956 of autoregressive
decoding against 1.000 / 1.007 with it; results/ab/smollm2/hold-price/).
"""

from __future__ import annotations


class Cadence:
    """The hold state: ``left`` held steps to come for the requests ``key``, ``run`` consecutive
    plain decisions, ``decide_ms`` the EMA of a full decision's host ms, ``held_steps`` counted,
    ``held_rate`` the EMA of whether a step was held (1) or decided (0)."""

    def __init__(self):
        self.key, self.left, self.run = frozenset(), 0, 0
        self.decide_ms: float | None = None
        self.held_steps = 0
        self.held_rate = 0.0

    @property
    def holding(self) -> bool:
        return self.left > 0

    def holds(self, rows, joins_rows: int | None) -> bool:
        """Whether this step keeps the held plain answer: a hold is on, and the batch holds no
        request the held decision did not see, or it has at least ``joins_rows`` rows."""
        if self.left <= 0:
            return False
        joins_held = joins_rows is not None and len(rows.request_ids) >= joins_rows
        return joins_held or self.key.issuperset(rows.request_ids)

    def held(self) -> None:
        """A step answered by the hold."""
        self.left -= 1
        self.held_steps += 1
        self.held_rate = 0.9 * self.held_rate + 0.1

    def broken(self) -> bool:
        """A step decided in full; True where it ends a hold (a request joined during it: the
        engine proposed no suffix drafts for this step)."""
        broke, self.left = self.left > 0, 0
        return broke

    def saving(self, s, B: int, plain_ms: float | None) -> float:
        """Host ms a plain decision saves a step by being held: the decision's EMA times the
        share of recent steps held (`held_rate`: where copies come often, holds are short and save
        little), where deciding is dear at ``B`` rows; 0 where it would not be held. A copy ends a
        hold, so with ``hold_price`` the suffix choice prices the plan's plain step without it."""
        if s.hold_max <= 0 or self.decide_ms is None or not self._dear(s, B, plain_ms):
            return 0.0
        return self.decide_ms * self.held_rate

    def _dear(self, s, B: int, plain_ms: float | None) -> bool:
        """Deciding is dear: it costs at least ``hold_share`` of one row's share of a plain step."""
        share = plain_ms / B if plain_ms is not None else None
        return s.hold_share == 0 or (share is not None and self.decide_ms >= s.hold_share * share)

    def decided(self, s, rows, plain: bool, ms: float, plain_ms: float | None, saw_all: bool) -> None:
        """After a full decision of ``ms`` host ms (``plain``: it keeps every row plain;
        ``saw_all``: made with every source in view): start or lengthen a hold where deciding is
        dear (``s``: the settings hold_max, hold_share)."""
        self.decide_ms = ms if self.decide_ms is None else 0.9 * self.decide_ms + 0.1 * ms
        self.held_rate *= 0.9
        # deciding costs every row of the step; what it may catch (a copy) is one row's tokens
        if plain and s.hold_max > 0 and saw_all and self._dear(s, len(rows.request_ids), plain_ms):
            # a plain decision made with every source in view: hold it for 1, 2, 4, ... steps
            self.run += 1
            self.left = min(s.hold_max, 1 << min(self.run - 1, 16))
            self.key = frozenset(rows.request_ids)
        elif not plain:
            self.run = 0
