"""Step-time cost model: how long one engine step takes for a given batch decision.

An engine step (docs/contracts.md §4) is: the drafter runs ``max_r s_r`` denoising *passes* (pass
``ℓ`` covers the rows with ``s_r ≥ ℓ``, each a block of ``K + 1`` tokens), then one target forward
verifies ``Σ_r (k_r + 1)`` tokens. So

    step_ms ≈ overhead_ms + verify_ms(num_tokens) + Σ_ℓ draft_pass_ms(rows with s ≥ ℓ)

``verify_ms`` and ``draft_pass_ms`` are tables with linear interpolation (as DSpark's SPS(B) table:
flat while memory-bound, then linear once compute-bound), filled one of three ways:

- `CostModel.profile` times callables on a worker at start-up (the engine passes its own
  target / drafter forwards, see `adapt.controller.profile_engine`),
- `CostModel.fit_traces` reads the timings logged in engine traces,
- `CostModel.observe` corrects the tables online from each measured step (an exponential moving
  average: a drafting step moves the draft table's points around its rows; a plain step scales
  the overhead and both tables by one speed factor).

All evaluation methods accept tensors and run as tensor code (no per-row Python).
"""

from __future__ import annotations

import bisect
import functools
import time
from typing import Callable, Sequence

import numpy as np
import torch

DEFAULT_TOKEN_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_ROW_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# token counts a start-up profile times the target forward at: every count up to 8, then coarser.
# A compiled forward's cost is not linear between powers of two at few tokens: SmolLM2's package on
# a 2-core CPU (one row, ms) took 13.8, 14.4, 14.0, 14.3, 14.9, 15.3, 17.6, 18.7 for 1 .. 8
# tokens (the matmuls turn compute-bound past 6), which a table through 1, 2, 4, 8 priced at up to
# 1.2 ms (8 %) over its cost at 5 and 6: the drafts a policy verifies there.
PROFILE_TOKEN_GRID = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64, 128, 256, 512, 1024)
# A *bounded residual*: what one measured step teaches the tables, measured − predicted capped at
# ± this multiple of the prediction (a step counts as at most twice what was predicted). A stall
# (a page fault, a noisy neighbour) then moves a table point by at most `rate` of a step instead
# of `rate` of the whole stall: unbounded, one 600 ms stall of a drafting step would raise the
# draft table by 30 ms and price drafting out, and a source priced out is never measured again to
# correct it. A real change of cost still moves the tables, each step by up to `rate`
# times the bound, and the bound grows with the prediction as it learns.
RESIDUAL_BOUND = 1.0
# Steps after which an online estimate that no measurement has touched is *stale*: a table point's
# rise over its value as built (profiled or loaded) is then halved, and again after as many more
# steps (`Table.relax_stale`); defined with the policies that share it (`policies.common`).
from policies.common import STALE_STEPS  # noqa: E402


