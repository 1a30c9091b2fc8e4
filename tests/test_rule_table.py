"""The rule table (`kernels.rules.RULES`): a rule added through it alone reaches validation,
verification and reporting; the padded greedy verification agrees with the table's GREEDY rule.

The toy rule THRESHOLD is lossy: accept the draft x when p(x) >= t (no coin), else emit a draw
of p. Given x ~ q its output law is a(v) + (1 − Σa)·p(v) with a(v) = q(v)·1[p(v) >= t], so the
TVD it spends per decided position is ½ Σ_v |a(v) + (1 − Σa)·p(v) − p(v)|.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch
from scipy import stats

from kernels import RULES, Rule, verify, verify_greedy
from kernels.rules import (EXACT_RULES, LOSSY_RULES, NEEDS_DRAFT_PROBS, RESIDUAL_P, Param, RuleSpec, check_params,
                           enforce_rules, parse_rule, register, rule_name, unregister)

TOY = 7
VOCAB = 12
N = 100_000


def _accept_threshold(p, q, x, px, qx, u, prm, prm2):
    acc = px >= prm                                                      # [n]
    a = torch.where(p >= prm[:, None], q, torch.zeros((), device=p.device))  # [n, V] accepted mass
    law = a + (1 - a.sum(-1, keepdim=True)) * p
    return acc, 0.5 * (law - p).abs().sum(-1), None


@pytest.fixture
def toy_rule():
    spec = register(RuleSpec(TOY, "THRESHOLD", exact=False, reads_qx=False, reads_q_rows=True, residual=RESIDUAL_P,
                             params=(Param("threshold", 0.0, 1.0, 0.2, lo_open=True),),
                             tvd="½ Σ |a + (1 − Σa) p − p| per decided position", accept=_accept_threshold,
                             summary="accept x when p(x) >= threshold; else a draw of p"))
    yield spec
    unregister(TOY)


def _dists(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(VOCAB, generator=g), -1)
    q = torch.softmax(torch.randn(VOCAB, generator=g), -1)
    return p, q


def _run(p, q, rule, prm, n, seed, backend="auto", rules=None):
    """n rows with one draft each, drafted from q; p at both target rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(q, n, replacement=True, generator=g)           # [n]
    cu = torch.arange(0, n + 1, dtype=torch.int32)
    return verify(x, cu, p[None].repeat(2 * n, 1).contiguous(), q[None].repeat(n, 1).contiguous(),
                  torch.full((n,), int(rule), dtype=torch.int32), torch.full((n,), float(prm)), torch.zeros(n),
                  torch.rand(n, generator=g), torch.rand(2 * n, generator=g), 1, backend=backend, rules=rules)


def test_table_facts_are_read_live(toy_rule):
    assert TOY in LOSSY_RULES and TOY in NEEDS_DRAFT_PROBS and TOY not in EXACT_RULES
    assert parse_rule("threshold") == TOY and parse_rule(str(TOY)) == TOY and rule_name(TOY) == "THRESHOLD"
    assert sorted(int(r) for r in RULES) == [0, 1, 2, 3, TOY]
    check_params(TOY, 0.5)
    with pytest.raises(ValueError, match="param: THRESHOLD needs threshold in \\(0, 1\\]"):
        check_params(TOY, 0.0)
    # the engine's rule enforcement: lossless and T = 0 rows get their exact rule, others keep it
    rule, prm, _ = enforce_rules(torch.full((3,), TOY), torch.full((3,), 0.3), torch.zeros(3),
                                 torch.tensor([1.0, 1.0, 0.0]), torch.tensor([False, True, False]),
                                 torch.tensor([True, True, True]))
    assert rule.tolist() == [TOY, int(Rule.REJECTION), int(Rule.GREEDY)] and prm.tolist() == [pytest.approx(0.3), 0, 0]


def test_unregistered_rule_is_refused():
    assert TOY not in RULES
    p, q = _dists(0)
    with pytest.raises(ValueError, match="rule"):
        _run(p, q, TOY, 0.2, 4, seed=1)
    with pytest.raises(ValueError, match="rule"):
        parse_rule("threshold")


def test_toy_rule_validation_names_the_field(toy_rule):
    p, q = _dists(0)
    with pytest.raises(ValueError, match="param: THRESHOLD needs threshold"):
        _run(p, q, TOY, 1.5, 4, seed=1)
    x = torch.tensor([3])
    with pytest.raises(ValueError, match="draft_probs: required by rows with drafts under .*THRESHOLD"):
        verify(x, torch.tensor([0, 1], dtype=torch.int32), p[None].repeat(2, 1).contiguous(), None,
               torch.tensor([TOY], dtype=torch.int32), torch.tensor([0.2]), torch.zeros(1), torch.rand(1),
               torch.rand(2), 1)


