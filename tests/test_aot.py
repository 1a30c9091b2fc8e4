"""Ahead-of-time compiled decode packages (workers/aot.py, `compile="aot"`, `adapt compile`).

One set of packages (the target's decode forward, the drafter's denoising pass and its context
commit) is built per module for a tiny fp32 pair (AOTInductor compiles them: most of this file's time), in a temporary
cache directory. Greedy decoding through it is token for token the target's
own (plain transformers), for rows that draft and rows that do not, one row and several, joining
mid-run; a second engine loads the package without building; an engine of another shape finds no
package and, told not to build, decodes eagerly; the CLI builds, lists and clears packages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_engine import greedy_reference
from tests.tiny_models import make_tiny_pair, run_to_completion, single_thread
from workers.aot import (MIN_BLOCK, ONE_ROW_TOKENS, AotContextWrite, AotDraftPass, AotTarget, aot_draft_pass,
                         aot_one_row)
from workers.package_loader import load_package
from workers.package_cache import list_packages, package_dir
from workers.engine import PENDING_WINDOW, Engine, EngineConfig
from workers.kv_cache import KVCache
from workers.request import DecodeKnobs, SamplingParams

MAX_TOKENS = 20
PROMPTS = [[5, 3, 7], list(range(2, 12)), [9, 1, 4, 4, 2, 8]]  # greedy decoding checks: three rows of unequal lengths

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(target dir, drafter dir, cache dir, an fp32 engine of 3 rows whose package it built)."""
    cache = tmp_path_factory.mktemp("cache")
    target, drafter = make_tiny_pair(tmp_path_factory.mktemp("pair"), vocab=16, seed=5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADAPT_CACHE_DIR", str(cache))
        engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=3, max_len=96,
                                     compile="aot"))
    return target, drafter, cache, engine


def test_the_engine_builds_its_package_and_decodes_through_it(built):
    target, drafter, cache, engine = built
    info = engine.backend.info
    assert engine.backend.name == "aot" and isinstance(engine.target_forward, AotTarget)
    assert info["built"] and info["build_s"] > 0 and info["key"] in info["path"]
    assert info["path"].startswith(str(package_dir(cache)))
    assert not engine.pack  # verification is padded: the program runs it whole
    assert engine.pack_prefill  # prefills run eagerly: packed (the greedy tests prefill unequal prompts together)
    pkg, draft, context = list_packages(cache)
    assert pkg["kind"] == "decode" and draft["kind"] == "draft" and context["kind"] == "context"
    assert pkg["cache_shape"][0] == 3 and pkg["tmax"] == engine.block + 1 and pkg["capture"] == list(engine.capture)
    assert isinstance(engine.drafting.program, AotDraftPass) and info["drafter"]["path"] == draft["path"]
    assert draft["cache_shape"][0] == 3 and draft["qmax"] == engine.block + 1 and info["drafter"]["built"]
    assert isinstance(engine.drafting.writer, AotContextWrite) and info["context"]["path"] == context["path"]
    assert context["pmax"] == PENDING_WINDOW and context["width"] == engine.drafting.pending.shape[-1]


class _Row:
    """What `DrafterContext.flush` reads of a running request."""

    def __init__(self, ctx_len: int, length: int):
        self.ctx_len, self.length = ctx_len, length


