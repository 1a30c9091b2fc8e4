"""Acceptance rules: the one table (`RULES`) every other part of the project reads rule facts from.

An *acceptance rule* decides, position by position, whether the target keeps a drafted token.
The exact rules (GREEDY, REJECTION, MATCH) make the emitted tokens follow the target
distribution p; a lossy ("lenient") rule accepts more drafts and pays for it in total variation
distance (TVD) between the emitted distribution and p, which `kernels.verify` reports exactly
(see docs/kernels.md, "TVD spent").

Each rule is one `RuleSpec` row: its id and name, what its accept decision reads (q(x), q over
the vocabulary), the residual its recovered token is drawn from, its parameters (names, ranges,
defaults), whether it is exact, how its TVD is accounted, and its torch accept formula. The
torch backends (`kernels.reference`, `kernels.stop_first`), parameter checks (`kernels.verify`),
the engine's verification (`workers.verification`) and reports derive from the row; the Triton
kernel (`kernels.triton_verify`) has code per rule and says which rules it implements.

| id | name      | param         | needs q | residual     |
|----|-----------|---------------|---------|--------------|
| 0  | GREEDY    | -             | no      | argmax p     |
| 1  | REJECTION | -             | q(x)    | (p - q)+     |
| 2  | MATCH     | -             | no      | p without x  |
| 3  | EPS_TVD   | eps in [0, 1] | q(v)    | (p - q)+     |

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

import dataclasses
import enum
from collections.abc import Callable, Mapping, Set


class Rule(enum.IntEnum):
    GREEDY = 0      # accept while draft == argmax p; emit argmax p
    REJECTION = 1   # accept w.p. min(1, p/q); residual max(p - q, 0)
    MATCH = 2       # accept w.p. p(x); residual p without x (exact for any drafter)
    EPS_TVD = 3     # optimal lenient rule under a per-token TVD budget eps


# Residual forms: what a draft row's recovered token is drawn from (a bonus row draws from p).
RESIDUAL_ARGMAX = "argmax"          # no draw: argmax p
RESIDUAL_P = "p"                    # p itself
RESIDUAL_P_MINUS_Q = "p_minus_q"    # max(p - q, 0), p where it has no mass
RESIDUAL_P_WITHOUT_X = "p_without_x"  # p with the drafted token's entry set to 0
RESIDUALS = (RESIDUAL_ARGMAX, RESIDUAL_P, RESIDUAL_P_MINUS_Q, RESIDUAL_P_WITHOUT_X)


@dataclasses.dataclass(frozen=True)
class Param:
    """One rule parameter (`param` or `param2` of `kernels.verify`): its name, range and default."""

    name: str
    lo: float
    hi: float
    default: float
    lo_open: bool = False   # True: lo itself is outside the range
    hi_open: bool = False

    def text(self) -> str:
        return f"{self.name} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def ok(self, value):
        """True where `value` (a float or a tensor) lies in the range (NaN never does)."""
        low = value > self.lo if self.lo_open else value >= self.lo
        high = value < self.hi if self.hi_open else value <= self.hi
        return low & high


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """One acceptance rule (see the module docstring).

    ``accept(p, q, x, px, qx, u, prm, prm2) -> (accept [n] bool, tvd [n] or None, token [n] or
    None)`` is the torch formula for n target rows sharing the rule: p [n, V]; q [n, V] when
    ``reads_q_rows`` (0 at bonus rows), else None; x [n, 1] drafted tokens; px = p(x) [n]; qx =
    q(x) [n] when ``reads_qx``, else None; u [n] the coins; prm, prm2 [n] the parameters. tvd None
    means 0 (exact rules); token is given only where the accept computes it anyway (GREEDY:
    argmax p), else the residual gives it. Elementwise arithmetic must be in the Triton kernel's
    float32 order where the rule has Triton code."""

    id: int
    name: str
    exact: bool
    reads_qx: bool                # accept reads q(x) at the drafted token
    reads_q_rows: bool            # accept or TVD reads q over the whole vocabulary
    residual: str                 # one of RESIDUALS
    params: tuple[Param, ...]     # (param, param2) names, ranges and defaults; () for none
    tvd: str                      # how the TVD spent at a decided position is accounted
    accept: Callable
    summary: str = ""

    @property
    def needs_q(self) -> bool:
        """Rows with drafts under this rule need draft probabilities q."""
        return self.reads_qx or self.reads_q_rows

    @property
    def defaults(self) -> tuple[float, float]:
        d = [prm.default for prm in self.params] + [0.0, 0.0]
        return d[0], d[1]


def _accept_greedy(p, q, x, px, qx, u, prm, prm2):
    y = p.argmax(-1)
    return y == x.squeeze(1), None, y


def _accept_rejection(p, q, x, px, qx, u, prm, prm2):
    return u * qx < px, None, None                                       # P = min(1, p/q) for u ~ U[0, 1)


def _accept_match(p, q, x, px, qx, u, prm, prm2):
    return u < px, None, None  # a sample of p equals x with probability p(x): one coin decides it


def _accept_eps_tvd(p, q, x, px, qx, u, prm, prm2):
    import torch

    tv = torch.sub(p, q).clamp_(min=0.0).sum(-1)                         # [n] TV(p, q) = sum (p - q)+
    ratio = torch.where(tv > prm, prm / tv, torch.ones_like(tv))         # share of the gap closed
    acc = ((px >= qx) & (px > 0)) | (tv <= prm) | (u * qx < px + ratio * (qx - px))
    return acc, torch.minimum(prm, tv), None


RULES: dict[int, RuleSpec] = {}
_VERSION = [0]  # bumped by every change of RULES (caches of derived tensors key on it)


def register(spec: RuleSpec) -> RuleSpec:
    """Add a rule to the table (ValueError naming `rule` for a taken id or name or a bad row)."""
    if spec.id in RULES or any(s.name == spec.name for s in RULES.values()):
        raise ValueError(f"rule: id {spec.id} or name {spec.name!r} is taken")
    if spec.residual not in RESIDUALS or len(spec.params) > 2 or spec.id < 0:
        raise ValueError(f"rule: {spec.name}: residual in {RESIDUALS}, at most 2 params, id >= 0")
    RULES[spec.id] = spec
    _VERSION[0] += 1
    return spec


def unregister(rule_id: int) -> None:
    """Remove a rule from the table (tests that register a toy rule)."""
    RULES.pop(int(rule_id), None)
    _VERSION[0] += 1


_NO_TVD = "0 (exact)"
register(RuleSpec(Rule.GREEDY, "GREEDY", True, False, False, RESIDUAL_ARGMAX, (), _NO_TVD, _accept_greedy,
                  "accept while the draft equals argmax p; emit argmax p"))
register(RuleSpec(Rule.REJECTION, "REJECTION", True, True, False, RESIDUAL_P_MINUS_Q, (), _NO_TVD,
                  _accept_rejection, "accept w.p. min(1, p(x)/q(x)); exact where q is the proposal's law"))
register(RuleSpec(Rule.MATCH, "MATCH", True, False, False, RESIDUAL_P_WITHOUT_X, (), _NO_TVD, _accept_match,
                  "accept w.p. p(x); exact for any drafter"))
register(RuleSpec(Rule.EPS_TVD, "EPS_TVD", False, True, True, RESIDUAL_P_MINUS_Q, (Param("eps", 0.0, 1.0, 0.05),),
                  "min(eps, TV(p, q)) per decided position", _accept_eps_tvd,
                  "optimal lenient rule under a per-token TVD budget eps"))

# The lossy rule the policies choose for a row with a ``tvd=E`` quality target (eps = its leniency).
LENIENT_RULE = Rule.EPS_TVD


class _RuleSet(Set):
    """The ids of the rules in `RULES` for which ``pred(spec)`` holds, read live from the table."""

    def __init__(self, pred):
        self.pred = pred

    @classmethod
    def _from_iterable(cls, iterable):  # results of set operations are plain frozensets
        return frozenset(iterable)

    def _ids(self):
        return [rid for rid, spec in sorted(RULES.items()) if self.pred(spec)]

    def __contains__(self, rule) -> bool:
        try:
            spec = RULES.get(int(rule))
        except (TypeError, ValueError):
            return False
        return spec is not None and bool(self.pred(spec))

    def __iter__(self):
        return iter([_as_rule(rid) for rid in self._ids()])

    def __len__(self) -> int:
        return len(self._ids())

    def __repr__(self) -> str:
        return "{" + ", ".join(rule_name(r) for r in self._ids()) + "}"


def _as_rule(rid: int):
    """`Rule` member for a built-in id, the int for a registered one."""
    return Rule(rid) if rid in Rule._value2member_map_ else rid


EXACT_RULES = _RuleSet(lambda s: s.exact)
LOSSY_RULES = _RuleSet(lambda s: not s.exact)
NEEDS_DRAFT_PROBS = _RuleSet(lambda s: s.needs_q)
READS_Q_ROWS = _RuleSet(lambda s: s.reads_q_rows)


class _Defaults(Mapping):
    """(param, param2) defaults per rule id, read live from the table."""

    def __getitem__(self, rule):
        if rule not in self:
            raise KeyError(rule)
        return spec_of(rule).defaults

    def __contains__(self, rule):
        try:
            return int(rule) in RULES
        except (TypeError, ValueError):
            return False

    def __iter__(self):
        return iter([_as_rule(r) for r in sorted(RULES)])

    def __len__(self):
        return len(RULES)


# Default parameters (param, param2) of each rule; used by callers that only name a rule.
DEFAULT_PARAMS = _Defaults()


def spec_of(rule) -> RuleSpec:
    """The table row of a rule id or `Rule` (ValueError naming `rule` for an unknown id)."""
    spec = RULES.get(int(rule))
    if spec is None:
        raise ValueError(f"rule: unknown rule id {int(rule)} (known: {sorted(RULES)})")
    return spec


def rule_name(rule) -> str:
    """The rule's name ("EPS_TVD"), or its id as text where the table has no such rule."""
    spec = RULES.get(int(rule))
    return spec.name if spec is not None else str(int(rule))


