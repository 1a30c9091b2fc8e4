"""Triton kernels (run by the interpreter on CPU) against the torch references.

Tokens, accept counts and commit masks must be `torch.equal`; `tvd_spent` is compared with a
tight tolerance because vocabulary sums are accumulated in a different order (documented in
docs/kernels.md). A slow per-row Python loop checks the per-row assembly independently.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

from adapt.bench import gpu_check
from kernels import DEFAULT_PARAMS, NEEDS_DRAFT_PROBS, Rule, draw_noise, select_commit, verify
from kernels.reference import positions_reference
from kernels.layout import RaggedLayout
from kernels.verify import _per_target_row, use_triton

LOSSY_PARAMS = {Rule.EPS_TVD: (0.1, 0.0)}


def make_batch(ks, vocab, seed, temperature=1.0, greedy_rows=(), close=0.5):
    """A ragged batch (`adapt.bench.gpu_check.make_batch`, which the GPU check uses too) as the
    tuple x, cu, p, q, u, s: drafts drawn from q, q partly aligned with p, fresh coins and draw uniforms."""
    batch = gpu_check.make_batch(ks, vocab, seed, temperature, greedy_rows, close)
    return tuple(batch[k] for k in ("x", "cu", "p", "q", "u", "s"))


def rule_tensors(rules):
    rule = torch.tensor([int(r) for r in rules], dtype=torch.int32)
    prm = torch.tensor([LOSSY_PARAMS.get(r, DEFAULT_PARAMS[r])[0] for r in rules])
    prm2 = torch.tensor([LOSSY_PARAMS.get(r, DEFAULT_PARAMS[r])[1] for r in rules])
    return rule, prm, prm2


def both(x, cu, p, q, rule, prm, prm2, u, s, max_k, noise_rows=None):
    """The three backends on one batch: Triton (interpreted) and stop-first (reading the rules
    from the tensor, and given them from the host) against the reference."""
    ref = verify(x, cu, p, q, rule, prm, prm2, u, s, max_k, noise_rows=noise_rows, backend="torch")
    tri = verify(x, cu, p, q, rule, prm, prm2, u, s, max_k, noise_rows=noise_rows, backend="triton")
    first = verify(x, cu, p, q, rule, prm, prm2, u, s, max_k, noise_rows=noise_rows, backend="stop_first")
    # the engine's call: the rules present handed over from the host (one sweep over every row
    # where a single rule is present)
    hosted = verify(x, cu, p, q, rule, prm, prm2, u, s, max_k, noise_rows=noise_rows, backend="stop_first",
                    rules=rule.tolist())
    for out in (tri, first, hosted):
        assert torch.equal(ref.tokens, out.tokens)
        assert torch.equal(ref.num_accepted, out.num_accepted)
        torch.testing.assert_close(ref.tvd_spent, out.tvd_spent, atol=2e-6, rtol=1e-5)
    return ref


def _layout(x, cu, rule, prm, prm2):
    """Per-target-row inputs of the positions kernels (drafted token, draft index, rule, params)."""
    k = (cu[1:] - cu[:-1]).long()
    return _per_target_row(x, RaggedLayout.from_counts(k, x.shape[0]), rule, prm, prm2)


def loop_assemble(x, cu, accept, token, tvd, max_k):
    """Independent per-row assembly with Python loops (test only)."""
    tokens, counts, spent = [], [], []
    for r in range(cu.numel() - 1):
        lo, hi = int(cu[r]), int(cu[r + 1])
        a, out, s = 0, [], 0.0
        while a < hi - lo and bool(accept[lo + r + a]):
            out.append(int(x[lo + a]))
            s += float(tvd[lo + r + a])
            a += 1
        if a < hi - lo:
            s += float(tvd[lo + r + a])
        out.append(int(token[lo + r + a]))
        tokens.append(out + [-1] * (max_k + 1 - len(out)))
        counts.append(a)
        spent.append(s)
    return torch.tensor(tokens), torch.tensor(counts, dtype=torch.int32), torch.tensor(spent)


@pytest.mark.parametrize("with_q", [True, False])
def test_mixed_rules_ragged_k16(with_q):
    ks = [0, 16, 3, 16, 0, 7, 1, 16, 5, 12, 0, 9, 16, 2]
    rules = [Rule(i % len(Rule)) for i in range(len(ks))]
    if not with_q:
        rules = [Rule.MATCH if r in NEEDS_DRAFT_PROBS else r for r in rules]
    x, cu, p, q, u, s = make_batch(ks, vocab=1000, seed=1, greedy_rows=(7,))
    rule, prm, prm2 = rule_tensors(rules)
    out = both(x, cu, p, q if with_q else None, rule, prm, prm2, u, s, 16)
    acc, tok, tvd = positions_reference(*_layout(x, cu, rule, prm, prm2), u, p, q if with_q else None, s)
    want = loop_assemble(x, cu, acc, tok, tvd, 16)
    assert torch.equal(out.tokens, want[0]) and torch.equal(out.num_accepted, want[1])
    torch.testing.assert_close(out.tvd_spent, want[2].float(), atol=1e-6, rtol=1e-5)
    exact = torch.tensor([r in (Rule.GREEDY, Rule.REJECTION, Rule.MATCH) for r in rules])
    assert (out.tvd_spent[exact] == 0).all()
    assert (out.tokens >= -1).all() and (out.num_accepted <= torch.tensor(ks)).all()


@pytest.mark.parametrize("rule_id", list(Rule))
def test_each_rule_multi_block(rule_id):
    """Small vocabulary blocks (256) on a vocabulary that is not a multiple of the block."""
    from kernels.triton_verify import positions_triton
    ks = [4, 0, 16, 1, 9]
    x, cu, p, q, u, s = make_batch(ks, vocab=1000, seed=10 + int(rule_id), close=0.8)
    rule, prm, prm2 = rule_tensors([rule_id] * len(ks))
    lay = _layout(x, cu, rule, prm, prm2)
    ref = positions_reference(*lay, u, p, q, s)
    tri = positions_triton(*lay, u, p, q, s, block=256)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    torch.testing.assert_close(ref[2], tri[2], atol=2e-6, rtol=1e-5)


def test_ties_draw_edges_and_empty_residual():
    """Greedy ties -> lowest index across blocks; a draw at u = 0 takes the first entry of positive
    weight and one at the largest u < 1 the last, never a zero-weight entry, on every backend and
    across blocks; p == q (a residual without mass) falls back to p."""
    from kernels.triton_verify import positions_triton
    ks = [3, 2, 2]  # target rows: request 0 (GREEDY) 0-3, request 1 (REJECTION) 4-6, request 2 (EPS_TVD) 7-9
    x, cu, p, q, u, s = make_batch(ks, vocab=700, seed=3)
    p[0] = 0.0
    p[0, [650, 100, 400]] = 1 / 3                                       # tie in three blocks
    p[6, :350] = 0.0                                                    # bonus row of request 1
    p[6] /= p[6].sum()
    s[6] = 0.0                                                          # its draw at u = 0
    p[9, 420:] = 0.0                                                    # bonus row of request 2
    p[9, 419] = 0.01                                                    # a last entry of solid weight
    p[9] /= p[9].sum()
    s[9] = 1.0 - 2.0 ** -24                                             # its draw at the largest u < 1
    p[4] = q[3]                                                         # residual without mass
    p[5] = q[4]
    rule, prm, prm2 = rule_tensors([Rule.GREEDY, Rule.REJECTION, Rule.EPS_TVD])
    lay = _layout(x, cu, rule, prm, prm2)
    ref = positions_reference(*lay, u, p, q, s)
    tri = positions_triton(*lay, u, p, q, s, block=128)
    assert ref[1][0] == 100
    assert ref[1][6] == 350 and ref[1][9] == int(p[9].nonzero().max())
    assert p[4, ref[1][4]] > 0 and p[5, ref[1][5]] > 0
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])


def test_vocab_152k_small_batch():
    ks = [16, 0, 3]
    x, cu, p, q, u, s = make_batch(ks, vocab=151_936, seed=5, temperature=0.7, close=0.9)
    rule, prm, prm2 = rule_tensors([Rule.REJECTION, Rule.EPS_TVD, Rule.EPS_TVD])
    out = both(x, cu, p, q, rule, prm, prm2, u, s, 16)
    assert out.num_accepted[1] == 0 and out.tokens[1, 1:].eq(-1).all()


def test_greedy_rows_are_argmax_and_ignore_noise():
    ks = [5, 16, 0]
    x, cu, p, q, u, s = make_batch(ks, vocab=300, seed=7)
    rule, prm, prm2 = rule_tensors([Rule.GREEDY] * 3)
    x[: ks[0]] = p[: ks[0]].argmax(-1)                                   # row 0: all drafts right
    a = both(x, cu, p, None, rule, prm, prm2, u, s, 16)
    b = verify(x, cu, p, None, rule, prm, prm2, u, torch.rand_like(s), 16)
    assert torch.equal(a.tokens, b.tokens)
    assert a.num_accepted[0] == 5 and a.tokens[0, 5] == p[5].argmax()
    assert a.tokens[2, 0] == p[-1].argmax()


def test_empty_batch_and_no_drafts():
    x, cu, p, q, u, s = make_batch([0, 0], vocab=50, seed=2)
    rule, prm, prm2 = rule_tensors([Rule.MATCH, Rule.GREEDY])
    out = both(x, cu, p, None, rule, prm, prm2, u, s, 0)
    assert out.tokens.shape == (2, 1) and (out.num_accepted == 0).all()


def test_seeded_rows_do_not_depend_on_batch_companions():
    """Per-request generators: a row's output is the same alone and inside a batch."""
    vocab = 64
    x, cu, p, q, _u, _s = make_batch([5, 3, 0, 7], vocab=vocab, seed=6)
    rule, prm, prm2 = rule_tensors([Rule.REJECTION, Rule.EPS_TVD, Rule.MATCH, Rule.MATCH])
    gens = [torch.Generator().manual_seed(100 + r) for r in range(4)]
    u, s = (lambda n: (n.uniforms, n.sample_u))(draw_noise(gens, [5, 3, 0, 7]))
    full = both(x, cu, p, q, rule, prm, prm2, u, s, 16)
    # row 3 alone: drafts 8..14, target rows 11..18
    u3, s3 = (lambda n: (n.uniforms, n.sample_u))(draw_noise([torch.Generator().manual_seed(103)], [7]))
    alone = both(x[8:15], torch.tensor([0, 7], dtype=torch.int32), p[11:19].contiguous(),
                 q[8:15].contiguous(), rule[3:], prm[3:], prm2[3:], u3, s3, 16)
    assert torch.equal(alone.tokens[0], full.tokens[3])
    assert torch.equal(u3, u[8:15]) and torch.equal(s3, s[11:19])