def test_the_context_package_writes_the_eager_commit(built):
    """`flush` through the program writes the drafter-context K/V the eager commit writes, for
    one row, a slice of rows at one start, and scattered rows at their own starts (padding past
    a row's own count included), and marks the rows committed."""
    _, _, _, engine = built
    d = engine.drafting
    writer, gen = d.writer, torch.Generator().manual_seed(4)
    cases = [([(10, 13)], [0]), ([(7, 12), (7, 9), (7, 8)], [0, 1, 2]), ([(20, 21), (5, 5), (31, 40)], [0, 2]),
             ([(3, 3), (0, PENDING_WINDOW)], [1])]
    for spans, idx in cases:
        d.pending.normal_(generator=gen)
        written = []
        for use in (None, writer):
            for t in (*d.cache.k, *d.cache.v):
                t.zero_()
            rows = [_Row(a, b) for a, b in spans]
            d.writer = use
            calls = writer.calls
            d.flush(rows, idx)
            assert writer.calls == calls + (use is not None)
            assert all(r.ctx_len == r.length for i, r in enumerate(rows) if i in idx)
            written.append([t.clone() for t in (*d.cache.k, *d.cache.v)])
        d.writer = writer
        for i in idx:  # each flushed row's own positions [ctx_len, length)
            a, b = spans[i]
            for eager, program in zip(*written):
                torch.testing.assert_close(program[i, :, a:b], eager[i, :, a:b], rtol=1e-4, atol=1e-4)
    assert writer.fits(3, PENDING_WINDOW) and not writer.fits(4, 1) and not writer.fits(1, PENDING_WINDOW + 1)


def test_the_drafter_package_computes_the_eager_pass(built):
    """The program's logits for one denoising pass over the cache equal the eager pass's, and it
    writes the block's keys and values into the cache as the eager pass does."""
    _, _, _, engine = built
    drafter, dc, program = engine.drafter, engine.dcache, engine.drafting.program
    gen = torch.Generator().manual_seed(3)
    for B, Q, W in ((1, 5, 12), (3, MIN_BLOCK, 40), (2, engine.block + 1, 60)):
        assert program.fits(B, Q, W)
        for t in (*dc.k, *dc.v):
            t.normal_(generator=gen)
        tokens = torch.randint(0, engine.vocab, (B, Q), generator=gen)
        masked = torch.rand(B, Q, generator=gen) < 0.7
        masked[:, 0] = False
        mask = torch.zeros(B, 1, W)
        mask[0, 0, 1:4] = float("-inf")  # row 0 does not see three context columns
        cos, sin = drafter.rope(torch.arange(W - Q, W).expand(B, Q), torch.float32, bound=dc.max_len)
        got = program(tokens, masked, mask, cos, sin)
        written = [t[:B, :, W - Q : W].clone() for t in (*dc.k, *dc.v)]
        want = drafter.block_logits(tokens, masked, dc.views(0, B, W), mask, cos, sin)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, t in zip(written, (*dc.k, *dc.v)):
            torch.testing.assert_close(a, t[:B, :, W - Q : W], rtol=1e-4, atol=1e-4)
    assert not program.fits(1, MIN_BLOCK - 1, 20)  # a block of two positions: the eager pass
    assert not program.fits(4, 5, 20) and not program.fits(1, 5, dc.max_len)


