"""Helpers every policy shares: exact rule choice, quality budgets, SLA progress per request.

Words used here:
- *exact rule* of a row: GREEDY at temperature 0; REJECTION when the draft probabilities q are the
  proposal's true conditionals (one diffusion step, or left-to-right commits); MATCH otherwise
  (confidence-ordered multi-step drafts), which is exact for any drafter (docs/controller.md).
- *leniency* ε of a row: the per-token TVD the ε-TVD rule may spend on it this step; 0 for
  lossless rows, at most the request's ``tvd=E`` and never more than its total budget left.
- *lateness* of a request: its measured time per output token divided by its TPOT target
  (> 1 means behind target); 0 when it has no latency target.

Request targets arrive opaquely in ``RowState.targets`` (an `adapt.targets.RequestTargets` or
None); this module reads them by attribute so that `policies` does not import `adapt`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Steps after which an online estimate that no measurement has touched is *stale*: a rise it
# learned is then halved, and again after as many more steps (the adaptive policy's residual
# EMAs; `adapt.cost_model.Table.relax_stale` uses the same horizon). Estimates are moved only by
# steps that visit them, so a rise learned in a slow spell on drafting steps would otherwise
# price drafting out for good. Here, the lower floor, so that `policies` need not import `adapt`.
STALE_STEPS = 128


@dataclass(frozen=True)
class RowInfo:
    """What a policy needs from one request's targets and knobs, read once per request."""

    eps: float                 # per-token TVD budget (0 = lossless)
    budget_total: float        # total TVD budget (inf = none)
    tpot_ms: float             # TPOT target (inf = none)
    priority: int
    left_to_right: bool        # the drafter commits left to right (q is the true conditional)


def row_info(knobs, targets) -> RowInfo:
    """Merge a request's static knobs and its targets; the stricter quality wins (the engine
    enforces exact rules whenever the knobs say lossless)."""
    budgets = []
    if knobs is not None:
        budgets.append(float(getattr(knobs, "tvd_budget", 0.0) or 0.0))
    budget, tpot, priority = float("inf"), float("inf"), 0
    if targets is not None:
        budgets.append(float(getattr(getattr(targets, "quality", None), "eps", 0.0) or 0.0))
        total = getattr(targets, "tvd_budget_total", None)
        budget = float(total) if total is not None else float("inf")
        t = getattr(targets, "effective_tpot_ms", None)
        tpot = float(t) if t is not None else float("inf")
        priority = int(getattr(targets, "priority", 0) or 0)
    eps = min(budgets) if budgets else 0.0
    order = getattr(knobs, "commit_order", "confidence") if knobs is not None else "confidence"
    return RowInfo(eps=eps, budget_total=budget, tpot_ms=tpot, priority=priority,
                   left_to_right=order == "left-to-right")