def test_per_request_noise_rows():
    """`draw_noise` with rules: one noise row per request (no rule's accept reads its draw
    uniform; GREEDY rows get 0, nothing drawn); every backend reads the shared rows alike, a seeded row gives
    the same tokens alone and batched, and `verify` refuses noise row ids out of range."""
    vocab = 64
    ks = [5, 3, 0, 7, 2]
    x, cu, p, q, _u, _s = make_batch(ks, vocab=vocab, seed=9)
    rules = [Rule.REJECTION, Rule.MATCH, Rule.MATCH, Rule.EPS_TVD, Rule.GREEDY]
    rule, prm, prm2 = rule_tensors(rules)
    gens = [torch.Generator().manual_seed(200 + r) for r in range(5)]
    gens[4] = None
    n = draw_noise(gens, ks, rules=[int(r) for r in rules])
    assert n.sample_u.shape == (5,)
    assert n.noise_rows.tolist() == [0] * 6 + [1] * 4 + [2] + [3] * 8 + [4] * 3
    assert n.sample_u[4] == 0.0
    full = both(x, cu, p, q, rule, prm, prm2, n.uniforms, n.sample_u, 16, n.noise_rows)
    for r, rid in ((1, Rule.MATCH), (3, Rule.EPS_TVD)):  # each alone, from its own seed
        alone = draw_noise([torch.Generator().manual_seed(200 + r)], [ks[r]], rules=[int(rid)])
        assert alone.noise_rows is not None and alone.noise_rows.tolist() == [0] * (ks[r] + 1)
        lo, first = sum(ks[:r]), sum(ks[:r]) + r
        out = both(x[lo:lo + ks[r]], torch.tensor([0, ks[r]], dtype=torch.int32),
                   p[first:first + ks[r] + 1].contiguous(), q[lo:lo + ks[r]].contiguous(),
                   rule[r:r + 1], prm[r:r + 1], prm2[r:r + 1], alone.uniforms, alone.sample_u, 16, alone.noise_rows)
        assert torch.equal(out.tokens[0], full.tokens[r])
    with pytest.raises(ValueError, match="noise_rows"):
        verify(x, cu, p, q, rule, prm, prm2, n.uniforms, n.sample_u[:4].contiguous(), 16, noise_rows=n.noise_rows)


