"""Statistical tests of the acceptance rules (torch reference; the kernels are equal to it).

- exact rules (REJECTION, MATCH) reproduce the target distribution at every position
  (chi-square at >= 1e5 samples, several temperatures and top-p settings), and the same
  statistic rejects a sampler that is known to be biased (REJECTION with a wrong q);
- EPS_TVD spends min(eps, TV(p, q)) per position, its empirical TVD stays <= eps and its
  acceptance rate is min(1, 1 - TV + eps);
- a lossy rule added through the rule table reports the TVD its output distribution shows
  (tests/test_rule_table.py).

Seeds are fixed and the significance level is 1e-4, so a pass is reproducible and a real bias
(which gives p-values far below 1e-10 at these sample sizes) still fails.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from kernels import Rule, verify

N = 200_000
ALPHA = 1e-4
VOCAB = 12


def target_dist(seed, temperature, top_p):
    """p after temperature and top-p (nucleus) filtering, from random logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g) * 1.5
    p = (logits / temperature).softmax(-1)
    sorted_p, order = p.sort(descending=True)
    keep_sorted = (sorted_p.cumsum(0) - sorted_p) < top_p                # smallest nucleus >= top_p
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[order[keep_sorted]] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def draft_dist(seed, spread=1.0):
    g = torch.Generator().manual_seed(seed + 1000)
    return (torch.randn(VOCAB, generator=g) * spread).softmax(-1)


def exp_noise(shape, g):
    """Exp(1) noise by inversion (-log(1 - U)), for drawing drafts from q by the exponential race
    (faster than exponential_ on CPU)."""
    return torch.rand(shape, generator=g).neg_().log1p_().neg_()


def run(ps, qs, rule, prm=0.0, prm2=0.0, n=N, seed=0, sampling_qs=None, per_request_noise=False):
    """n identical rows with k = len(qs) drafts; p per target row (ps [k+1, V]), q per draft.

    Drafts are drawn from `sampling_qs` (defaults to qs, the q handed to the rule).
    `per_request_noise`: one draw uniform per request shared by its k + 1 target rows
    (`kernels.noise`; allowed for rules whose accept does not read it).
    """
    g = torch.Generator().manual_seed(seed)
    k = qs.shape[0]
    sampling_qs = qs if sampling_qs is None else sampling_qs
    p = ps.repeat(n, 1).contiguous()                                    # [n (k+1), V]
    q = qs.repeat(n, 1).contiguous()                                    # [n k, V]
    e_draft = exp_noise((n * k, VOCAB), g)
    x = (sampling_qs.repeat(n, 1) / e_draft).argmax(-1)                # drafts ~ sampling_qs
    cu = torch.arange(0, n * k + 1, k, dtype=torch.int32)
    rows = torch.arange(n).repeat_interleave(k + 1) if per_request_noise else None
    out = verify(x, cu, p, q, torch.full((n,), int(rule), dtype=torch.int32),
                 torch.full((n,), float(prm)), torch.full((n,), float(prm2)),
                 torch.rand(n * k, generator=g), torch.rand(n if per_request_noise else n * (k + 1), generator=g), k,
                 noise_rows=rows)
    return out


def counts(tokens):
    return torch.bincount(tokens, minlength=VOCAB).double()


def chi2_pvalue(c, probs):
    """Chi-square goodness of fit of counts c to probs; cells with probs == 0 must be empty."""
    probs = probs.double()
    assert c[probs == 0].sum() == 0, "emitted a token with zero probability"
    live = probs > 0
    if live.sum() < 2:
        return 1.0
    expected = c.sum() * probs[live] / probs[live].sum()
    return float(stats.chisquare(c[live].numpy(), expected.numpy()).pvalue)


def tv(a, b):
    return 0.5 * float((a.double() - b.double()).abs().sum())


@pytest.mark.parametrize("rule,per_request_noise", [(Rule.REJECTION, False), (Rule.REJECTION, True), (Rule.MATCH, False)])
@pytest.mark.parametrize("temperature,top_p", [(0.5, 1.0), (1.0, 1.0), (1.5, 1.0), (1.0, 0.8), (0.7, 0.6)])
def test_exact_rules_reproduce_target(rule, per_request_noise, temperature, top_p):
    """Exact rules emit p at every position; REJECTION also with one noise row per request (the
    engine's layout: its accept reads only the coins, the noise only where the row stops)."""
    ps = torch.stack([target_dist(s, temperature, top_p) for s in (1, 2, 3)])    # [3, V]
    qs = torch.stack([0.5 * draft_dist(s) + 0.5 * ps[i] for i, s in enumerate((1, 2))])  # [2, V]
    qs[1] = 0.5 * draft_dist(2)[None] + 0.5 * ps[2]                            # a drafter off by one
    out = run(ps, qs, rule, seed=int(temperature * 10) + int(top_p * 100) + per_request_noise,
              per_request_noise=per_request_noise)
    a = out.num_accepted
    assert torch.equal(out.tvd_spent, torch.zeros(N))
    assert chi2_pvalue(counts(out.tokens[:, 0]), ps[0]) > ALPHA
    assert chi2_pvalue(counts(out.tokens[a >= 1, 1]), ps[1]) > ALPHA
    assert chi2_pvalue(counts(out.tokens[a >= 2, 2]), ps[2]) > ALPHA          # bonus position
    assert (a >= 1).sum() > N // 50 and (a >= 2).sum() > N // 500