def test_toy_rule_verifies_with_its_law_and_reports_its_tvd(toy_rule):
    """Reference and stop-first agree; the emitted tokens follow the law derived above (chi-square)
    and the reported TVD is that law's distance from p."""
    p, q = _dists(3)
    t = 0.12
    ref = _run(p, q, TOY, t, N, seed=4, backend="torch")
    first = _run(p, q, TOY, t, N, seed=4, backend="stop_first")
    assert torch.equal(ref.tokens, first.tokens) and torch.equal(ref.num_accepted, first.num_accepted)
    torch.testing.assert_close(ref.tvd_spent, first.tvd_spent, atol=1e-6, rtol=1e-5)
    a = torch.where(p >= t, q, 0.0).double()
    law = a + (1 - a.sum()) * p.double()
    want_tvd = 0.5 * float((law - p.double()).abs().sum())
    assert want_tvd > 0.01                                               # lossy here
    torch.testing.assert_close(ref.tvd_spent, torch.full((N,), want_tvd, dtype=torch.float32), atol=1e-5, rtol=1e-4)
    counts = torch.bincount(ref.tokens[:, 0], minlength=VOCAB).double()
    assert stats.chisquare(counts.numpy(), (law * N).numpy()).pvalue > 1e-4
    assert stats.chisquare(counts.numpy(), (p.double() * N).numpy()).pvalue < 1e-10  # and not p's


def test_toy_rule_without_triton_code(toy_rule, monkeypatch):
    """The Triton kernel branches per rule: a table-only rule is refused by the Triton backend and
    `backend="auto"` sends it to stop-first where the host names the rules."""
    from kernels.triton_verify import TRITON_RULES

    assert TOY not in TRITON_RULES
    p, q = _dists(5)
    with pytest.raises(ValueError, match="rule: a rule without Triton code"):
        _run(p, q, TOY, 0.2, 8, seed=6, backend="triton")
    monkeypatch.setenv("ADAPT_FORCE_TRITON", "1")
    auto = _run(p, q, TOY, 0.2, 8, seed=6, rules=[TOY])
    ref = _run(p, q, TOY, 0.2, 8, seed=6, backend="torch")
    assert torch.equal(auto.tokens, ref.tokens) and torch.equal(auto.tvd_spent, ref.tvd_spent)


def test_toy_rule_is_reported_by_name(toy_rule):
    from workers.decode_log import DecodeLog

    log = DecodeLog()
    log.record(1, 1, 3, TOY, 2)  # diffusion (code 1) in 1 pass
    assert log.summary()["rules"] == {"THRESHOLD": 1} and log.used()["rules_used"] == "THRESHOLD"


def test_padded_greedy_verification_equals_the_greedy_rule():
    """`verify_greedy` (engine all-greedy steps, training evaluator) against `verify` with the
    table's GREEDY rule on the same ragged batch, drafts partly equal to the argmax."""
    g = torch.Generator().manual_seed(11)
    B, K, V = 6, 5, 40
    k = torch.tensor([0, 5, 3, 5, 1, 2])
    p = torch.softmax(3 * torch.randn(B, K + 1, V, generator=g), -1)     # [B, K + 1, V]
    y = p.argmax(-1)                                                      # [B, K + 1]
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.7, y[:, :K], torch.randint(0, V, (B, K), generator=g))
    fast = verify_greedy(y, drafts, k)
    cu = torch.cat((torch.zeros(1, dtype=torch.int32), k.cumsum(0).to(torch.int32)))
    rows = torch.cat([torch.arange(int(kk) + 1) + b * (K + 1) for b, kk in enumerate(k)])
    flat = torch.cat([drafts[b, :int(kk)] for b, kk in enumerate(k)])
    ref = verify(flat, cu, p.reshape(-1, V)[rows].contiguous(), None, torch.zeros(B, dtype=torch.int32),
                 torch.zeros(B), torch.zeros(B), torch.rand(flat.shape[0]), torch.rand(rows.shape[0]), K,
                 backend="torch")
    assert torch.equal(fast.num_accepted, ref.num_accepted)
    assert torch.equal(fast.tokens, ref.tokens)
    assert int(fast.num_accepted.sum()) > 0 and (fast.num_accepted < k).any()


def test_toy_rule_through_the_engine(toy_rule, tmp_path):
    """A decision maker answering the toy rule: the engine enforces it (lossless rows get their
    exact rule), verifies it (stop-first on CPU: no Triton code), charges its TVD and names it
    in each request's stats."""
    from tests.tiny_models import make_tiny_pair, run_to_completion
    from workers.decisions import StaticDecisions, VerifyDecision
    from workers.engine import Engine, EngineConfig
    from workers.request import DecodeKnobs, SamplingParams

    class ToyDecisions(StaticDecisions):
        def after_draft(self, rows, intent, draft):
            dec = super().after_draft(rows, intent, draft)
            return VerifyDecision(draft_len=dec.draft_len, rule=torch.full_like(dec.rule, TOY),
                                  param=torch.full_like(dec.param, 0.05), param2=dec.param2)

    target, drafter = make_tiny_pair(tmp_path)
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=4, max_len=128),
                    decisions=ToyDecisions())
    adds = [(f"r{i}", list(range(5 + i, 17 + i)), SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True),
             DecodeKnobs(steps=1, draft_len=4, quality=quality, commit_order="left-to-right"))
            for i, quality in enumerate(("tvd=0.2", "lossless", "tvd=0.2"))]
    outs = run_to_completion(engine, adds)
    stats = {rid[: -len(":stats")]: s for rid, s in outs.items() if rid.endswith(":stats")}
    assert sorted(stats) == ["r0", "r1", "r2"] and all(s["tokens"] == 12 for s in stats.values())
    assert stats["r1"]["tvd_spent"] == 0.0
    lenient = [s for rid, s in stats.items() if rid != "r1"]
    assert any(s["tvd_spent"] > 0 for s in lenient)
    assert [stats[r]["rules_used"] for r in ("r0", "r1", "r2")] == ["THRESHOLD", "REJECTION", "THRESHOLD"]