class Table:
    """A piecewise-linear function ``y(x)`` through points ``xs`` (increasing), linear beyond the ends.

    The points live in plain Python lists (``_xs``, ``_ys``): the online correction moves two of
    them every step (`nudge`) and the scalar path (`at`) reads them, both without tensor ops; the
    tensor path (``__call__``) reads per-segment slopes and intercepts rebuilt, in one tensor, only
    after the points moved. (Points held as tensors cost ~10 small tensor ops a step: each nudge
    made new ones and the next evaluation re-derived its caches; live on SmolLM2
    `CostModel.observe` takes 40 µs a call with lists against 53 µs with tensors.)"""

    def __init__(self, xs: Sequence[float], ys: Sequence[float], name: str = "table"):
        xs_t = torch.tensor(list(xs), dtype=torch.float64)
        ys_t = torch.tensor(list(ys), dtype=torch.float64)
        if xs_t.dim() != 1 or xs_t.numel() < 2 or xs_t.shape != ys_t.shape:
            raise ValueError(f"{name}: need at least two (x, y) points of equal length")
        if not (torch.isfinite(xs_t).all() and torch.isfinite(ys_t).all()):
            raise ValueError(f"{name}: points must be finite")
        if not (xs_t[1:] > xs_t[:-1]).all():
            raise ValueError(f"{name}: x values must increase")
        if (ys_t < 0).any():
            raise ValueError(f"{name}: times must be non-negative")
        self.name = name
        self._xs, self._ys = xs_t.tolist(), ys_t.tolist()
        self._ref = list(self._ys)  # the points as built: what a stale rise relaxes toward
        self._seen = [0] * len(self._ys)  # per point: the caller's clock when a measurement last moved it
        self._version = 0

    @property
    def xs(self) -> torch.Tensor:
        """[n] float64 x values."""
        return torch.tensor(self._xs, dtype=torch.float64)

    @property
    def ys(self) -> torch.Tensor:
        """[n] float64 y values (ms)."""
        return torch.tensor(self._ys, dtype=torch.float64)

    def __call__(self, x: torch.Tensor | float) -> torch.Tensor:
        x_t = torch.as_tensor(x)
        if not x_t.is_floating_point():
            x_t = x_t.float()
        xs, slope, icpt = self._cached(x_t.device, x_t.dtype)
        i = (torch.searchsorted(xs, x_t.contiguous()) - 1).clamp(0, xs.numel() - 2)
        return (icpt[i] + slope[i] * x_t).clamp_min(0.0)

    def at(self, x: float) -> float:
        """Scalar evaluation in plain Python (no tensor ops: the per-step fast path)."""
        xs, ys = self._xs, self._ys
        i = min(max(bisect.bisect_left(xs, x) - 1, 0), len(xs) - 2)
        y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
        return y if y > 0.0 else 0.0

    def _cached(self, device, dtype):
        """Per-segment slope and intercept on ``device`` (rebuilt after `nudge`)."""
        key = (str(device), dtype, self._version)
        if getattr(self, "_cache_key", None) != key:
            xs, ys = self._xs, self._ys
            slope = [(ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) for j in range(len(xs) - 1)]
            icpt = [ys[j] - slope[j] * xs[j] for j in range(len(xs) - 1)]
            packed = torch.tensor([xs, slope + [0.0], icpt + [0.0]], dtype=torch.float64).to(device, dtype)
            self._cache = (packed[0], packed[1, :-1], packed[2, :-1])
            self._cache_key = key
        return self._cache

    def weights(self, x: float) -> tuple[int, int, float]:
        """The two bracketing indices and the weight of the upper one, for online updates."""
        xs = self._xs
        i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return i - 1, i, min(max(w, 0.0), 1.0)

    def nudge(self, x: float, residual: float, rate: float, now: int = 0) -> None:
        """Move the two points around ``x`` toward a measurement (taken at the caller's clock
        ``now``); the table stays non-decreasing (a correction at one size never makes a larger
        size cheaper than a smaller one)."""
        lo, hi, w = self.weights(x)
        ys = self._ys
        ys[lo] = max(0.0, ys[lo] + rate * (1 - w) * residual)
        ys[hi] = max(0.0, ys[hi] + rate * w * residual)
        if w < 1.0:
            self._seen[lo] = now
        if w > 0.0:
            self._seen[hi] = now
        for j in range(hi + 1, len(ys)):
            ys[j] = max(ys[j], ys[j - 1])
        for j in range(lo - 1, -1, -1):
            ys[j] = min(ys[j], ys[j + 1])
        self._version += 1

    def relax_stale(self, now: int, stale: int = STALE_STEPS) -> None:
        """Halve the rise over its value as built of every point that no measurement has moved
        for ``stale`` ticks of the caller's clock (its clock restarts then, so the next halving
        comes ``stale`` later); the table stays non-decreasing. See `STALE_STEPS`."""
        ys, ref, seen = self._ys, self._ref, self._seen
        moved = False
        for j in range(len(ys)):
            if ys[j] > ref[j] and now - seen[j] >= stale:
                ys[j] = ref[j] + 0.5 * (ys[j] - ref[j])
                seen[j] = now
                moved = True
        if moved:
            for j in range(1, len(ys)):
                ys[j] = max(ys[j], ys[j - 1])
            self._version += 1

    def scale(self, factor: float) -> None:
        """Multiply every point, and the points as built, by ``factor``: a change of the machine's
        speed that moves every size's cost alike (the table's shape, what one size costs against
        another, is kept; a stale rise still relaxes toward the scaled value as built)."""
        self._ys = [y * factor for y in self._ys]
        self._ref = [y * factor for y in self._ref]
        self._version += 1

    def to_dict(self) -> dict:
        return {"x": [float(v) for v in self._xs], "ms": [round(float(v), 6) for v in self._ys]}

    @classmethod
    def from_dict(cls, data: dict, name: str) -> "Table":
        try:
            return cls(data["x"], data["ms"], name)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{name}: expected {{'x': [...], 'ms': [...]}} ({exc})") from None