def test_the_drafter_package_writes_only_its_rows_slots(built, tmp_path):
    """A pass over the first B slots leaves every slot past them as it was, bit for bit, also for
    a package exported at B = its cache's slots (2: given the whole cache as input, such a program
    wrote non-finite block columns into slot 1 on one-row passes; a request admitted there later
    drafted NaN laws), and its logits are the eager pass's."""
    _, _, _, engine = built
    drafter = engine.drafter
    cache = KVCache(len(engine.dcache.k), 2, engine.dcache.k[0].shape[1], engine.dcache.max_len,
                    engine.dcache.k[0].shape[3], dtype=torch.float32)
    program, info = aot_draft_pass(drafter, cache, engine.block + 1, cache_dir=tmp_path)
    assert info["built"]
    gen = torch.Generator().manual_seed(8)
    for B, Q, W in ((1, 5, 20), (1, MIN_BLOCK, 9), (2, engine.block + 1, 50), (1, engine.block + 1, 70)):
        for t in (*cache.k, *cache.v):
            t.normal_(generator=gen)
        before = [t.clone() for t in (*cache.k, *cache.v)]
        tokens = torch.randint(0, engine.vocab, (B, Q), generator=gen)
        masked = torch.ones(B, Q, dtype=torch.bool)
        masked[:, 0] = False
        mask = torch.zeros(B, 1, W)
        cos, sin = drafter.rope(torch.arange(W - Q, W).expand(B, Q), torch.float32, bound=cache.max_len)
        got = program(tokens, masked, mask, cos, sin)
        for a, t in zip(before, (*cache.k, *cache.v)):
            assert torch.equal(a[B:], t[B:])  # the slots past the pass's rows
            assert torch.equal(a[:B, :, : W - Q], t[:B, :, : W - Q])  # its rows' context
        want = drafter.block_logits(tokens, masked, cache.views(0, B, W), mask, cos, sin)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_decoding_through_the_package_is_the_targets_own(built):
    target, drafter, cache, engine = built
    prompts, params = PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = greedy_reference(target, prompts, MAX_TOKENS)
    knobs = [DecodeKnobs(steps=1, draft_len=0), DecodeKnobs(steps=2, draft_len=4), DecodeKnobs(steps=1, draft_len=16)]
    before, passes, writes = dict(engine.target_forward.calls), engine.drafting.program.calls, engine.drafting.writer.calls
    for i, (p, kn) in enumerate(zip(prompts, knobs)):  # one row at a time
        got = run_to_completion(engine, [(f"one{i}", p, params, kn)])
        assert got[f"one{i}"] == want[i], kn
    # three rows, each with its own knobs, the last joining after 4 steps
    adds = [(f"many{i}", p, params, kn) for i, (p, kn) in enumerate(zip(prompts, knobs))]
    got = run_to_completion(engine, adds, join_after={"many2": 4})
    assert [got[f"many{i}"] for i in range(3)] == want
    calls = engine.target_forward.calls
    assert calls["program"] - before["program"] > 3 * MAX_TOKENS // 2  # the decode steps ran the program
    assert calls["eager"] - before["eager"] <= 6  # prefills
    assert engine.drafting.program.calls - passes > MAX_TOKENS // 4  # one-row passes ran the drafter's program
    assert engine.drafting.writer.calls - writes > MAX_TOKENS // 4  # context commits ran their program


def test_padded_calls_return_what_unpadded_calls_return(built):
    """A call padded to more tokens per row (`AotTarget.pad`) gives the logits and hidden states
    of its real positions as the unpadded call does; calibration reports every candidate shape."""
    _, _, _, engine = built
    aot, cache = engine.target_forward, engine.tcache
    gen = torch.Generator().manual_seed(6)
    for t in (*cache.k, *cache.v):
        t.normal_(generator=gen)
    saved = dict(aot.pad)
    try:
        for B, T, T2 in ((1, 1, 4), (1, 2, 3), (2, 1, 2), (3, 1, 2)):
            ids = torch.randint(0, engine.vocab, (B, T), generator=gen)
            start = torch.tensor([20, 23, 17][:B])
            outs = []
            for pad in ({}, {(B, T): T2}):
                aot.pad = pad
                logits, hidden = aot(ids, start, cache, 0, 23 + T, start_value=None)
                outs.append((logits.clone(), hidden.clone()))
            assert outs[1][0].shape == (B, T, engine.vocab) and outs[1][1].shape == outs[0][1].shape
            torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)
        report = aot.calibrate_padding(reps=2)
        assert set(report) == {"1x1", "1x2", "1x3", "2x1", "3x1"}
        assert all(len(v) == 3 and v[0] > 0 and v[1] > 0 for v in report.values())
        assert set(aot.pad) == {tuple(int(x) for x in k.split("x")) for k, v in report.items() if v[2]}
    finally:
        aot.pad = saved


def test_greedy_decoding_through_padded_calls_is_the_targets_own(built):
    target, _, _, engine = built
    prompts, params = PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = greedy_reference(target, prompts, MAX_TOKENS)
    knobs = [DecodeKnobs(steps=1, draft_len=0), DecodeKnobs(steps=2, draft_len=1), DecodeKnobs(steps=1, draft_len=2)]
    saved, engine.target_forward.pad = engine.target_forward.pad, {(1, 1): 4, (1, 2): 4, (1, 3): 4, (2, 1): 2,
                                                                   (2, 2): 3, (3, 1): 2}
    try:
        adds = [(f"pad{i}", p, params, kn) for i, (p, kn) in enumerate(zip(prompts, knobs))]
        got = run_to_completion(engine, adds, join_after={"pad2": 4})
        assert [got[f"pad{i}"] for i in range(3)] == want
        for i, (p, kn) in enumerate(zip(prompts, knobs)):  # one row at a time: 1 x 1, 1 x 2, 1 x 3 padded
            assert run_to_completion(engine, [(f"one{i}", p, params, kn)])[f"one{i}"] == want[i]
    finally:
        engine.target_forward.pad = saved