class RequestBook:
    """Per-request memory of a policy: targets read once, decode time and tokens so far, and the
    steps since the request last verified diffusion drafts (*idle* steps).

    ``observe`` adds each step's time to every row in it and the row's emitted tokens; the
    lateness of a request is ``(elapsed / tokens) / tpot_target``. With ``wall_clock`` (default),
    where the rows carry their wall time since their first token (`RowState.decode_ms`, the live
    engine), elapsed and tokens are those of the client's TPOT instead: wall time, which counts the
    other requests' prefills between decode steps (at 16 requests on the mixed workload
    prefills were 28-42 % of the wall time, which the sum of decode steps never saw).
    While the batch keeps the same requests in the same order (most steps), everything stays in
    tensors and a step costs a few tensor ops; when the batch changes, the per-request values move
    through dictionaries. Requests not seen for ``forget_after`` steps are dropped.
    """

    def __init__(self, forget_after: int = 256, wall_clock: bool = True):
        self.wall_clock = wall_clock
        self.info: dict[str, RowInfo] = {}
        self.elapsed_ms: dict[str, float] = {}
        self.tokens: dict[str, float] = {}
        self.idle_steps: dict[str, float] = {}
        self.last_seen: dict[str, int] = {}
        self.tick = 0
        self.forget_after = forget_after
        self.key: tuple = ()
        self.static: dict[str, torch.Tensor] = {}
        self.lenient = self.targeted = False
        self.elapsed = torch.zeros(0)
        self.count = torch.zeros(0)
        self.idle = torch.zeros(0)

    def _flush(self) -> None:
        """Write the running tensors of the current batch back to the dictionaries."""
        if self.key:
            for rid, e, n, i in zip(self.key, self.elapsed.tolist(), self.count.tolist(), self.idle.tolist()):
                self.elapsed_ms[rid], self.tokens[rid], self.idle_steps[rid] = e, n, i
                self.last_seen[rid] = self.tick

    def _load(self, rows) -> None:
        key = tuple(rows.request_ids)
        if key == self.key:
            return
        self._flush()
        infos = []
        for i, rid in enumerate(key):
            info = self.info.get(rid)
            if info is None:
                info = self.info[rid] = row_info(rows.knobs[i], rows.targets[i])
            infos.append(info)
        self.static = {
            "eps": torch.tensor([i.eps for i in infos], dtype=torch.float32),
            "total": torch.tensor([i.budget_total for i in infos], dtype=torch.float32),
            "tpot_ms": torch.tensor([i.tpot_ms for i in infos], dtype=torch.float32),
            "priority": torch.tensor([i.priority for i in infos], dtype=torch.float32),
            "left_to_right": torch.tensor([i.left_to_right for i in infos], dtype=torch.bool),
        }
        # whether any row may be lenient at all (an ε > 0 and T > 0): most batches are lossless
        # or greedy, and their verify decisions then need no leniency arithmetic (`step_leniency`)
        self.lenient = bool(((self.static["eps"] > 0) & (rows.temperature.cpu() > 0)).any())
        self.targeted = bool(torch.isfinite(self.static["tpot_ms"]).any())  # some row has a TPOT target
        self.elapsed = torch.tensor([self.elapsed_ms.get(r, 0.0) for r in key], dtype=torch.float32)
        self.count = torch.tensor([self.tokens.get(r, 0.0) for r in key], dtype=torch.float32)
        self.idle = torch.tensor([self.idle_steps.get(r, 0.0) for r in key], dtype=torch.float32)
        self.key = key
        self._forget()

    def _forget(self) -> None:
        if len(self.info) > 4 * max(len(self.key), 64):
            live = set(self.key)
            stale = [r for r in self.info if r not in live and self.tick - self.last_seen.get(r, 0) > self.forget_after]
            for r in stale:
                for d in (self.info, self.elapsed_ms, self.tokens, self.idle_steps, self.last_seen):
                    d.pop(r, None)

    def tensors(self, rows, device) -> dict[str, torch.Tensor]:
        """[B] tensors: eps, budget_left, tpot_ms, priority, left_to_right, lateness, idle,
        elapsed_ms and tokens (each row's decode time and tokens so far: wall time since its first
        token and tokens after it with ``wall_clock`` where the rows carry `decode_ms`), stall_ms
        (wall time outside the decode steps it took part in; 0 without the wall clock); and
        host bools ``lenient`` (whether any row has an ε > 0 at T > 0) and ``targeted`` (whether
        any row has a TPOT target)."""
        self._load(rows)
        st = self.static
        spent = torch.as_tensor(rows.tvd_spent, dtype=torch.float32).cpu()
        wall = getattr(rows, "decode_ms", None)
        if self.wall_clock and wall is not None:  # as the client measures: wall time, tokens after the first
            elapsed, count = wall.float().cpu(), (rows.generated.cpu() - 1).clamp_min(0).float()
            stall = (elapsed - self.elapsed).clamp_min(0.0)  # time outside the decode steps it took part in
        else:
            elapsed, count, stall = self.elapsed, self.count, torch.zeros_like(self.elapsed)
        measured = elapsed / count.clamp_min(1.0)                                      # [B] finite, >= 0
        lateness = measured / st["tpot_ms"]  # 0 where there is no target (tpot_ms = inf)
        out = {"eps": st["eps"], "budget_left": (st["total"] - spent).clamp_min(0.0), "tpot_ms": st["tpot_ms"],
               "priority": st["priority"], "left_to_right": st["left_to_right"], "lateness": lateness,
               "idle": self.idle, "elapsed_ms": elapsed, "tokens": count, "stall_ms": stall}
        if device is not None and torch.device(device).type != "cpu":
            out = {k: v.to(device) for k, v in out.items()}
        out["lenient"], out["targeted"] = self.lenient, self.targeted
        return out

    def observe(self, rows, emitted: torch.Tensor, step_ms: float, verified: torch.Tensor | None = None) -> None:
        """emitted: [B] tokens each row received this step; verified: [B] diffusion drafts it
        verified (a row that verified none is idle one more step)."""
        self.tick += 1
        self._load(rows)
        self.elapsed += step_ms
        self.count += emitted.float()
        if verified is not None:
            self.idle = torch.where(verified > 0, torch.zeros_like(self.idle), self.idle + 1.0)

    def observe_plain(self, rows, step_ms: float) -> None:
        """`observe` of a step in which no row verified drafts: each row emitted one token and is
        idle one more step (three tensor operations)."""
        self.tick += 1
        self._load(rows)
        self.elapsed += step_ms
        self.count += 1.0
        self.idle += 1.0


def step_leniency(ctx: dict, k: torch.Tensor, draft, temperature: torch.Tensor) -> torch.Tensor | None:
    """[B] each row's leniency this step (`lenient_eps`; 0 at T = 0) for draft lengths ``k`` [B], or
    None where no row of the batch may be lenient (``ctx["lenient"]`` False: every request is
    lossless or greedy), which needs no tensor work."""
    if not ctx.get("lenient", True):
        return None
    eps = lenient_eps(ctx["eps"], ctx["budget_left"], k, draft.steps, draft.conditional)
    return torch.where(temperature.to(eps.device) > 0, eps, torch.zeros_like(eps))


def lenient_eps(eps: torch.Tensor, budget_left: torch.Tensor, draft_len: torch.Tensor, steps: torch.Tensor,
                left_to_right: torch.Tensor) -> torch.Tensor:
    """[B] leniency this step: the row's ε, capped so that ε · k never exceeds the total budget left,
    and 0 where q is not the true conditional (the ε-TVD rule's TVD guarantee needs it)."""
    cap = budget_left / draft_len.clamp_min(1).to(budget_left.dtype)
    e = torch.minimum(eps, cap)
    ok = ((steps <= 1) | left_to_right) & (steps > 0) & (draft_len > 0)
    return torch.where(ok, e, torch.zeros_like(e)).clamp_min(0.0)