def is_exact(rule: int) -> bool:
    """True for rules whose emitted tokens follow p exactly (given their preconditions)."""
    return int(rule) in EXACT_RULES


def parse_rule(name: str | int):
    """The rule (`Rule`, or the int id of a registered rule) from a name ("eps_tvd", "EPS_TVD")
    or an id; ValueError naming `rule` otherwise."""
    if isinstance(name, int) or (isinstance(name, str) and name.strip().isdigit()):
        value = int(name)
        if value in RULES:
            return _as_rule(value)
        raise ValueError(f"rule: unknown rule id {value} (expected one of {sorted(RULES)})")
    key = str(name).strip().upper().replace("-", "_")
    for rid, spec in RULES.items():
        if spec.name == key:
            return _as_rule(rid)
    names = ", ".join(s.name.lower() for s in RULES.values())
    raise ValueError(f"rule: unknown rule {name!r} (expected one of {names})")


def check_params(rule, param: float, param2: float = 0.0) -> None:
    """Host check of one rule's parameters against its row (ValueError naming the field)."""
    spec = spec_of(rule)
    for field, prm, value in zip(("param", "param2"), spec.params, (param, param2)):
        if not prm.ok(float(value)):
            raise ValueError(f"{field}: {spec.name} needs {prm.text()}, got {value!r}")