def test_the_one_row_program_keeps_its_verdict_and_decodes_as_the_target(built, monkeypatch):
    """`aot_one_row` builds the one-row program (inductor's GEMM template offered), times it
    against the decode package once and keeps the verdict in its facts file; a second load reads
    the verdict and times nothing. With every token count sent to it, one-row calls return the
    package's logits and greedy decoding of one row through it is the target's own."""
    target, _, cache, engine = built
    aot = engine.target_forward
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(cache))
    saved = (aot.one_row, aot.one_row_tokens)
    try:
        info = aot_one_row(aot, engine.backend.info["weights"])
        verdict = info["verdict"]
        assert info["built"] and Path(info["path"]).name.startswith("onerow-")
        assert set(verdict["ms"]) == {str(t) for t in range(1, min(ONE_ROW_TOKENS, aot.tmax) + 1)}
        assert all(a > 0 and b > 0 for a, b in verdict["ms"].values())
        assert aot.one_row_tokens == set(verdict["tokens"]) and (aot.one_row is not None) == bool(verdict["tokens"])
        facts = json.loads(Path(info["path"]).with_suffix(".json").read_text())
        assert facts["verdict"] == verdict and facts["rows"] == 1 and facts["tmax"] == ONE_ROW_TOKENS
        assert any(p["kind"] == "onerow" for p in list_packages(cache))
        monkeypatch.setattr(AotTarget, "time_one_row", lambda *a, **k: pytest.fail("the verdict was measured again"))
        again = aot_one_row(aot, engine.backend.info["weights"])
        assert not again["built"] and again["verdict"] == verdict

        aot.use_one_row(load_package(info["path"]), range(1, ONE_ROW_TOKENS + 1))
        gen = torch.Generator().manual_seed(8)
        for t in (*engine.tcache.k, *engine.tcache.v):
            t.normal_(generator=gen)
        for T in (1, 2, ONE_ROW_TOKENS):
            ids, start = torch.randint(0, engine.vocab, (1, T), generator=gen), torch.tensor([21])
            outs = []
            for tokens in (frozenset(), frozenset(range(1, ONE_ROW_TOKENS + 1))):
                aot.one_row_tokens = tokens
                logits, hidden = aot(ids, start, engine.tcache, 0, 21 + T)
                outs.append((logits.clone(), hidden.clone()))
            torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)
        want = greedy_reference(target, PROMPTS, MAX_TOKENS)
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        knobs = [DecodeKnobs(steps=1, draft_len=0), DecodeKnobs(steps=1, draft_len=2), DecodeKnobs(steps=1, draft_len=16)]
        for i, (p, kn) in enumerate(zip(PROMPTS, knobs)):  # one row at a time: one-token steps, 3-token verifies
            assert run_to_completion(engine, [(f"onerow{i}", p, params, kn)])[f"onerow{i}"] == want[i], kn
    finally:
        aot.one_row, aot.one_row_tokens = saved
        for f in package_dir(cache).glob("onerow-*"):  # the other tests count this cache's packages
            f.unlink()


def test_a_second_engine_loads_the_package_without_building(built, monkeypatch):
    target, drafter, cache, engine = built
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(cache))
    again = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=3, max_len=96,
                                compile="auto"))
    first, info = engine.backend.info, again.backend.info
    assert again.backend.name == "aot" and again.backend.label == "aot+drafter" and not again.backend.builds
    assert not info["built"] and info["path"] == first["path"]
    assert info["drafter"] == {**first["drafter"], "built": False, "build_s": 0.0, "load_s": info["drafter"]["load_s"]}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = run_to_completion(engine, [("a", [4, 2, 6], params, DecodeKnobs(draft_len=4))])
    b = run_to_completion(again, [("a", [4, 2, 6], params, DecodeKnobs(draft_len=4))])
    assert a["a"] == b["a"]