def test_stop_first_reads_q_over_the_draft_vocabulary():
    """`draft_ids`: q given over a draft vocabulary (here every third target id) gives every
    backend the outputs of the same q spread over the whole vocabulary; ids are checked."""
    vocab = 90
    ks = [4, 0, 6, 3]
    x, cu, p, _q, u, s = make_batch(ks, vocab=vocab, seed=21)
    ids = torch.arange(0, vocab, 3)                                     # [30] draft vocabulary
    g = torch.Generator().manual_seed(5)
    q_small = torch.softmax(3 * torch.randn(int(cu[-1]), ids.shape[0], generator=g), -1)   # [N, Vd]
    x = ids[torch.multinomial(q_small, 1, generator=g).squeeze(1)]       # drafts drawn from q
    q_full = torch.zeros(q_small.shape[0], vocab).index_copy_(1, ids, q_small)
    rule, prm, prm2 = rule_tensors([Rule.REJECTION, Rule.MATCH, Rule.EPS_TVD, Rule.EPS_TVD])
    ref = both(x, cu, p, q_full, rule, prm, prm2, u, s, 6)
    for backend in ("torch", "stop_first", "triton"):
        out = verify(x, cu, p, q_small, rule, prm, prm2, u, s, 6, backend=backend, draft_ids=ids)
        assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_accepted, ref.num_accepted)
        torch.testing.assert_close(out.tvd_spent, ref.tvd_spent, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="draft_ids"):
        verify(x, cu, p, q_small, rule, prm, prm2, u, s, 6, draft_ids=ids[:-1])
    with pytest.raises(ValueError, match="draft_ids"):
        verify(x, cu, p, q_small, rule, prm, prm2, u, s, 6, draft_ids=ids + vocab)


