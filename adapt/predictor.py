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
  family and a candidate number of diffusion steps ``s``: it is what `choose_steps` plans with.

Both are fitted with scikit-learn on engine traces (only exact-rule rows: GREEDY, REJECTION,
MATCH) and calibrated by *sequential temperature scaling* (as DSpark does): position by position,
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

DRAFT_FEATURES = (
    "confidence", "log_confidence", "entropy", "margin", "position", "prefix_min_confidence",
    "prefix_mean_log_confidence", "greedy", "greedy_x_confidence", "match", "recent_accept", "log_steps",
)
PRIOR_FEATURES = ("steps_1", "steps_2", "steps_3", "steps_4plus", "position", "greedy", "match",
                  "recent_accept", "logit_recent_accept", "log_steps")

_RULE_MATCH = 2
RECENT_UNKNOWN = 0.5  # a row that has not verified anything yet reports recent acceptance 0: read it as this
_EXACT_RULES = (0, 1, 2)
_RULE_EPS_TVD = 3


# ----------------------------------------------------------------------------- features (tensor code)

def draft_features(confidence: torch.Tensor, entropy: torch.Tensor, margin: torch.Tensor,
                   temperature: torch.Tensor, recent_accept: torch.Tensor, steps: torch.Tensor,
                   match: torch.Tensor) -> torch.Tensor:
    """Per-position features for the draft head.

    confidence, entropy, margin: [B, K] float; temperature, recent_accept: [B] float;
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
    recent = _known_recent(recent_accept)[:, None].expand(B, K)
    log_steps = torch.log1p(steps.float())[:, None].expand(B, K)
    return torch.stack([conf, log_conf, entropy.float(), margin.float(), pos, prefix_min, prefix_mean_log,
                        greedy, greedy * conf, match_f, recent, log_steps], dim=-1)


def _known_recent(recent_accept: torch.Tensor) -> torch.Tensor:
    r = recent_accept.float().clamp(0.0, 1.0)
    return torch.where(r > 0, r, torch.full_like(r, RECENT_UNKNOWN))


def prior_features(steps: torch.Tensor, K: int, temperature: torch.Tensor, recent_accept: torch.Tensor,
                   match: torch.Tensor) -> torch.Tensor:
    """Features for the prior head, for every row and candidate step count.

    steps: [S] candidate step counts (≥ 1); temperature, recent_accept: [B]; match: [B] or [B, S] bool.
    Returns [B, S, K, len(PRIOR_FEATURES)].
    """
    B, S = recent_accept.shape[0], steps.shape[0]
    dev = recent_accept.device
    s = steps.to(dev).float()[None, :, None].expand(B, S, K)              # [B, S, K]
    one = torch.ones(B, S, K, device=dev)
    pos = torch.arange(K, device=dev, dtype=torch.float32)[None, None, :].expand(B, S, K) / K_MAX
    greedy = (temperature.float() <= 0).float()[:, None, None] * one
    match_f = (match.float()[:, None, None] if match.dim() == 1 else match.float()[:, :, None]) * one
    recent = _known_recent(recent_accept)[:, None, None] * one
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
    """Survival of draft positions, before drafting (`prior_survival`) and after (`survival`)."""

    def __init__(self, draft: LogisticHead | None = None, prior: LogisticHead | None = None):
        self.draft = draft or _untrained_draft_head()
        self.prior = prior or _untrained_prior_head()
        self.fitted = draft is not None

    def to(self, device) -> "AcceptancePredictor":
        out = AcceptancePredictor(self.draft.to(device), self.prior.to(device))
        out.fitted = self.fitted
        return out

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
        x = draft_features(confidence, entropy, margin, temperature, recent_accept, steps, match)
        c = self._lenient(self.draft.conditional(x), eps)                  # [B, K]
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
        """Same as ``self.prior.logits(prior_features(...))`` but with the normalisation folded into
        the weights and row / step / position terms broadcast, not materialised: [B, S, K]."""
        h = self.prior
        dev = recent_accept.device
        w = (h.weight / h.scale).to(dev)                                    # [F]
        b0 = h.bias - float((h.weight * h.mean / h.scale).sum())
        f = {name: w[i] for i, name in enumerate(PRIOR_FEATURES)}
        s = steps.to(dev).float()                                          # [S]
        s_term = (f["steps_1"] * (s == 1) + f["steps_2"] * (s == 2) + f["steps_3"] * (s == 3)
                  + f["steps_4plus"] * (s >= 4) + f["log_steps"] * torch.log1p(s))          # [S]
        recent = _known_recent(recent_accept)                               # [B]
        row = (f["greedy"] * (temperature.float() <= 0) + f["recent_accept"] * recent
               + f["logit_recent_accept"] * torch.logit(recent.clamp(0.02, 0.98)))          # [B]
        m = match.float() if match.dim() == 2 else match.float()[:, None]   # [B, S] or [B, 1]
        pos = f["position"] * torch.arange(K, device=dev, dtype=torch.float32) / K_MAX      # [K]
        z = (b0 + row[:, None] + s_term[None, :] + f["match"] * m)[:, :, None] + pos      # [B, S, K]
        return z / h.temps[:K].to(dev)

    def to_dict(self) -> dict:
        return {"draft": self.draft.to_dict(), "prior": self.prior.to_dict(), "fitted": self.fitted,
                "leniency": "c + eps * (1 - c)"}

    @classmethod
    def from_dict(cls, data: dict) -> "AcceptancePredictor":
        out = cls(LogisticHead.from_dict(data["draft"], DRAFT_FEATURES),
                  LogisticHead.from_dict(data["prior"], PRIOR_FEATURES))
        out.fitted = bool(data.get("fitted", True))
        return out


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


def _table_draft_x(t: TraceTable) -> torch.Tensor:
    return draft_features(torch.from_numpy(t.confidence), torch.from_numpy(t.entropy), torch.from_numpy(t.margin),
                          torch.from_numpy(t.temperature), torch.from_numpy(t.recent_accept),
                          torch.from_numpy(t.steps), torch.from_numpy(t.rule == _RULE_MATCH))   # [N, K_MAX, F]


def _table_prior_x(t: TraceTable) -> torch.Tensor:
    x = prior_features(torch.tensor([1]), K_MAX, torch.from_numpy(t.temperature), torch.from_numpy(t.recent_accept),
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


def _survival_np(head: LogisticHead, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.cumprod(head.conditional(x), dim=-1).numpy()


def fit_predictor(table: TraceTable, *, seed: int = 0, c: float = 1.0, bins: int = 10) -> tuple[AcceptancePredictor, dict]:
    """Fit both heads on exact-rule records of ``table``, calibrate, and report ECE and reliability.

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
    for name, names, x in (("draft", DRAFT_FEATURES, _table_draft_x(t)), ("prior", PRIOR_FEATURES, _table_prior_x(t))):
        xn = x.numpy()
        train = (split == 0)[:, None] & reached & in_block
        head = _fit_logistic(xn[train], t.flags[train].astype(np.int64), names, c)
        with torch.no_grad():
            z = (((x - head.mean) / head.scale) @ head.weight + head.bias).numpy()   # [N, K_MAX]
        cal = split == 1
        head.temps = torch.tensor(sequential_temperatures(z[cal], survived[cal]), dtype=torch.float32)
        test = split == 2 if (split == 2).any() else cal
        known = (survived[test] >= 0) & in_block[test]
        raw = LogisticHead(names, head.mean, head.scale, head.weight, head.bias)
        ece_raw, _ = expected_calibration_error(_survival_np(raw, x[test])[known], survived[test][known], bins)
        pred = _survival_np(head, x[test])
        ece_cal, reliability = expected_calibration_error(pred[known], survived[test][known], bins)
        report[name] = {"ece_uncalibrated": round(ece_raw, 4), "ece": round(ece_cal, 4), "reliability": reliability,
                        "test_points": int(known.sum()), "temps": [round(float(v), 3) for v in head.temps],
                        "brier": round(float(((pred[known] - survived[test][known]) ** 2).mean()), 4)}
        heads[name] = head
    predictor = AcceptancePredictor(heads["draft"], heads["prior"])
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