def test_a_process_that_exits_without_cleanup_leaves_no_extracted_package(built, tmp_path):
    """torch's loader extracts a package under $TMPDIR and removes the copy only when the loader
    is destroyed; `load_package` removes it right after loading, so a process that ends with
    ``os._exit`` (as a stopped Ray worker does) leaves nothing behind, and the runner it loaded
    still computes (every test here decodes through packages loaded the same way). Before
    `test_adapt_compile_builds_lists_and_clears`, which removes the packages."""
    import os
    import subprocess
    import sys

    _, _, cache, engine = built
    script = ("import os, sys, torch\n"
              "from workers.package_loader import load_package\n"
              "runner = load_package(sys.argv[1])\n"
              "os._exit(0)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script, engine.backend.info["context"]["path"]], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(("aotinductor_", "adapt-package-"))]


def test_without_a_package_auto_decodes_eagerly_and_builds_nothing(built, monkeypatch):
    target, drafter, cache, _ = built
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(cache))
    other = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=2, max_len=96,
                                compile="auto"))  # another shape: its package is not built
    assert other.backend.name == "eager" and other.backend.info == {}  # the missing package's fallback
    assert not isinstance(other.target_forward, AotTarget)
    assert other.pack and other.drafting.program is None and other.drafting.writer is None  # eager CPU engines pack their verification
    assert len(list_packages(cache)) == 3
    out = run_to_completion(other, [("e", [5, 3, 7], SamplingParams(max_tokens=6, ignore_eos=True), DecodeKnobs())])
    assert len(out["e"]) == 6


def test_calls_the_program_cannot_take_run_eagerly(built):
    """Prefills, packed verification and windows reaching the cache's end are the eager forward's."""
    _, _, _, engine = built
    aot = engine.target_forward
    ids = torch.zeros(1, 2, dtype=torch.long)
    cache = engine.tcache
    assert aot.fits(ids, cache, 0, 10, None, None)
    assert not aot.fits(ids, cache, 0, 10, torch.zeros(1, 1, dtype=torch.long), None)  # a prefill
    assert not aot.fits(ids, cache, 0, 10, None, torch.arange(2))  # packed
    assert not aot.fits(ids, cache, 1, 10, None, None)  # another first row
    assert not aot.fits(ids, cache, 0, aot.length, None, None)  # the window reaches the end
    assert not aot.fits(torch.zeros(1, aot.tmax + 1, dtype=torch.long), cache, 0, 40, None, None)
    assert not aot.fits(torch.zeros(4, 1, dtype=torch.long), cache, 0, 10, None, None)  # more rows than built for


def test_adapt_compile_builds_lists_prunes_and_clears(built, monkeypatch, capsys):
    from adapt.cli import main

    target, drafter, cache, engine = built
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(cache))
    assert main(["compile", "--target", str(target), "--drafter", str(drafter), "--dtype", "float32",
                 "--max-batch", "3", "--max-len", "96"]) == 0
    [line] = capsys.readouterr().out.strip().splitlines()
    report = json.loads(line)  # the module's package, found: nothing is built again
    assert report["max_batch"] == 3 and not report["built"] and report["path"] == engine.backend.info["path"]
    assert main(["compile", "--list"]) == 0
    listed = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["path"] for x in listed] == [engine.backend.info[k]["path"] if k else engine.backend.info["path"]
                                           for k in (None, "drafter", "context")]
    assert main(["compile", "--max-batch", "0"]) == 2
    assert "--max-batch" in capsys.readouterr().err
    # --prune removes the packages this code can no longer load, and only those
    folder = Path(listed[0]["path"]).parent
    facts = {k: v for k, v in listed[0].items() if k not in ("path", "kind", "mb")}
    (folder / "decode-oldcode.pt2").write_bytes(b"x" * 2**20)
    (folder / "decode-oldcode.json").write_text(json.dumps({**facts, "source": "0" * 64}))
    (folder / "draft-nofacts.pt2").write_bytes(b"x")
    assert main(["compile", "--prune"]) == 0
    assert "removed 2 stale package(s), 1.0 MB; kept 3" in capsys.readouterr().out
    assert [x["path"] for x in list_packages(cache)] == [x["path"] for x in listed]
    assert not (folder / "decode-oldcode.json").exists()
    assert main(["compile", "--clear"]) == 0
    assert "removed 3 package" in capsys.readouterr().out and list_packages(cache) == []


