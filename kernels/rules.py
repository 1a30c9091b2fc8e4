"""Acceptance rules: ids, parameters and which inputs each rule reads.

An *acceptance rule* decides, position by position, whether the target keeps a drafted token.
The exact rules (GREEDY, REJECTION, MATCH) make the emitted tokens follow the target
distribution p; the lossy ("lenient") rules accept more drafts and pay for it in total
variation distance (TVD) between the emitted distribution and p, which `kernels.verify`
reports exactly (see docs/kernels.md, "TVD spent").

| id | name      | param         | param2           | needs q |
|----|-----------|---------------|------------------|---------|
| 0  | GREEDY    | -             | -                | no      |
| 1  | REJECTION | -             | -                | yes     |
| 2  | MATCH     | -             | -                | no      |
| 3  | EPS_TVD   | eps in [0, 1] | -                | yes     |
| 4  | LAMBDA    | lam in (0, 1] | -                | yes     |
| 5  | SGLANG    | threshold_acc | threshold_single | yes     |
| 6  | TYPICAL   | eps (0.09)    | delta (0.3)      | no (q only sharpens the TVD report) |

MATCH accepts a draft x with probability p(x) (one coin: `u < p(x)`) and, on a rejection, emits
a sample of p without x: the law of "accept while x equals a sample of p" (a sample is x with
probability p(x), and a sample that is not x follows p without x), with one coin per position in
place of a vocabulary-wide sample. It is rejection sampling against a point mass at x, so it is
exact for any drafter, deterministic drafts (suffix copies) included.

No rule's accept decision reads the race noise: the noise only samples the token emitted where
a row stops (the recovered or bonus token), so one noise row per request serves all its
positions (`kernels.verify`'s `noise_rows`).
"""

from __future__ import annotations

import enum


class Rule(enum.IntEnum):
    GREEDY = 0      # accept while draft == argmax p; emit argmax p
    REJECTION = 1   # accept w.p. min(1, p/q); residual max(p - q, 0)
    MATCH = 2       # accept w.p. p(x); residual p without x (exact for any drafter)
    EPS_TVD = 3     # optimal lenient rule under a per-token TVD budget eps
    LAMBDA = 4      # accept w.p. min(1, p / (lam q)); residual max(p - q, 0)
    SGLANG = 5      # accept if p(x) >= threshold_single or coin <= p(x) / threshold_acc
    TYPICAL = 6     # Medusa typical acceptance: p(x) > min(eps, delta * exp(-H(p)))


NUM_RULES = len(Rule)
EXACT_RULES = frozenset({Rule.GREEDY, Rule.REJECTION, Rule.MATCH})
LOSSY_RULES = frozenset(set(Rule) - EXACT_RULES)
NEEDS_DRAFT_PROBS = frozenset({Rule.REJECTION, Rule.EPS_TVD, Rule.LAMBDA, Rule.SGLANG})

# Default parameters (param, param2) for each rule; used by callers that only name a rule.
DEFAULT_PARAMS: dict[Rule, tuple[float, float]] = {
    Rule.GREEDY: (0.0, 0.0),
    Rule.REJECTION: (0.0, 0.0),
    Rule.MATCH: (0.0, 0.0),
    Rule.EPS_TVD: (0.05, 0.0),
    Rule.LAMBDA: (0.5, 0.0),
    Rule.SGLANG: (1.0, 1.0),
    Rule.TYPICAL: (0.09, 0.3),
}


def is_exact(rule: int) -> bool:
    """True for rules whose emitted tokens follow p exactly (given their preconditions)."""
    return int(rule) in EXACT_RULES


def parse_rule(name: str | int) -> Rule:
    """`Rule` from a name ("eps_tvd", "EPS_TVD") or an id; ValueError naming `rule` otherwise."""
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        value = int(name)
        if 0 <= value < NUM_RULES:
            return Rule(value)
        raise ValueError(f"rule: unknown rule id {value} (expected 0..{NUM_RULES - 1})")
    try:
        return Rule[str(name).strip().upper().replace("-", "_")]
    except KeyError:
        names = ", ".join(r.name.lower() for r in Rule)
        raise ValueError(f"rule: unknown rule {name!r} (expected one of {names})") from None


def exact_rules(temperature, conditional):
    """[B] int32 exact rule per row: GREEDY at T = 0, REJECTION where the draft probabilities q are
    the proposal's true conditionals, MATCH otherwise (tensors [B]: temperature, conditional)."""
    import torch

    sampled_rule = torch.where(conditional, int(Rule.REJECTION), int(Rule.MATCH))
    return torch.where(temperature <= 0, int(Rule.GREEDY), sampled_rule).to(torch.int32)


def enforce_rules(rule, param, param2, temperature, lossless, conditional, point_mass=None, exact=None):
    """The rule each row really verifies with, whatever a decision maker asked: the one function
    the engine and the replay evaluator apply (tensors [B] on one device). Returns (rule int32,
    param, param2), with parameters 0 where the rule was replaced.

    - T = 0 rows: GREEDY (their p is used only through its argmax; no lossy rule applies);
    - GREEDY asked for a sampled row: the row's exact rule;
    - REJECTION where q are not true conditionals (`conditional` False): MATCH;
    - lossless rows: any lossy rule becomes the exact rule;
    - point-mass drafts (`point_mass` True: suffix drafts, q = 1 at the token): the exact rule
      (a lenient rule would need q).
    ``exact``: `exact_rules` of these rows where the caller has it already."""
    import torch

    if exact is None:
        exact = exact_rules(temperature, conditional)
    rule = rule.to(torch.int32)
    rule = torch.where(rule == int(Rule.GREEDY), exact, rule)
    rule = torch.where((rule == int(Rule.REJECTION)) & ~conditional, int(Rule.MATCH), rule).to(torch.int32)
    is_exact = torch.isin(rule, _exact_ids(rule.device))
    forced = (lossless & ~is_exact) | (temperature <= 0)
    if point_mass is not None:
        forced = forced | point_mass
    rule = torch.where(forced, exact, rule)
    zero = torch.zeros_like(param, dtype=torch.float32)
    return rule, torch.where(forced, zero, param.float()), torch.where(forced, zero, param2.float())


_EXACT_IDS: dict = {}


def _exact_ids(device):
    """The exact rules' ids as an int32 tensor on ``device``, made once per device."""
    import torch

    key = str(device)
    if key not in _EXACT_IDS:
        _EXACT_IDS[key] = torch.tensor(sorted(EXACT_RULES), dtype=torch.int32, device=device)
    return _EXACT_IDS[key]