def _monotone(times: Sequence[float]) -> np.ndarray:
    """Timings on an increasing grid made non-decreasing by a running minimum from the right: a
    hiccup (page faults, another process) at one small size cannot inflate every size above it,
    as a running maximum from the left would."""
    return np.minimum.accumulate(np.asarray(times, dtype=np.float64)[::-1])[::-1]


def profile_token_grid(top: float) -> list[int]:
    """`PROFILE_TOKEN_GRID` up to ``top`` tokens (at least 2): the verify table of an engine whose
    target forwards take at most ``top`` positions (beyond the grid the table extrapolates)."""
    return [g for g in PROFILE_TOKEN_GRID if g <= max(top, 2)]


def bounded_residual(measured: float, predicted: float, bound: float = RESIDUAL_BOUND) -> float:
    """``measured − predicted`` capped at ``± bound · predicted`` (predictions under 1 ms count as
    1 ms, so a table that starts near 0 still learns); see `RESIDUAL_BOUND`."""
    cap = bound * max(float(predicted), 1.0)
    return min(max(float(measured) - float(predicted), -cap), cap)


def sweep_medians(calls: Sequence[Callable[[], None]], repeats: int, shuffle_seed: int | None = 0,
                  sync: Callable[[], None] | None = None) -> np.ndarray:
    """[len(calls)] the median ms of each call. Every call runs once to warm up, then all are
    timed in ``repeats`` *sweeps*, each sweep timing every call once: a machine whose speed drifts
    (another process, a noisy neighbour) slows every call of a sweep alike, instead of inflating
    the few timed during the slow spell, as timing one call ``repeats`` times and then the next
    would (draft-pass profiles of one engine ranged 5.3–9.7 ms that way). Each sweep
    visits the calls in its own random order (seeded by ``shuffle_seed``; None: the given order,
    every sweep): in a fixed order the same call always follows the other model's calls, whose
    weights have pushed the next call's out of the caches, and only that call pays for it (stop
    55: a one-token forward read 21.3 ms against 18.5 ms for two tokens that way). ``sync``: run
    before and after each timed call (a device's queue)."""
    for call in calls:
        call()  # warm-up
    samples = np.zeros((max(int(repeats), 1), len(calls)))
    rng = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)
    for i in range(samples.shape[0]):
        for j in (range(len(calls)) if rng is None else rng.permutation(len(calls))):
            if sync:
                sync()
            t0 = time.perf_counter()
            calls[j]()
            if sync:
                sync()
            samples[i, j] = (time.perf_counter() - t0) * 1e3
    return np.median(samples, axis=0)