def test_a_request_joining_a_slot_with_non_finite_drafter_context_drafts_finite_laws(built):
    """A request admitted into a slot whose drafter context holds non-finite values (as drafter
    packages given the whole cache left in free slots: the test above) attends to those columns,
    shorter than a running row, under the longer row's window with weight 0, and 0 × inf made its
    draft law NaN (its drafts all rejected; the policy's λ NaN for good). Admission
    zeroes the slot's drafter context: with every slot's context non-finite beforehand, every
    draft law of a joining row is finite and decoding stays the target's own."""
    target, _, _, engine = built
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [list(range(2, 14)), [9, 1, 4]]  # the second joins later and is shorter
    want = greedy_reference(target, prompts, MAX_TOKENS)
    for t in (*engine.dcache.k, *engine.dcache.v):
        t.fill_(float("inf"))
    laws, draft = [], engine.drafting.draft

    def checked(batch, rows, span=None):
        tokens, q = draft(batch, rows, span)
        laws.append(bool(torch.isfinite(q).all()))
        return tokens, q

    engine.drafting.draft = checked
    try:
        knobs = DecodeKnobs(steps=1, draft_len=4)
        got = run_to_completion(engine, [("long", prompts[0], params, knobs), ("short", prompts[1], params, knobs)],
                                join_after={"short": 3})
    finally:
        del engine.drafting.draft
    assert [got["long"], got["short"]] == want
    assert len(laws) > MAX_TOKENS // 4 and all(laws)


def test_the_phase_probe_counts_the_drafter_package_calls_and_detaches(built):
    """`PhaseProbe` (an engine observer) counts the drafter package's calls within the `draft`
    phase from the package's own counter, and leaves the engine's observers and package as they were."""
    from adapt.bench.speed_runners import PhaseProbe

    target, drafter, cache, engine = built
    program, before = engine.drafting.program, engine.drafting.program.calls
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with PhaseProbe(engine) as probe:
        assert probe in engine.observers
        run_to_completion(engine, [("probed", PROMPTS[1], params, DecodeKnobs(steps=1, draft_len=4))])
    report = probe.report()
    assert engine.drafting.program is program and probe not in engine.observers
    passes = program.calls - before
    # one row, one denoising pass per drafting step: one package call per `draft` phase
    assert passes > 0 and probe.calls["draft_package"] == passes == probe.calls["draft"]
    assert report["per_call_ms"]["draft"] > 0 and report["calls_per_step"]["draft_package"] > 0
    assert "draft_package" not in report["phases_ms"] and "draft_package" not in report["per_call_ms"]


