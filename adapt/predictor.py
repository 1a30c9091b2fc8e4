"""Calibrated acceptance predictor: how likely each draft position is to survive verification.

Words used here:
- *conditional acceptance* ``c_j``: probability that draft position ``j`` is accepted given that
  every position before it was (what the target's rule decides at ``j``).
- *survival* ``a_j = Π_{i≤j} c_i``: probability that positions ``0..j`` are all accepted, so
  ``Σ_j a_j`` over the verified prefix is the expected number of accepted drafts and
  ``1 + Σ_j a_j`` the expected τ (tokens per target pass).

Two logistic heads, both evaluated as a few tensor operations inside the engine step:

- the **draft head** (after drafting) reads the draft's own per-position features (confidence =
  top-1 probability of q, entropy, margin, and their running prefix summaries), the row's
  temperature, recent acceptance, diffusion steps and whether the rule is MATCH. It never reads
  the sampled token or q(x), so decisions built on it are non-anticipating (docs/controller.md).
- the **prior head** (before drafting) reads only the row's recent acceptance, temperature, rule
  family and a candidate number of diffusion steps ``s``: it is what `before_draft` plans with.

A row's *recent acceptance* is the per-position acceptance of its latest verified drafts
(`workers.decisions.next_recent_accept`). A row that has not verified any draft yet has none
(`RECENT_NONE`); it reads as the *typical recent acceptance* of its temperature class (greedy or
sampled), `typical_recent`: optimistic on purpose (the larger of the upper quartile of the fitted
traces' recent acceptance and the value that matches the class's mean tokens per block), so that
a row of unknown history drafts wherever an upper-quartile row would pay, and measures itself.

Each head is a pair (`ClassHeads`): one logistic model for greedy rows (T = 0) and one for sampled
rows (T > 0), because their acceptance curves differ in shape (greedy rows in a repetitive stretch
accept whole blocks), not only in level. Both are fitted with scikit-learn on engine traces (only
exact-rule rows: GREEDY, REJECTION, MATCH) and calibrated per class by *sequential temperature
scaling* (as DSpark does): position by position,
``a'_j = a'_{j-1} · σ(z_j / T_j)`` with ``T_j`` fitted on held-out requests so that ``a'_j`` matches
the observed survival. Leniency is handled analytically: under the ε-TVD rule the acceptance of a
position rises by ε whenever the exact rule would have rejected with probability ≥ ε, which we
model conservatively as ``c_ε = c + ε (1 − c)``.

The fitted heads serialise to plain lists (`to_dict`), stored in the JSON policy file
(`adapt.policy_file`); nothing here unpickles anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from adapt.trace_data import K_MAX, TraceTable
from kernels.rules import EXACT_RULES, LENIENT_RULE, Rule

DRAFT_FEATURES = (
    "confidence", "log_confidence", "entropy", "margin", "position", "prefix_min_confidence",
    "prefix_mean_log_confidence", "greedy", "greedy_x_confidence", "match", "recent_accept", "log_steps",
)
PRIOR_FEATURES = ("steps_1", "steps_2", "steps_3", "steps_4plus", "position", "greedy", "match",
                  "recent_accept", "logit_recent_accept", "log_steps")

# rule ids from the one rule table (kernels/rules.py)
_RULE_MATCH = int(Rule.MATCH)
_EXACT_RULES = tuple(sorted(int(r) for r in EXACT_RULES))
_RULE_EPS_TVD = int(LENIENT_RULE)  # the lossy rule policies choose (its param is eps)


# ----------------------------------------------------------------------------- features (tensor code)

def draft_features(confidence: torch.Tensor, entropy: torch.Tensor, margin: torch.Tensor,
                   temperature: torch.Tensor, recent_accept: torch.Tensor, steps: torch.Tensor,
                   match: torch.Tensor) -> torch.Tensor:
    """Per-position features for the draft head.

    confidence, entropy, margin: [B, K] float; temperature, recent_accept (known, see
    `AcceptancePredictor.known_recent`): [B] float;
    steps: [B] int/float; match: [B] bool (rule is MATCH). Returns [B, K, len(DRAFT_FEATURES)].
    """
    B, K = confidence.shape
    conf = confidence.float().clamp(1e-6, 1.0)                             # [B, K]
    log_conf = conf.log()
    pos = torch.arange(K, device=conf.device, dtype=torch.float32).expand(B, K) / K_MAX
    prefix_min = torch.cummin(conf, dim=1).values
    prefix_mean_log = log_conf.cumsum(1) / (torch.arange(K, device=conf.device) + 1)
    greedy = (temperature.float() <= 0).float()[:, None].expand(B, K)      # [B, K]
    match_f = match.float()[:, None].expand(B, K)
    recent = recent_accept.float().clamp(0.0, 1.0)[:, None].expand(B, K)
    log_steps = torch.log1p(steps.float())[:, None].expand(B, K)
    return torch.stack([conf, log_conf, entropy.float(), margin.float(), pos, prefix_min, prefix_mean_log,
                        greedy, greedy * conf, match_f, recent, log_steps], dim=-1)


def prior_features(steps: torch.Tensor, K: int, temperature: torch.Tensor, recent_accept: torch.Tensor,
                   match: torch.Tensor) -> torch.Tensor:
    """Features for the prior head, for every row and candidate step count.

    steps: [S] candidate step counts (≥ 1); temperature, recent_accept (known): [B]; match: [B] or [B, S] bool.
    Returns [B, S, K, len(PRIOR_FEATURES)].
    """
    B, S = recent_accept.shape[0], steps.shape[0]
    dev = recent_accept.device
    s = steps.to(dev).float()[None, :, None].expand(B, S, K)              # [B, S, K]
    one = torch.ones(B, S, K, device=dev)
    pos = torch.arange(K, device=dev, dtype=torch.float32)[None, None, :].expand(B, S, K) / K_MAX
    greedy = (temperature.float() <= 0).float()[:, None, None] * one
    match_f = (match.float()[:, None, None] if match.dim() == 1 else match.float()[:, :, None]) * one
    recent = recent_accept.float().clamp(0.0, 1.0)[:, None, None] * one
    logit_recent = torch.logit(recent.clamp(0.02, 0.98))
    return torch.stack([(s == 1).float(), (s == 2).float(), (s == 3).float(), (s >= 4).float(), pos,
                        greedy, match_f, recent, logit_recent, torch.log1p(s)], dim=-1)


# ----------------------------------------------------------------------------- a calibrated logistic head

@dataclass
class LogisticHead:
    """``c_j = σ(((x − mean) / scale) · weight + bias) / T_j)``; survival = cumulative product.

    ``temps`` holds one calibration temperature per position (``K_MAX``), 1 = uncalibrated.
    """

    names: tuple[str, ...]
    mean: torch.Tensor      # [F]
    scale: torch.Tensor     # [F]
    weight: torch.Tensor    # [F]
    bias: float
    temps: torch.Tensor = field(default_factory=lambda: torch.ones(K_MAX))  # [K_MAX]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K, F] -> calibrated conditional logits [..., K]."""
        z = ((x - self.mean) / self.scale) @ self.weight + self.bias     # [..., K]
        return z / self.temps[: x.shape[-2]]

    def conditional(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(x))

    def folded(self, device) -> tuple[dict[str, torch.Tensor], float]:
        """The weights with the normalisation folded in, per feature name (0-d tensors on
        ``device``), and the folded bias: ``x · w + b0`` = the raw logit. Cached per device."""
        key = str(device)
        cache = self.__dict__.setdefault("_folded", {})
        if key not in cache:
            w = (self.weight / self.scale).to(device)                            # [F]
            b0 = self.bias - float((self.weight * self.mean / self.scale).sum())
            cache[key] = ({name: w[i] for i, name in enumerate(self.names)}, b0)
        return cache[key]

    def to(self, device: torch.device | str) -> "LogisticHead":
        return LogisticHead(self.names, self.mean.to(device), self.scale.to(device), self.weight.to(device),
                            self.bias, self.temps.to(device))

    def to_dict(self) -> dict:
        return {"features": list(self.names), "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "weight": self.weight.tolist(), "bias": float(self.bias), "temps": self.temps.tolist()}

    @classmethod
    def from_dict(cls, data: dict, expected: tuple[str, ...]) -> "LogisticHead":
        names = tuple(data["features"])
        if names != expected:
            raise ValueError(f"predictor.features: expected {list(expected)}, got {list(names)}")
        f = len(names)
        tensors = {}
        for key, size in (("mean", f), ("scale", f), ("weight", f), ("temps", K_MAX)):
            t = torch.tensor(data[key], dtype=torch.float32)
            if t.shape != (size,) or not torch.isfinite(t).all():
                raise ValueError(f"predictor.{key}: expected {size} finite numbers")
            tensors[key] = t
        if (tensors["scale"] <= 0).any() or (tensors["temps"] <= 0).any():
            raise ValueError("predictor.scale/temps: must be positive")
        bias = float(data["bias"])
        if not np.isfinite(bias):
            raise ValueError("predictor.bias: must be finite")
        return cls(names, tensors["mean"], tensors["scale"], tensors["weight"], bias, tensors["temps"])


@dataclass
class ClassHeads:
    """One `LogisticHead` per temperature class: ``greedy`` rows (T = 0) and ``sampled`` rows (T > 0)."""

    greedy: LogisticHead
    sampled: LogisticHead

    def logits(self, x: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        """x: [B, ..., K, F]; sampled: [B] bool -> calibrated conditional logits [B, ..., K]."""
        zg, zs = self.greedy.logits(x), self.sampled.logits(x)
        return torch.where(sampled.reshape(-1, *([1] * (zg.dim() - 1))), zs, zg)

    def conditional(self, x: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(x, sampled))

    def to(self, device) -> "ClassHeads":
        return ClassHeads(self.greedy.to(device), self.sampled.to(device))

    def to_dict(self) -> dict:
        return {"greedy": self.greedy.to_dict(), "sampled": self.sampled.to_dict()}

    @classmethod
    def from_dict(cls, data: dict, expected: tuple[str, ...]) -> "ClassHeads":
        if not isinstance(data, dict) or set(data) != {"greedy", "sampled"}:
            raise ValueError("predictor head: expected an object with 'greedy' and 'sampled' heads")
        return cls(LogisticHead.from_dict(data["greedy"], expected), LogisticHead.from_dict(data["sampled"], expected))


def _untrained_draft_head() -> LogisticHead:
    """Before any fit: conditional acceptance = draft confidence (logit of it), no calibration."""
    f = len(DRAFT_FEATURES)
    weight = torch.zeros(f)
    # logit(conf) ≈ log_conf − log(1 − conf); use log_conf with a steep weight as a monotone proxy
    weight[DRAFT_FEATURES.index("log_confidence")] = 3.0
    return LogisticHead(DRAFT_FEATURES, torch.zeros(f), torch.ones(f), weight, 1.5)


def _untrained_prior_head() -> LogisticHead:
    f = len(PRIOR_FEATURES)
    weight = torch.zeros(f)
    weight[PRIOR_FEATURES.index("logit_recent_accept")] = 1.0
    weight[PRIOR_FEATURES.index("position")] = -2.0
    return LogisticHead(PRIOR_FEATURES, torch.zeros(f), torch.ones(f), weight, 0.0)


class AcceptancePredictor:
    """Survival of draft positions, before drafting (`prior_survival`) and after (`survival`).

    ``typical_recent`` [2]: the recent acceptance a row without any verified draft reads as, for
    greedy (0) and sampled (1) rows."""

    def __init__(self, draft: ClassHeads | None = None, prior: ClassHeads | None = None,
                 typical_recent: torch.Tensor | None = None):
        self.draft = draft or ClassHeads(_untrained_draft_head(), _untrained_draft_head())
        self.prior = prior or ClassHeads(_untrained_prior_head(), _untrained_prior_head())
        self.typical_recent = (torch.full((2,), 0.5) if typical_recent is None
                               else torch.as_tensor(typical_recent, dtype=torch.float32))
        self.fitted = draft is not None

    def to(self, device) -> "AcceptancePredictor":
        out = AcceptancePredictor(self.draft.to(device), self.prior.to(device), self.typical_recent.to(device))
        out.fitted = self.fitted
        return out

    def known_recent(self, recent_accept: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """[B] recent acceptance in [0, 1]; rows without one (< 0) get their class's typical value."""
        r = recent_accept.float()
        typical = self.typical_recent.to(r.device)[(temperature.to(r.device) > 0).long()]   # [B]
        return torch.where(r >= 0, r.clamp(0.0, 1.0), typical)

    @staticmethod
    def _lenient(c: torch.Tensor, eps: torch.Tensor | None) -> torch.Tensor:
        if eps is None:
            return c
        e = eps.float().clamp(0.0, 1.0)
        while e.dim() < c.dim():
            e = e.unsqueeze(-1)
        return c + e * (1.0 - c)

    def survival(self, confidence: torch.Tensor, entropy: torch.Tensor, margin: torch.Tensor,
                 temperature: torch.Tensor, recent_accept: torch.Tensor, steps: torch.Tensor,
                 match: torch.Tensor, eps: torch.Tensor | None = None) -> torch.Tensor:
        """[B, K] survival of each drafted position; ``eps`` [B] is the leniency of an ε-TVD rule."""
        x = draft_features(confidence, entropy, margin, temperature, self.known_recent(recent_accept, temperature),
                           steps, match)
        c = self._lenient(self.draft.conditional(x, temperature > 0), eps)  # [B, K]
        return torch.cumprod(c, dim=1)

    def prior_survival(self, steps: torch.Tensor, K: int, temperature: torch.Tensor,
                       recent_accept: torch.Tensor, match: torch.Tensor,
                       eps: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S, K] survival expected before drafting for each candidate step count ``steps`` [S];
        ``match`` and ``eps`` are [B] or [B, S] (per row and candidate)."""
        c = torch.sigmoid(self._prior_logits(steps, K, temperature, recent_accept, match))   # [B, S, K]
        if eps is not None:
            c = self._lenient(c, eps if eps.dim() == 2 else eps[:, None])
        return torch.cumprod(c, dim=-1)

    def _prior_logits(self, steps, K, temperature, recent_accept, match) -> torch.Tensor:
        """Same as ``self.prior.logits(prior_features(...), temperature > 0)`` but with the
        normalisation folded into the weights and row / step / position terms broadcast, not
        materialised: [B, S, K]."""
        recent = self.known_recent(recent_accept, temperature)              # [B]
        sampled = temperature > 0
        n_sampled = int(sampled.sum())  # temperature is a host tensor in RowState: no device sync
        if n_sampled in (0, sampled.numel()):  # one class in the batch: one head
            head = self.prior.sampled if n_sampled else self.prior.greedy
            return _folded_prior_logits(head, steps, K, temperature, recent, match)
        zg = _folded_prior_logits(self.prior.greedy, steps, K, temperature, recent, match)
        zs = _folded_prior_logits(self.prior.sampled, steps, K, temperature, recent, match)
        return torch.where(sampled.to(zg.device)[:, None, None], zs, zg)

    def to_dict(self) -> dict:
        return {"draft": self.draft.to_dict(), "prior": self.prior.to_dict(), "fitted": self.fitted,
                "typical_recent": self.typical_recent.tolist(), "leniency": "c + eps * (1 - c)"}

    @classmethod
    def from_dict(cls, data: dict) -> "AcceptancePredictor":
        typical = torch.tensor(data["typical_recent"], dtype=torch.float32)
        if typical.shape != (2,) or not torch.isfinite(typical).all() or (typical < 0).any() or (typical > 1).any():
            raise ValueError("predictor.typical_recent: expected 2 numbers in [0, 1] (greedy, sampled)")
        out = cls(ClassHeads.from_dict(data["draft"], DRAFT_FEATURES), ClassHeads.from_dict(data["prior"], PRIOR_FEATURES),
                  typical)
        out.fitted = bool(data.get("fitted", True))
        return out


def _folded_prior_logits(h: LogisticHead, steps, K, temperature, recent, match) -> torch.Tensor:
    """``h.logits(prior_features(...))`` for known ``recent`` [B], as broadcast terms: [B, S, K]."""
    dev = recent.device
    f, b0 = h.folded(dev)
    s = steps.to(dev).float()                                               # [S]
    s_term = (f["steps_1"] * (s == 1) + f["steps_2"] * (s == 2) + f["steps_3"] * (s == 3)
              + f["steps_4plus"] * (s >= 4) + f["log_steps"] * torch.log1p(s))          # [S]
    row = (f["greedy"] * (temperature.to(dev).float() <= 0) + f["recent_accept"] * recent
           + f["logit_recent_accept"] * torch.logit(recent.clamp(0.02, 0.98)))          # [B]
    m = match.float() if match.dim() == 2 else match.float()[:, None]       # [B, S] or [B, 1]
    pos = f["position"] * torch.arange(K, device=dev, dtype=torch.float32) / K_MAX      # [K]
    z = (b0 + row[:, None] + s_term[None, :] + f["match"] * m)[:, :, None] + pos          # [B, S, K]
    return z / h.temps[:K].to(dev)


# ----------------------------------------------------------------------------- fitting and calibration

def expected_calibration_error(pred: np.ndarray, label: np.ndarray, bins: int = 10) -> tuple[float, list[dict]]:
    """ECE (count-weighted mean |predicted − observed| over equal-width bins) and the reliability table."""
    pred = np.asarray(pred, dtype=np.float64)
    label = np.asarray(label, dtype=np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    idx = np.clip(np.digitize(pred, edges[1:-1]), 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        m = idx == b
        n = int(m.sum())
        if n == 0:
            continue
        mp, fo = float(pred[m].mean()), float(label[m].mean())
        ece += n / max(len(pred), 1) * abs(mp - fo)
        table.append({"bin": [round(float(edges[b]), 3), round(float(edges[b + 1]), 3)], "count": n,
                      "predicted": round(mp, 4), "observed": round(fo, 4)})
    return float(ece), table


def _split(request_ids: np.ndarray, seed: int) -> np.ndarray:
    """0 = train, 1 = calibration, 2 = test; by request (60/20/20), deterministic."""
    uniq = np.unique(request_ids.astype(str))
    rng = np.random.default_rng(seed)
    part = dict(zip(uniq, rng.permutation(len(uniq)) % 5))
    code = np.array([part[r] for r in request_ids.astype(str)])
    return np.where(code < 3, 0, np.where(code == 3, 1, 2))


def typical_recent(t: TraceTable) -> torch.Tensor:
    """[2] mean recent acceptance of the records' rows that have one, greedy (0) and sampled (1)."""
    known = t.recent_accept >= 0
    overall = float(t.recent_accept[known].mean()) if known.any() else 0.5
    return _recent_by_class(t, np.mean, torch.full((2,), overall)).clamp(0.0, 1.0)


def matched_typical_recent(predictor: "AcceptancePredictor", t: TraceTable, fallback: torch.Tensor) -> torch.Tensor:
    """[2] per class, the recent acceptance at which the prior expects as many accepted drafts per
    fully verified block as the class's records show on average. Acceptance is a mixture (most
    passes accept little, repetitive stretches accept whole blocks), and the expected tokens are
    convex in the per-position acceptance, so the plain mean recent acceptance under-states what
    a row of unknown history is worth on average; this value does not. ``fallback`` where a class
    has fewer than 20 fully verified records."""
    grid = torch.linspace(0.0, 1.0, 101)                                       # [R]
    out = fallback.clone().float()
    full = (t.draft_len == t.block) & (t.block > 0) & (t.steps > 0)
    for cls, sampled in ((0, False), (1, True)):
        m = full & ((t.temperature > 0) == sampled)
        if m.sum() < 20:
            continue
        target = float(t.accepted[m].mean())
        expected = torch.zeros_like(grid, dtype=torch.float64)
        groups = np.stack([t.steps[m], t.block[m], t.rule[m] == _RULE_MATCH], 1)
        for (s, block, match), n in zip(*np.unique(groups, axis=0, return_counts=True)):
            surv = predictor.prior_survival(torch.tensor([int(s)]), int(block), torch.full_like(grid, float(sampled)),
                                            grid, torch.full(grid.shape, bool(match)))     # [R, 1, block]
            expected += n * surv[:, 0].sum(-1).double()
        expected /= int(m.sum())
        out[cls] = grid[int(torch.argmin((expected - target).abs()))]
    return out


def quantile_recent(t: TraceTable, q: float, fallback: torch.Tensor) -> torch.Tensor:
    """[2] the ``q``-quantile of the records' known recent acceptance, greedy (0) and sampled (1)."""
    return _recent_by_class(t, lambda values: np.quantile(values, q), fallback)


def _recent_by_class(t: TraceTable, stat, fallback: torch.Tensor) -> torch.Tensor:
    """[2] ``stat`` of the records' known recent acceptance for greedy (0) and sampled (1) rows;
    ``fallback`` for a class with fewer than 10 such records."""
    out = fallback.clone().float()
    for cls, sampled in ((0, False), (1, True)):
        m = (t.recent_accept >= 0) & ((t.temperature > 0) == sampled)
        if m.sum() >= 10:
            out[cls] = float(stat(t.recent_accept[m]))
    return out


def _table_recent(t: TraceTable, typical: torch.Tensor) -> torch.Tensor:
    return AcceptancePredictor(typical_recent=typical).known_recent(torch.from_numpy(t.recent_accept),
                                                                    torch.from_numpy(t.temperature))


def _table_draft_x(t: TraceTable, typical: torch.Tensor) -> torch.Tensor:
    return draft_features(torch.from_numpy(t.confidence), torch.from_numpy(t.entropy), torch.from_numpy(t.margin),
                          torch.from_numpy(t.temperature), _table_recent(t, typical),
                          torch.from_numpy(t.steps), torch.from_numpy(t.rule == _RULE_MATCH))   # [N, K_MAX, F]


def _table_prior_x(t: TraceTable, typical: torch.Tensor) -> torch.Tensor:
    x = prior_features(torch.tensor([1]), K_MAX, torch.from_numpy(t.temperature), _table_recent(t, typical),
                       torch.from_numpy(t.rule == _RULE_MATCH))             # [N, 1, K_MAX, F]
    # the candidate-steps columns come from each record's own s
    s = torch.from_numpy(t.steps).float()[:, None, None].expand(-1, 1, K_MAX)
    x[..., 0], x[..., 1], x[..., 2], x[..., 3] = (s == 1).float(), (s == 2).float(), (s == 3).float(), (s >= 4).float()
    x[..., -1] = torch.log1p(s)
    return x[:, 0]                                                           # [N, K_MAX, F]


def _fit_logistic(x: np.ndarray, y: np.ndarray, names: tuple[str, ...], c: float) -> LogisticHead:
    from sklearn.linear_model import LogisticRegression

    mean = x.mean(0)
    scale = x.std(0)
    scale[scale < 1e-6] = 1.0
    if len(np.unique(y)) < 2:  # degenerate: everything accepted or rejected
        p = float(np.clip(y.mean(), 0.01, 0.99))
        return LogisticHead(names, torch.tensor(mean, dtype=torch.float32), torch.tensor(scale, dtype=torch.float32),
                            torch.zeros(len(names)), float(np.log(p / (1 - p))))
    model = LogisticRegression(C=c, max_iter=1000)
    model.fit((x - mean) / scale, y)
    return LogisticHead(names, torch.tensor(mean, dtype=torch.float32), torch.tensor(scale, dtype=torch.float32),
                        torch.tensor(model.coef_[0], dtype=torch.float32), float(model.intercept_[0]))


def _bce(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def sequential_temperatures(z: np.ndarray, survived: np.ndarray, min_count: int = 30) -> np.ndarray:
    """Fit ``T_j`` position by position so that ``a'_j = a'_{j-1} σ(z_j / T_j)`` matches survival.

    z: [N, K] raw conditional logits; survived: [N, K] 1/0, -1 unknown. Returns [K_MAX] temperatures.
    """
    grid = np.exp(np.linspace(np.log(0.2), np.log(5.0), 81))
    temps = np.ones(K_MAX)
    prev = np.ones(z.shape[0])
    for j in range(min(z.shape[1], K_MAX)):
        known = survived[:, j] >= 0
        if known.sum() >= min_count:
            y = survived[known, j].astype(np.float64)
            # a weak prior toward T = 1 keeps positions with few samples from over-fitting
            penalty = 1.0 / known.sum()
            losses = [_bce(prev[known] / (1 + np.exp(-z[known, j] / t)), y) + penalty * np.log(t) ** 2 for t in grid]
            temps[j] = grid[int(np.argmin(losses))]
        elif j > 0:
            temps[j] = temps[j - 1]
        prev = prev / (1 + np.exp(-z[:, j] / temps[j]))
    return temps


def _survival_np(heads: ClassHeads, x: torch.Tensor, sampled: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return torch.cumprod(heads.conditional(x, torch.from_numpy(sampled)), dim=-1).numpy()


def _fit_class_heads(x: torch.Tensor, names: tuple[str, ...], t: TraceTable, split: np.ndarray, samples: np.ndarray,
                     survived: np.ndarray, c: float) -> tuple[ClassHeads, ClassHeads]:
    """(calibrated, uncalibrated) heads: one logistic fit per temperature class on its training
    requests' conditional ``samples`` [N, K_MAX], calibrated on its calibration requests. A class
    with too few samples gets the head fitted on both classes."""
    xn = x.numpy()
    sampled = t.temperature > 0
    labels = t.flags.astype(np.int64)
    pooled = None
    fitted = {}
    for name, in_class in (("greedy", ~sampled), ("sampled", sampled)):
        train = ((split == 0) & in_class)[:, None] & samples
        if train.sum() >= 50 and len(np.unique(labels[train])) == 2:
            head = _fit_logistic(xn[train], labels[train], names, c)
        else:
            if pooled is None:
                everyone = (split == 0)[:, None] & samples
                pooled = _fit_logistic(xn[everyone], labels[everyone], names, c)
            head = LogisticHead(names, pooled.mean, pooled.scale, pooled.weight, pooled.bias)
        raw = LogisticHead(names, head.mean, head.scale, head.weight, head.bias)
        with torch.no_grad():
            z = raw.logits(x).numpy()                                         # [N, K_MAX]
        cal = (split == 1) & in_class
        head.temps = torch.tensor(sequential_temperatures(z[cal], survived[cal]), dtype=torch.float32)
        fitted[name] = (head, raw)
    return (ClassHeads(fitted["greedy"][0], fitted["sampled"][0]), ClassHeads(fitted["greedy"][1], fitted["sampled"][1]))


def fit_predictor(table: TraceTable, *, seed: int = 0, c: float = 1.0, bins: int = 10) -> tuple[AcceptancePredictor, dict]:
    """Fit both heads (each one model per temperature class) on exact-rule records of ``table``,
    calibrate, and report ECE and reliability, overall and per class.

    Requests are split 60/20/20 into train / calibration / test; the report's numbers are on test.
    """
    drafted = (table.steps > 0) & (table.block > 0) & (table.draft_len > 0)
    exact = drafted & np.isin(table.rule, _EXACT_RULES)
    t = table.select(exact)
    if len(t) < 20:
        raise ValueError(f"traces: need at least 20 drafted exact-rule records to fit, got {len(t)}")
    split = _split(t.request_id, seed)
    if (split == 0).sum() == 0 or (split == 1).sum() == 0:
        split = np.arange(len(t)) % 5
        split = np.where(split < 3, 0, np.where(split == 3, 1, 2))
    survived = t.survived.astype(np.int64)                                 # [N, K_MAX]
    j = np.arange(K_MAX)[None, :]
    reached = (t.flags >= 0) & (j <= t.accepted[:, None])                  # conditional samples
    in_block = j < t.block[:, None]
    report: dict = {"records": int(len(table)), "exact_records": int(len(t)),
                    "requests": int(len(np.unique(t.request_id.astype(str))))}
    heads = {}
    typical = typical_recent(t)
    report["typical_recent"] = {"greedy": round(float(typical[0]), 4), "sampled": round(float(typical[1]), 4)}
    for name, names, x in (("draft", DRAFT_FEATURES, _table_draft_x(t, typical)),
                           ("prior", PRIOR_FEATURES, _table_prior_x(t, typical))):
        head, raw = _fit_class_heads(x, names, t, split, reached & in_block, survived, c)
        test = split == 2 if (split == 2).any() else split == 1
        known = (survived[test] >= 0) & in_block[test]
        sampled_test = t.temperature[test] > 0
        observed = survived[test][known]
        ece_raw, _ = expected_calibration_error(_survival_np(raw, x[test], sampled_test)[known], observed, bins)
        pred = _survival_np(head, x[test], sampled_test)[known]
        ece_cal, reliability = expected_calibration_error(pred, observed, bins)
        sampled = np.broadcast_to(sampled_test[:, None], known.shape)[known]
        by_class = {}
        for cls_name, m in (("greedy", ~sampled), ("sampled", sampled)):
            if m.sum() >= 10:
                e, _ = expected_calibration_error(pred[m], observed[m], bins)
                by_class[cls_name] = {"ece": round(e, 4), "points": int(m.sum()),
                                      "predicted": round(float(pred[m].mean()), 4),
                                      "observed": round(float(observed[m].mean()), 4)}
        report[name] = {"ece_uncalibrated": round(ece_raw, 4), "ece": round(ece_cal, 4), "reliability": reliability,
                        "by_class": by_class, "test_points": int(known.sum()),
                        "temps": {cls: [round(float(v), 3) for v in getattr(head, cls).temps]
                                  for cls in ("greedy", "sampled")},
                        "brier": round(float(((pred - observed) ** 2).mean()), 4)}
        heads[name] = head
    predictor = AcceptancePredictor(heads["draft"], heads["prior"], typical)
    matched = matched_typical_recent(predictor, t, typical)
    upper = quantile_recent(t, 0.75, typical)
    predictor.typical_recent = torch.maximum(matched, upper)
    report["typical_recent"] = {"greedy": round(float(predictor.typical_recent[0]), 4),
                                "sampled": round(float(predictor.typical_recent[1]), 4),
                                "mean_recent": report["typical_recent"],
                                "matched": [round(float(v), 4) for v in matched],
                                "upper_quartile": [round(float(v), 4) for v in upper]}
    # the analytic leniency model, checked on ε-TVD rows when the traces have any
    lenient = drafted & (table.rule == _RULE_EPS_TVD) & (table.param > 0)
    if lenient.sum() >= 20:
        e = table.select(lenient)
        with torch.no_grad():
            pred = predictor.survival(torch.from_numpy(e.confidence), torch.from_numpy(e.entropy),
                                      torch.from_numpy(e.margin), torch.from_numpy(e.temperature),
                                      torch.from_numpy(e.recent_accept), torch.from_numpy(e.steps),
                                      torch.zeros(len(e), dtype=torch.bool), torch.from_numpy(e.param)).numpy()
        s = e.survived
        known = (s >= 0) & (np.arange(K_MAX)[None, :] < e.block[:, None])
        ece_eps, rel = expected_calibration_error(pred[known], s[known], bins)
        report["lenient"] = {"records": int(lenient.sum()), "ece": round(ece_eps, 4), "reliability": rel}
    return predictor, report