def test_q_rules_without_drafts_need_no_q():
    x, cu, p, q, u, s = make_batch([0, 3, 0], vocab=30, seed=8)
    rule, prm, prm2 = rule_tensors([Rule.REJECTION, Rule.MATCH, Rule.EPS_TVD])
    out = both(x, cu, p, None, rule, prm, prm2, u, s, 3)
    assert (out.num_accepted[[0, 2]] == 0).all()


def test_zero_rows():
    x, cu, p, q, u, s = make_batch([], vocab=20, seed=2)
    rule, prm, prm2 = rule_tensors([])
    out = both(x, cu, p, q, rule.to(torch.int32), prm, prm2, u, s, 4)
    assert out.tokens.shape == (0, 5) and out.num_accepted.shape == (0,)


def test_select_commit_equal():
    g = torch.Generator().manual_seed(0)
    for k in (1, 5, 16):
        conf = torch.rand(40, k, generator=g)
        conf[:, ::3] = 0.5                                              # ties
        masked = torch.rand(40, k, generator=g) > 0.3
        num = torch.randint(0, k + 2, (40,), generator=g).to(torch.int32)
        l2r = torch.rand(40, generator=g) > 0.5
        ref = select_commit(conf, masked, num, l2r, backend="torch")
        tri = select_commit(conf, masked, num, l2r, backend="triton")
        assert torch.equal(ref, tri)
        assert (ref <= masked).all()
        assert torch.equal(ref.sum(1), torch.minimum(num.long(), masked.sum(1)))
        for b in torch.nonzero(l2r).squeeze(1).tolist():               # leftmost masked ones
            chosen = masked[b].nonzero().squeeze(1)[: int(num[b])]
            assert set(chosen.tolist()) == set(ref[b].nonzero().squeeze(1).tolist())