class CostModel:
    """Predicts step time (ms) from tokens in the target forward and rows per drafter pass."""

    def __init__(self, verify: Table | None = None, draft_pass: Table | None = None, overhead_ms: float = 0.0,
                 rate: float = 0.05, source: str = "default", span_share: float = 1.0, block: int = 0):
        # default: a memory-bound-then-linear shape, in arbitrary but plausible CPU milliseconds
        self.verify = verify or Table(DEFAULT_TOKEN_GRID, [8.0, 8.2, 8.5, 9.5, 12, 18, 30, 55, 105, 205, 405],
                                      "cost.verify")
        self.draft_pass = draft_pass or Table(DEFAULT_ROW_GRID, [3.0, 3.3, 3.8, 5, 7.5, 12.5, 22, 42, 82],
                                              "cost.draft_pass")
        if not np.isfinite(overhead_ms) or overhead_ms < 0:
            raise ValueError("cost.overhead_ms: must be a non-negative number")
        self.overhead_ms = float(overhead_ms)
        self.rate = float(rate)
        self.source = source
        self.observed_steps = 0
        # draft span (workers/decisions.py `DraftIntent.span`): a pass over the first `span` of the block's
        # `block` positions costs `span_share + (1 − span_share) · (span − 1) / (block − 1)` of a
        # whole-block pass (`draft_pass` is the whole block's); `span` is what the deciding policy
        # currently drafts (None: the whole block); span_share 1: passes cost alike at every span
        if not (np.isfinite(span_share) and 0.0 < span_share <= 1.0):
            raise ValueError(f"cost.span_share: must be in (0, 1], got {span_share!r}")
        self.span_share, self.block, self.span = float(span_share), int(block), None

    # -- prediction (tensor code) ------------------------------------------------------------------
    def verify_ms(self, num_tokens: torch.Tensor | float) -> torch.Tensor:
        return self.verify(num_tokens)

    def span_scale(self) -> float:
        """What a pass over the current `span` costs against a whole-block pass (1 without a span)."""
        if self.span is None or self.block <= 1 or self.span_share >= 1.0:
            return 1.0
        f = min(max((self.span - 1) / (self.block - 1), 0.0), 1.0)
        return self.span_share + (1.0 - self.span_share) * f

    def draft_ms(self, rows_per_pass: torch.Tensor) -> torch.Tensor:
        """rows_per_pass: [..., L] rows in each denoising pass (0 = pass not run) -> [...] ms."""
        r = torch.as_tensor(rows_per_pass, dtype=torch.float64)
        return torch.where(r > 0, self.draft_pass(r), torch.zeros_like(r)).sum(-1) * self.span_scale()

    def step_ms(self, num_tokens: torch.Tensor | float, rows_per_pass: torch.Tensor | None = None) -> torch.Tensor:
        t = self.overhead_ms + self.verify_ms(num_tokens)
        if rows_per_pass is not None:
            t = t + self.draft_ms(rows_per_pass)
        return t

    def step_ms_at(self, num_tokens: float, rows_per_pass: Sequence[int] | None = None) -> float:
        """`step_ms` for one step, in plain Python floats: ``rows_per_pass`` a list of row counts."""
        t = self.overhead_ms + self.verify.at(float(num_tokens))
        if rows_per_pass:
            t += self.draft_ms_at(rows_per_pass)
        return t

    def draft_ms_at(self, rows_per_pass: Sequence[int]) -> float:
        return sum(self.draft_pass.at(float(r)) for r in rows_per_pass if r > 0) * self.span_scale()

    @staticmethod
    def rows_per_pass(steps: torch.Tensor, max_steps: int) -> torch.Tensor:
        """steps: [B] diffusion steps per row -> [max_steps] rows in each pass."""
        levels = torch.arange(1, max_steps + 1, device=steps.device)
        return (steps[None, :] >= levels[:, None]).sum(1)

    # -- online correction ------------------------------------------------------------------------
    def observe(self, num_tokens: float, rows_per_pass: Sequence[int], step_ms: float) -> None:
        """Move the tables toward one measured step (EMA with `rate`, each residual a
        `bounded_residual`); plain Python, no tensors. The step's whole time is the measurement:
        its phases are not timed apart here (on a GPU the host's phase times are queueing times)."""
        if not np.isfinite(step_ms) or step_ms <= 0:
            return
        rows = [int(r) for r in (rows_per_pass.tolist() if hasattr(rows_per_pass, "tolist") else rows_per_pass)
                if int(r) > 0]
        self.observed_steps += 1
        now = self.observed_steps
        if now % 16 == 0:  # forget stale rises (`STALE_STEPS`); every 16 steps is often enough
            self.verify.relax_stale(now)
            self.draft_pass.relax_stale(now)
        predicted = self.step_ms_at(num_tokens, rows)
        resid = bounded_residual(step_ms, predicted)
        if rows:
            # a drafting step: its residual is what drafting costs beyond the tables (acceptance
            # over the block, the drafter-context commit, features), spread over its passes, in
            # whole-block units (the table holds whole-block passes)
            for r in rows:
                self.draft_pass.nudge(r, resid / len(rows) / self.span_scale(), self.rate, now)
            return
        # a step without drafts: a speed factor on the overhead and both tables. A plain step
        # measures one size only; raising that size's cost alone made a machine that slowed down
        # uniformly (a busy neighbour, a lower clock) look cheaper to draft on, since a wider
        # verify and the drafter pass kept their old prices while the plain step's rose
        if predicted > 0.0:  # the plain step's prediction: overhead and verify at its size
            factor = max(0.5, 1.0 + self.rate * resid / predicted)
            self.overhead_ms *= factor
            self.verify.scale(factor)
            self.draft_pass.scale(factor)

    # -- building the tables ----------------------------------------------------------------------
    @classmethod
    def profile(cls, verify_fn: Callable[[int], None], draft_fn: Callable[[int], None] | None = None,
                token_grid: Sequence[int] = DEFAULT_TOKEN_GRID[:9], row_grid: Sequence[int] = DEFAULT_ROW_GRID[:7],
                repeats: int = 5, sync: Callable[[], None] | None = None,
                short_draft_fn: Callable[[int], None] | None = None, block: int = 0,
                shuffle_seed: int | None = 0) -> "CostModel":
        """Time ``verify_fn(num_tokens)`` and ``draft_fn(rows)`` (a whole-block pass) on a grid, each
        point its `sweep_medians` (sweeps in an order seeded by ``shuffle_seed``); with
        ``short_draft_fn(rows)`` (a pass over the first position of the block's ``block``) also
        `span_share`, their ratio at the grid's middle row count."""
        points = [(verify_fn, n) for n in token_grid]
        if draft_fn is not None:
            points += [(draft_fn, r) for r in row_grid]
            mid = row_grid[len(row_grid) // 2]
            with_short = short_draft_fn is not None and block > 1
            if with_short:
                points.append((short_draft_fn, mid))
        ms = sweep_medians([functools.partial(fn, arg) for fn, arg in points], repeats, shuffle_seed, sync)  # [points]
        n_tok = len(token_grid)
        verify = Table(token_grid, _monotone(ms[:n_tok]), "cost.verify")
        draft, share = None, 1.0
        if draft_fn is not None:
            whole = ms[n_tok:n_tok + len(row_grid)]
            draft = Table(row_grid, _monotone(whole), "cost.draft_pass")
            if with_short:
                share = min(max(ms[-1] / max(whole[list(row_grid).index(mid)], 1e-6), 0.05), 1.0)
        return cls(verify, draft, source="profile", span_share=share, block=block)

    @classmethod
    def fit_traces(cls, table) -> "CostModel":
        """Fit from trace timings (an `adapt.trace_data.TraceTable`): one point per engine step."""
        keys = table.step_key
        uniq, first = np.unique(keys, return_index=True)
        if len(uniq) < 3:
            raise ValueError("traces: need timings of at least 3 engine steps to fit a cost model")
        n_tok = table.num_tokens[first].astype(np.float64)
        verify = table.verify_ms[first].astype(np.float64)
        draft = table.draft_ms[first].astype(np.float64)
        total = table.step_ms[first].astype(np.float64)
        # rows per pass of each step
        inv = np.searchsorted(uniq, keys)
        max_s = int(max(table.steps.max(), 1))
        passes = np.zeros((len(uniq), max_s))
        for lvl in range(1, max_s + 1):
            np.add.at(passes[:, lvl - 1], inv, (table.steps >= lvl).astype(np.float64))
        if not np.isfinite(verify).any():
            verify = total - np.nan_to_num(draft)
        ok = np.isfinite(verify) & (n_tok > 0)
        grid = [g for g in DEFAULT_TOKEN_GRID if g <= max(2.0, n_tok[ok].max() * 2)]
        vx, vy = _binned_median(n_tok[ok], verify[ok], grid)
        verify_table = Table(vx, np.maximum.accumulate(vy), "cost.verify")
        # draft: draft_ms = Σ_ℓ (a + b · rows_ℓ), non-negative least squares on (a, b)
        okd = np.isfinite(draft)
        draft_table = None
        if okd.sum() >= 3 and passes.sum() > 0:
            n_pass = (passes[okd] > 0).sum(1)
            n_rows = passes[okd].sum(1)
            a_mat = np.stack([n_pass, n_rows], 1)
            coef, *_ = np.linalg.lstsq(a_mat, draft[okd], rcond=None)
            a, b = max(float(coef[0]), 0.0), max(float(coef[1]), 0.0)
            if a == 0.0 and b == 0.0:
                a = float(np.nanmedian(draft[okd] / np.maximum(n_pass, 1)))
            draft_table = Table(DEFAULT_ROW_GRID, [a + b * r for r in DEFAULT_ROW_GRID], "cost.draft_pass")
        # whatever the two parts do not explain is per-step overhead
        resid = total - (verify if np.isfinite(verify).all() else 0) - np.nan_to_num(draft)
        overhead = float(np.clip(np.nanmedian(resid), 0.0, None)) if np.isfinite(resid).any() else 0.0
        return cls(verify_table, draft_table, overhead_ms=overhead, source="traces")

    # -- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"verify": self.verify.to_dict(), "draft_pass": self.draft_pass.to_dict(),
                "overhead_ms": self.overhead_ms, "rate": self.rate, "source": self.source,
                "span_share": self.span_share, "block": self.block}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(Table.from_dict(data["verify"], "cost.verify"), Table.from_dict(data["draft_pass"], "cost.draft_pass"),
                   overhead_ms=float(data.get("overhead_ms", 0.0)), rate=float(data.get("rate", 0.05)),
                   source=str(data.get("source", "file")), span_share=float(data.get("span_share", 1.0)),
                   block=int(data.get("block", 0)))


def _binned_median(x: np.ndarray, y: np.ndarray, grid: Sequence[float]) -> tuple[list[float], list[float]]:
    """Median of y in bins around each grid point (geometric midpoints); grid points without data are
    dropped, and at least two points are returned (a flat extension if needed)."""
    g = np.asarray(grid, dtype=np.float64)
    edges = np.concatenate([[0.0], np.sqrt(g[1:] * g[:-1]), [np.inf]])
    xs, ys = [], []
    for i, gx in enumerate(g):
        m = (x > edges[i]) & (x <= edges[i + 1])
        if m.any():
            xs.append(float(np.median(x[m])))
            ys.append(float(np.median(y[m])))
    if not xs:
        raise ValueError("traces: no usable verify timings")
    # de-duplicate equal xs (can happen with one distinct token count per bin)
    xs_u, idx = np.unique(xs, return_index=True)
    ys_u = [ys[i] for i in idx]
    xs, ys = list(xs_u), ys_u
    if len(xs) == 1:
        xs, ys = [xs[0], xs[0] * 2 + 1], [ys[0], ys[0]]
    return xs, ys
