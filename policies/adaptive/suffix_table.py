"""Suffix acceptance tables: how likely each slot of a suffix draft (tokens copied from text a
request has seen, workers/suffix.py) is to be accepted, by its match length and vote share.

A *match length* is how many tokens before the copy matched the text it was copied from; a
token's *vote share* is the share of the draft's candidates that voted for it. The tables are
fitted on traces (adapt/suffix_fit.py); without one, ``m / (m + 3)`` for every token.
"""

from __future__ import annotations

import functools

import torch


def check_suffix_accept(table: dict | None, nested: bool = False) -> dict | None:
    """A fitted suffix acceptance table ``{"match": [m_0 < m_1 < ...], "accept": [c_0, c_1, ...],
    "first": [c₁_0, c₁_1, ...], "vote": [v_0 < v_1 < ...], "vote_scale": [s_0, s_1, ...],
    "sampled": {...}}`` checked (for match lengths >= m_i and < m_{i+1}: c₁_i the first drafted
    token's acceptance, c_i each later token's given the ones before it; without "first", c_i
    for every token: a geometric law; a token whose vote share is >= v_j and < v_{j+1} has its
    acceptance scaled by s_j, capped at 1; "sampled", optional: a table of the same form (without
    its own "sampled") for sampled rows, T > 0, the outer one then being for greedy rows:
    adapt/suffix_fit.py); None = the built-in ``m / (m + 3)``."""
    if table is None:
        return None
    where = "suffix_accept.sampled" if nested else "suffix_accept"
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected an object")
    match, accept, first = table.get("match"), table.get("accept"), table.get("first")
    vote, scale = table.get("vote"), table.get("vote_scale")
    if not (isinstance(match, list) and isinstance(accept, list) and match and len(match) == len(accept)):
        raise ValueError(f"{where}: expected {{'match': [...], 'accept': [...]}} of equal, non-zero length")
    if first is not None and not (isinstance(first, list) and len(first) == len(match)):
        raise ValueError(f"{where}: 'first' must be a list as long as 'match'")
    if any(b <= a for a, b in zip(match, match[1:])) or not all(0.0 <= c <= 1.0 for c in accept + (first or [])):
        raise ValueError(f"{where}: match must increase and accept (first) lie in [0, 1]")
    if (vote is None) != (scale is None):
        raise ValueError(f"{where}: 'vote' and 'vote_scale' come together")
    if vote is not None and not (isinstance(vote, list) and isinstance(scale, list) and vote and len(vote) == len(scale)
                                 and all(b > a for a, b in zip(vote, vote[1:]))
                                 and all(0.0 <= x <= 1.0 for x in vote + scale)):
        raise ValueError(f"{where}: 'vote' must increase within [0, 1] and 'vote_scale' (in [0, 1]) be as long")
    if nested and table.get("sampled") is not None:
        raise ValueError(f"{where}: a sampled table has no 'sampled' table of its own")
    out = {"match": [int(m) for m in match], "accept": [float(c) for c in accept]}
    if first is not None:
        out["first"] = [float(c) for c in first]
    if vote is not None:
        out["vote"], out["vote_scale"] = [float(v) for v in vote], [float(x) for x in scale]
    if table.get("sampled") is not None:
        out["sampled"] = check_suffix_accept(table["sampled"], nested=True)
    return out


def suffix_accept_of(table: dict | None, match: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B] first drafted token's acceptance, [B] each later token's) of suffix drafts with match
    lengths ``match`` [B]: slot ``j`` of a draft is accepted with probability ``c₁ · c^(j−1)``."""
    m = match.float()
    if table is None:
        c = m / (m + 3.0)
        return c, c
    idx = (torch.bucketize(m, _floats(table["match"]), right=True) - 1).clamp(min=0)
    later = _floats(table["accept"])[idx]
    first = _floats(table["first"])[idx] if "first" in table else later
    return first, later


def suffix_slot_accept(table: dict | None, match: torch.Tensor, vote: torch.Tensor | None, Ks: int,
                       sampled: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Ks] each slot's acceptance given the slots before it were accepted, for suffix drafts
    with match lengths ``match`` [B] and vote shares ``vote`` [B, Ks] (or None): ``c₁`` for the
    first slot, ``c`` for the later ones (`suffix_accept_of`), times the table's ``vote_scale`` of
    each slot's share (when both the table and ``vote`` have them), capped at 1. Rows with
    ``sampled`` [B] (T > 0) read the table's ``"sampled"`` table where it has one."""
    cond = _slot_accept(table, match, vote, Ks)
    if table is None or table.get("sampled") is None or sampled is None or not bool(sampled.any()):
        return cond
    return torch.where(sampled[:, None], _slot_accept(table["sampled"], match, vote, Ks), cond)


def suffix_draft_accept(table: dict | None, match: torch.Tensor, vote: torch.Tensor | None, n: torch.Tensor,
                        sampled: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Ks] the probability that slot j of each suffix draft is accepted (its first j slots
    all are: the running product of `suffix_slot_accept`), 0 past the draft's length ``n`` [B];
    ``Ks = max(n)``. Row sums: the tokens a draft verified at full length is expected to win."""
    Ks = int(n.max())
    cond = suffix_slot_accept(table, match, vote, Ks, sampled)                         # [B, Ks] given the slots before
    return cond.cumprod(1) * (torch.arange(Ks)[None] < n[:, None])


def _slot_accept(table: dict | None, match: torch.Tensor, vote: torch.Tensor | None, Ks: int) -> torch.Tensor:
    """`suffix_slot_accept` by one table (its own ``"sampled"`` table not read)."""
    c1, c = suffix_accept_of(table, match)                                             # [B], [B]
    first = torch.arange(Ks)[None] == 0                                                # [1, Ks]
    cond = torch.where(first, c1[:, None], c[:, None])                                 # [B, Ks]
    if vote is None or table is None or "vote" not in table:
        return cond
    idx = (torch.bucketize(vote.float().contiguous(), _floats(table["vote"]), right=True) - 1).clamp(min=0)  # [B, Ks]
    return (cond * _floats(table["vote_scale"])[idx]).clamp(max=1.0)


def _floats(values: list[float]) -> torch.Tensor:
    """A table column as a float32 tensor, made once per distinct column (every step reads them)."""
    return _float_tensor(tuple(values))


@functools.lru_cache(maxsize=64)
def _float_tensor(values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)
