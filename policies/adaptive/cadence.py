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
equal-length requests), while at batch 1 (1 ms of a ~38 ms step) it decides every step. While
holding it reads no suffix drafts (the engine skips proposing them) and answers without
computing anything. Requests leaving the batch keep the hold; requests joining it keep it too
where the batch has at least ``hold_joins_rows`` (8) rows (at 8 requests a join comes every few
steps and ended half the holds; at 2 and 4 requests holding through joins lost 1–3 %), else a
join ends it. A held step still tells the policy its outcome.
"""

from __future__ import annotations


class Cadence:
    """The hold state: ``left`` held steps to come for the requests ``key``, ``run`` consecutive
    plain decisions, ``decide_ms`` the EMA of a full decision's host ms, ``held_steps`` counted."""

    def __init__(self):
        self.key, self.left, self.run = frozenset(), 0, 0
        self.decide_ms: float | None = None
        self.held_steps = 0

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

    def broken(self) -> bool:
        """A step decided in full; True where it ends a hold (a request joined during it: the
        engine proposed no suffix drafts for this step)."""
        broke, self.left = self.left > 0, 0
        return broke

    def decided(self, s, rows, plain: bool, ms: float, plain_ms: float | None, saw_all: bool) -> None:
        """After a full decision of ``ms`` host ms (``plain``: it keeps every row plain;
        ``saw_all``: made with every source in view): start or lengthen a hold where deciding is
        dear (``s``: the settings hold_max, hold_share)."""
        self.decide_ms = ms if self.decide_ms is None else 0.9 * self.decide_ms + 0.1 * ms
        # deciding costs every row of the step; what it may catch (a copy) is one row's tokens
        share = plain_ms / len(rows.request_ids) if plain_ms is not None else None
        dear = s.hold_share == 0 or (share is not None and self.decide_ms >= s.hold_share * share)
        if plain and s.hold_max > 0 and saw_all and dear:
            # a plain decision made with every source in view: hold it for 1, 2, 4, ... steps
            self.run += 1
            self.left = min(s.hold_max, 1 << min(self.run - 1, 16))
            self.key = frozenset(rows.request_ids)
        elif not plain:
            self.run = 0