def bad_param_flags(rule, param, param2) -> list:
    """Per rule with parameters, a 0-d bool tensor: some row of that rule has a parameter out of
    its range (rule, param, param2 [B] on one device); with `bad_param_messages`' messages."""
    flags = []
    for rid, spec in sorted(RULES.items()):
        if spec.params:
            ok = spec.params[0].ok(param)
            if len(spec.params) > 1:
                ok = ok & spec.params[1].ok(param2)
            flags.append(((rule == rid) & ~ok).any())
    return flags


def bad_param_messages() -> list[tuple[str, str]]:
    """(field, message) for each flag of `bad_param_flags`, in its order."""
    return [("param", f"{spec.name} needs " + " and ".join(
                f"{p.text()} ({field})" for field, p in zip(("param", "param2"), spec.params)))
            for rid, spec in sorted(RULES.items()) if spec.params]


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
    """The exact rules' ids as an int32 tensor on ``device``, made once per device and table."""
    import torch

    key = (str(device), _VERSION[0])
    if key not in _EXACT_IDS:
        ids = sorted(int(rid) for rid, spec in RULES.items() if spec.exact)
        _EXACT_IDS[key] = torch.tensor(ids, dtype=torch.int32, device=device)
    return _EXACT_IDS[key]


def rule_ids(device):
    """[R] int32 the ids of every rule in the table, on ``device``."""
    import torch

    return torch.tensor(sorted(RULES), dtype=torch.int32, device=device)