def test_rejection_with_a_truncated_drafter():
    """q supported on 4 tokens only: the residual alone must supply the rest of p."""
    p = target_dist(9, 1.0, 1.0)
    q = torch.zeros(VOCAB)
    q[p.argsort(descending=True)[:4]] = torch.tensor([0.5, 0.1, 0.3, 0.1])
    out = run(p[None].repeat(2, 1), q[None], Rule.REJECTION, seed=12)
    assert chi2_pvalue(counts(out.tokens[:, 0]), p) > ALPHA


def test_rejection_acceptance_rate_is_one_minus_tv():
    p, q = target_dist(4, 1.0, 1.0), draft_dist(4)
    out = run(p[None].repeat(2, 1), q[None], Rule.REJECTION, seed=7)
    beta = 1 - tv(p, q)
    rate = out.num_accepted.double().mean().item()
    assert abs(rate - beta) < 5 * (beta * (1 - beta) / N) ** 0.5


def test_goodness_of_fit_detects_a_biased_sampler():
    """Rejection sampling told the wrong q (not the law the drafts came from) is biased: caught."""
    p, q = target_dist(5, 1.0, 1.0), draft_dist(5)
    wrong = (q.log() * 2).softmax(-1)                                   # drafts come from q^2
    out = run(p[None].repeat(2, 1), q[None], Rule.REJECTION, seed=8, sampling_qs=wrong[None])
    assert chi2_pvalue(counts(out.tokens[:, 0]), p) < 1e-10


def eps_output_law(p, q, eps):
    """p moved toward q by min(eps, TV): the law the EPS_TVD rule emits (derived independently)."""
    gap = p - q
    total = gap.clamp_min(0).sum()
    m = min(eps, float(total))
    return p - m * gap.clamp_min(0) / total + m * (-gap).clamp_min(0) / total


@pytest.mark.parametrize("eps", [0.0, 0.05, 0.2, 0.6])
def test_eps_tvd_budget(eps):
    p, q = target_dist(6, 1.0, 0.9), draft_dist(6)
    tv_pq = tv(p, q)
    out = run(p[None].repeat(2, 1), q[None], Rule.EPS_TVD, prm=eps, seed=9)
    spent = min(eps, tv_pq)
    torch.testing.assert_close(out.tvd_spent, torch.full((N,), spent, dtype=torch.float32),
                               atol=1e-6, rtol=1e-5)
    emitted = counts(out.tokens[:, 0])
    empirical = tv(emitted / N, p)
    assert empirical <= eps + 0.01
    assert abs(empirical - spent) < 0.01
    law = eps_output_law(p.double(), q.double(), eps)
    assert abs(tv(law, p) - spent) < 1e-6
    assert chi2_pvalue(emitted, law) > ALPHA
    beta = min(1.0, 1 - tv_pq + eps)
    rate = out.num_accepted.double().mean().item()
    assert abs(rate - beta) < 5 * max(beta * (1 - beta), 1e-6) ** 0.5 / N ** 0.5 + 1e-6


def test_eps_tvd_sums_over_decided_positions():
    ps = torch.stack([target_dist(s, 1.0, 1.0) for s in (11, 12, 13, 14)])
    qs = torch.stack([0.6 * draft_dist(s) + 0.4 * ps[i] for i, s in enumerate((11, 12, 13))])
    eps = 0.1
    out = run(ps, qs, Rule.EPS_TVD, prm=eps, n=20_000, seed=10)
    per_pos = torch.tensor([min(eps, tv(ps[j], qs[j])) for j in range(3)])
    decided = torch.arange(3)[None, :] <= out.num_accepted[:, None].long()      # [n, 3]
    want = (decided * per_pos[None, :]).sum(1).float()
    torch.testing.assert_close(out.tvd_spent, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rule,prm,prm2", [(Rule.EPS_TVD, 0.1, 0.0)])
def test_lenient_rules_on_greedy_rows(rule, prm, prm2):
    """T = 0 (one-hot p): EPS_TVD spends min(eps, 1 - q(argmax))."""
    best = 3
    p = torch.nn.functional.one_hot(torch.tensor(best), VOCAB).float()
    q = draft_dist(30)
    out = run(p[None].repeat(2, 1), q[None], rule, prm, prm2, n=50_000, seed=31)
    first = out.tokens[:, 0]
    if rule == Rule.EPS_TVD:
        m = min(prm, 1 - float(q[best]))
        torch.testing.assert_close(out.tvd_spent, torch.full_like(out.tvd_spent, m), atol=1e-6, rtol=1e-5)
        off = (first != best).double().mean().item()
        assert abs(off - m) < 5 * (m * (1 - m) / 50_000) ** 0.5
    else:
        assert (first == best).all()
        assert float(out.tvd_spent.abs().max()) < 1e-6