@pytest.mark.parametrize("sel", [[1], [1, 2], [0, 2]])
def test_a_pass_over_some_rows_runs_the_package_as_the_eager_pass_does(built, sel):
    """Drafter passes over a subset of slots run the package (`DrafterContext.subset_kv`: views of
    consecutive slots, a scratch copy of others), with the eager pass's logits over the same rows'
    gathered context; the engine's cache keeps every column below the block as it was, and a copy
    leaves it untouched altogether."""
    _, _, _, engine = built
    d, drafter, dc = engine.drafting, engine.drafter, engine.dcache
    gen = torch.Generator().manual_seed(11)
    for t in (*dc.k, *dc.v):
        t.normal_(generator=gen)
    before = [t.clone() for t in (*dc.k, *dc.v)]
    B, Q, W = len(sel), 5, 30
    tokens = torch.randint(0, engine.vocab, (B, Q), generator=gen)
    masked = torch.ones(B, Q, dtype=torch.bool)
    masked[:, 0] = False
    mask = torch.zeros(B, 1, W)
    mask[0, 0, 2:5] = float("-inf")
    cos, sin = drafter.rope(torch.arange(W - Q, W).expand(B, Q), torch.float32, bound=dc.max_len)
    want = drafter.block_logits(tokens, masked, dc.gather(torch.tensor(sel), W), mask, cos, sin)
    calls = d.program.calls
    got = d.block_pass(None, mask, (cos, sin), B, Q, W, everyone=False, subset=d.subset_kv(sel, W))(tokens, masked)
    assert d.program.calls == calls + 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    consecutive = sel == list(range(sel[0], sel[0] + B))
    for a, t in zip(before, (*dc.k, *dc.v)):
        if consecutive:  # views: the block's columns of its rows are written, nothing else
            assert torch.equal(a[:, :, : W - Q], t[:, :, : W - Q]) and torch.equal(a[:, :, W:], t[:, :, W:])
            others = [s for s in range(dc.max_batch) if s not in sel]
            assert torch.equal(a[others], t[others])
        else:  # a scratch copy: the engine's cache as it was
            assert torch.equal(a, t)


def test_greedy_decoding_with_some_rows_drafting_runs_the_package_and_is_the_targets_own(built):
    """Rows that draft beside rows that do not: their passes run the package (over a subset of
    the slots) and greedy output stays the target's own; with `subset_rows` 0 the same passes
    run eagerly, with the same tokens."""
    target, drafter, cache, engine = built
    prompts, params = PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    want = greedy_reference(target, prompts, MAX_TOKENS)
    # rows 0 and 2 draft, row 1 does not: subsets of slots 0 and 2 (a copy), then one of them (views)
    knobs = [DecodeKnobs(steps=1, draft_len=4), DecodeKnobs(steps=0, draft_len=0), DecodeKnobs(steps=1, draft_len=2)]
    d = engine.drafting
    saved = d.subset_rows
    try:
        for rows, name in ((8, "package"), (0, "eager")):
            d.subset_rows, d._scratch = rows, None
            passes = d.program.calls
            adds = [(f"{name}{i}", p, params, kn) for i, (p, kn) in enumerate(zip(prompts, knobs))]
            got = run_to_completion(engine, adds)
            assert [got[f"{name}{i}"] for i in range(3)] == want
            ran = d.program.calls - passes
            assert (ran > MAX_TOKENS // 4) if rows else ran == 0, (name, ran)
            assert (d._scratch is not None) == bool(rows)  # slots 0 and 2 drafted through a copy
    finally:
        d.subset_rows = saved


def test_aot_draft_subsets_is_a_count_the_drafter_context_takes(built):
    target, drafter, _, _ = built
    for bad in (-1, 1.5, True):
        with pytest.raises(Exception, match="aot_draft_subsets"):
            Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=3, max_len=96,
                                aot_draft_subsets=bad))
    engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=3, max_len=96,
                                 aot_draft_subsets=3))
    assert engine.drafting.subset_rows == 3 and EngineConfig().aot_draft_subsets == 0  # off by default


def test_the_phase_probe_counts_subset_passes_too(built):
    """Under `PhaseProbe`, passes over a subset of slots (the package called with ``kv=``) are
    counted as the package's calls and decode as without the probe."""
    from adapt.bench.speed_runners import PhaseProbe

    target, drafter, cache, engine = built
    d = engine.drafting
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    knobs = [DecodeKnobs(steps=1, draft_len=4), DecodeKnobs(steps=0, draft_len=0)]
    want = greedy_reference(target, PROMPTS[:2], MAX_TOKENS)
    saved, d.subset_rows = d.subset_rows, 8
    try:
        before = d.program.calls
        with PhaseProbe(engine) as probe:
            got = run_to_completion(engine, [(f"sub{i}", p, params, kn) for i, (p, kn) in enumerate(zip(PROMPTS, knobs))])
    finally:
        d.subset_rows = saved
    assert [got["sub0"], got["sub1"]] == want
    assert probe.calls["draft_package"] == d.program.calls - before > 0