def test_dispatch_env(monkeypatch):
    monkeypatch.setenv("ADAPT_FORCE_TRITON", "1")
    assert use_triton(torch.device("cpu"))
    monkeypatch.setenv("ADAPT_FORCE_TRITON", "0")
    assert not use_triton(torch.device("cpu"))


@pytest.mark.parametrize("field,mutate", [
    ("cu_num_draft", lambda a: a.update(cu=a["cu"].flip(0))),
    ("max_k", lambda a: a.update(max_k=2)),
    ("rule", lambda a: a.update(rule=torch.tensor([9, 0], dtype=torch.int32))),
    ("draft_probs", lambda a: a.update(q=None)),
    ("param", lambda a: a.update(prm=torch.tensor([1.5, 0.1]))),
    ("target_probs", lambda a: a.update(p=a["p"][:-1])),
    ("draft_tokens", lambda a: a.update(x=a["x"] + 10_000)),
    ("sample_u", lambda a: a.update(s=a["s"].double())),
])
def test_bad_input_names_field(field, mutate):
    x, cu, p, q, u, s = make_batch([3, 4], vocab=40, seed=4)
    args = dict(x=x, cu=cu, p=p, q=q, u=u, s=s, max_k=4,
                rule=torch.tensor([Rule.EPS_TVD, Rule.REJECTION], dtype=torch.int32),
                prm=torch.tensor([0.1, 0.0]), prm2=torch.zeros(2))
    mutate(args)
    with pytest.raises(ValueError, match=field):
        verify(args["x"], args["cu"], args["p"], args["q"], args["rule"], args["prm"], args["prm2"],
               args["u"], args["s"], args["max_k"])


def test_kernels_compile_for_cuda():
    """The kernels lower to a sm_90 cubin (no GPU needed), with IEEE division and no fast div."""
    import subprocess
    import sys

    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.triton_denoise import _select_commit_kernel
from kernels.triton_verify import _verify_positions_kernel
ptr = {"tok_ptr": "*i64", "draft_idx_ptr": "*i64", "rule_ptr": "*i32", "param_ptr": "*fp32",
       "param2_ptr": "*fp32", "u_ptr": "*fp32", "p_ptr": "*fp32", "q_ptr": "*fp32",
       "s_ptr": "*fp32", "noise_row_ptr": "*i64", "accept_ptr": "*i8", "token_ptr": "*i64", "tvd_ptr": "*fp32",
       "V": "i32", "HAS_Q": "constexpr", "BLOCK": "constexpr"}
target = GPUTarget("cuda", 90, 32)
for has_q in (True, False):
    k = triton.compile(ASTSource(_verify_positions_kernel, ptr, constexprs={"HAS_Q": has_q, "BLOCK": 2048}),
                       target=target, options={"num_warps": 8, "enable_fp_fusion": False})
    assert "div.rn.f32" in k.asm["ptx"] and "div.full" not in k.asm["ptx"]
sig = {"conf_ptr": "*fp32", "masked_ptr": "*i8", "num_ptr": "*i32", "l2r_ptr": "*i8",
       "out_ptr": "*i8", "K": "i32", "BLOCK_K": "constexpr"}
triton.compile(ASTSource(_select_commit_kernel, sig, constexprs={"BLOCK_K": 16}), target=target)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
