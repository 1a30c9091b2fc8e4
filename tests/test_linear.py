"""Shape-aware linears and fused projections (workers/linear.py) against plain F.linear / transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from tests.tiny_models import make_tiny_target, single_thread, tiny_hf_config
from workers.drafter import init_drafter
from workers.linear import (
    WIDE_ROWS,
    ShapeAwareLinear,
    can_pack,
    fuse_linears,
    make_shape_aware,
    prepare_for_inference,
    use_fp32,
    wants_shadow,
    wants_wide_shadow,
)
from workers.target_model import load_target

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def _linear(fan_in, fan_out, bias=True, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(fan_in, fan_out, bias=bias).to(dtype).requires_grad_(False)


def test_selection_by_size_device_and_dtype():
    assert use_fp32(1, 256, 256, threshold=100_000)
    assert not use_fp32(2, 256, 256, threshold=100_000)
    assert use_fp32(8, 256, 768, threshold=1_600_000) and not use_fp32(17, 256, 768, threshold=1_600_000)
    small = torch.empty(256, 256, dtype=torch.bfloat16)
    assert wants_shadow(small, threshold=100_000)
    assert not wants_shadow(torch.empty(4096, 256, dtype=torch.bfloat16), threshold=100_000)  # one row already too big
    assert not wants_shadow(small.float(), threshold=100_000)  # fp32 needs no shadow
    off_cpu = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")  # stands for a GPU tensor
    assert not wants_shadow(off_cpu, threshold=100_000) and not can_pack(off_cpu)
    assert not can_pack(small.float())


def test_prepare_leaves_linears_plain_off_cpu():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    prepare_for_inference(model)
    assert all(type(m) is nn.Linear for m in model)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_shape_aware_matches_f_linear_on_both_paths(rows):
    lin = _linear(64, 96)
    sa = ShapeAwareLinear.from_linear(lin, threshold=3 * 64 * 96)
    x = torch.randn(rows, 64).to(torch.bfloat16)
    out = sa(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    exact32 = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    if use_fp32(rows, 64, 96, sa.threshold):  # the fp32 shadow path: fp32 math, one rounding
        torch.testing.assert_close(out, exact32.to(torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(out.float(), F.linear(x, lin.weight, lin.bias).float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(out.float(), exact32, atol=0.05, rtol=0.02)
    x3 = torch.randn(2, rows, 64).to(torch.bfloat16).transpose(0, 1)  # batched, non-contiguous
    torch.testing.assert_close(sa(x3).float(), F.linear(x3.float(), lin.weight.float(), lin.bias.float()), atol=0.05, rtol=0.02)


def test_shape_aware_keeps_names_ties_and_follows_reloads_and_casts():
    emb = nn.Embedding(32, 16)
    model = nn.ModuleDict({"emb": emb, "head": nn.Linear(16, 32, bias=False)}).to(torch.bfloat16)
    model["head"].weight = emb.weight
    keys = set(model.state_dict())
    make_shape_aware(model)
    assert isinstance(model["head"], ShapeAwareLinear) and model["head"].weight is model["emb"].weight
    assert set(model.state_dict()) == keys
    x = torch.randn(1, 16).to(torch.bfloat16)
    model["head"](x)  # builds the derived copies
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    assert torch.equal(model["emb"].weight, new["head.weight"])  # tied: the later key wins
    torch.testing.assert_close(model["head"](x).float(), F.linear(x.float(), new["head.weight"].float()), atol=0.05, rtol=0.02)
    model.float()
    assert model["head"](x.float()).dtype == torch.float32


def test_fused_linear_equals_parts_and_shares_their_storage():
    parts = [_linear(32, n, bias=b, seed=i) for i, (n, b) in enumerate([(48, True), (16, False), (16, True)])]
    x = torch.randn(5, 32).to(torch.bfloat16)
    ref = torch.cat([F.linear(x.float(), p.weight.float(), None if p.bias is None else p.bias.float()) for p in parts], -1)
    for threshold in (None, 0, 10**9):  # plain, packed, fp32 shadow
        fused = fuse_linears(parts, threshold)
        torch.testing.assert_close(fused(x).float(), ref, atol=0.05, rtol=0.02)
        base, end = fused.weight.data_ptr(), fused.weight.data_ptr() + fused.weight.numel() * 2
        assert all(base <= p.weight.data_ptr() < end for p in parts)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_prepared_bf16_target_matches_transformers(tmp_path, family):
    """Fused + shape-aware bf16 logits are as close to fp32 transformers as plain bf16 ones; names unchanged."""
    path = make_tiny_target(tmp_path / family, family=family, vocab=128, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits  # [2, 9, V] fp32
    errs = {}
    for name, kw in {"plain": dict(shape_aware=False, fuse=False), "prepared": {}}.items():
        model = load_target(path, dtype=torch.bfloat16, **kw)
        cache = model.new_cache(2, 16)
        with torch.inference_mode():
            first, _ = model(ids[:, :8], torch.zeros(2, dtype=torch.long), cache, 0, 8)  # prefill: bf16 path
            last, _ = model(ids[:, 8:], torch.full((2,), 8), cache, 0, 9)  # one token per row: fp32 path
        errs[name] = (torch.cat([first, last], 1) - ref).abs().max().item()
        if name == "prepared":
            assert set(model.state_dict()) == set(load_target(path, fuse=False, shape_aware=False).state_dict())
            assert model.model.layers[0].self_attn.fused("qkv") is not None
    assert errs["prepared"] < 0.05 + 1.5 * errs["plain"], errs


def test_drafter_fused_context_and_block_equal_unfused():
    target = AutoModelForCausalLM.from_config(tiny_hf_config("llama", vocab=64, layers=4)).eval()
    drafter = init_drafter(target.config, target.model.embed_tokens, target.lm_head, seed=1, block_size=4).eval()
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 7, len(drafter.config.target_layer_ids) * 64, generator=gen)
    pos = torch.arange(7).expand(2, 7)
    block = torch.randn(2, 5, 64, generator=gen)
    bpos = 7 + torch.arange(5).expand(2, 5)
    ctx_mask = torch.ones(2, 5, 7, dtype=torch.bool)
    keys = set(drafter.state_dict())
    with torch.no_grad():
        kv_ref = drafter.context_kv(feats, pos)
        out_ref = drafter.forward_block(block, bpos, kv_ref, ctx_mask)
        prepare_for_inference(drafter)
        assert drafter.fused("ctx_kv") is not None and set(drafter.state_dict()) == keys
        kv = drafter.context_kv(feats, pos)
        out = drafter.forward_block(block, bpos, kv, ctx_mask)
    for (k, v), (kr, vr) in zip(kv, kv_ref):
        torch.testing.assert_close(k, kr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, vr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    # reloading the (unchanged-name) weights rebuilds the fused projection from them
    state = {k: v * 0.5 if k.endswith("k_proj.weight") else v for k, v in drafter.state_dict().items()}
    drafter.load_state_dict(state)
    with torch.no_grad():
        fused_k = drafter.context_kv(feats, pos)[0][0]
        drafter.unfuse()
        torch.testing.assert_close(fused_k, drafter.context_kv(feats, pos)[0][0], atol=1e-5, rtol=1e-5)


def test_prepared_model_can_be_copied():
    import copy

    lin = ShapeAwareLinear.from_linear(_linear(16, 8), threshold=0)
    x = torch.randn(3, 16).to(torch.bfloat16)
    out = lin(x)  # builds the packed weight
    torch.testing.assert_close(copy.deepcopy(lin)(x), out, atol=0, rtol=0)


def test_wide_shadow_only_without_native_low_precision():
    w = torch.empty(64, 32, dtype=torch.bfloat16)
    assert wants_wide_shadow(w) == (not can_pack(w))  # this machine's answer, whichever it is
    assert not wants_wide_shadow(w.float())
    assert not wants_wide_shadow(torch.empty(64, 32, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("rows", [1, WIDE_ROWS - 1, WIDE_ROWS, 40])
def test_wide_matmuls_take_the_fp32_shadow_where_bf16_is_emulated(rows, monkeypatch):
    monkeypatch.setattr("workers.linear.can_pack", lambda weight: False)  # as on an AVX2-only CPU
    lin = _linear(64, 96)
    sa = ShapeAwareLinear.from_linear(lin, threshold=0)  # no small-matmul shadow: only the wide rule
    assert "_fp32" not in sa.__dict__
    x = torch.randn(rows, 64).to(torch.bfloat16)
    out = sa(x)
    exact32 = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    if rows >= WIDE_ROWS:  # fp32 math, one rounding, and the shadow now exists
        torch.testing.assert_close(out, exact32.to(torch.bfloat16), atol=0, rtol=0)
        assert sa.__dict__["_fp32"][0].dtype == torch.float32
    else:  # the plain bf16 matmul; no fp32 copy is built
        torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias), atol=0, rtol=0)
        assert "_fp32" not in sa.__dict__
    sa.wide_rows = None
    sa.refresh()
    torch.testing.assert_close(sa(x), F.linear(x, lin.weight, lin.bias), atol=0, rtol=0)  # switched off


def test_wide_shadow_follows_reloads(monkeypatch):
    monkeypatch.setattr("workers.linear.can_pack", lambda weight: False)
    lin = _linear(16, 8)
    sa = ShapeAwareLinear.from_linear(lin, threshold=0)
    x = torch.randn(WIDE_ROWS, 16).to(torch.bfloat16)
    sa(x)
    new = {"weight": torch.randn(8, 16).to(torch.bfloat16), "bias": torch.randn(8).to(torch.bfloat16)}
    sa.load_state_dict(new)
    torch.testing.assert_close(sa(x), F.linear(x.float(), new["weight"].float(), new["bias"].float()).to(torch.bfloat16),
                               atol=0, rtol=0)


@pytest.mark.parametrize("wide_rows", [None, 3])
def test_wide_rows_reach_every_linear_and_survive_casts(tmp_path, wide_rows):
    """`load_target(wide_rows=...)` (the engine's `wide_fp32`) reaches plain and fused linears, also
    after `.to()` rebuilds the fused ones; the LM head's draft-vocabulary rows inherit it."""
    from workers.drafter import _rows_of

    path = make_tiny_target(tmp_path / "t", family="llama", vocab=64, seed=1)
    model = load_target(path, dtype=torch.bfloat16, wide_rows=wide_rows)

    def seen():
        layer = model.model.layers[0]
        linears = [m for m in model.modules() if isinstance(m, ShapeAwareLinear)]
        linears += [layer.self_attn.fused("qkv"), layer.mlp.fused("gate_up")]
        return {m.wide_rows for m in linears}

    assert seen() == {wide_rows}
    model.to(torch.bfloat16)
    assert seen() == {wide_rows}
    assert _rows_of(model.lm_head, torch.arange(8)).wide_rows == wide_rows


def test_engine_option_wide_fp32_reaches_target_and_drafter():
    """`EngineConfig.wide_fp32=False` (engine option `wide_fp32`) turns the wide path off in the
    target's and the drafter's linears alike; serving validates it as a boolean."""
    from adapt.serving.engine_options import validate_engine_options
    from workers.engine import Engine, EngineConfig

    for on in (True, False):
        engine = Engine(EngineConfig(dtype="bfloat16", max_batch=2, max_len=64, wide_fp32=on, wide_rows=WIDE_ROWS))
        modules = [*engine.target.modules(), *engine.drafter.modules()]
        if engine.drafter.draft_head is not None:
            modules.append(engine.drafter.draft_head)
        wide = {m.wide_rows for m in modules if isinstance(m, ShapeAwareLinear)}
        assert wide == ({WIDE_ROWS} if on else {None})
    assert validate_engine_options({"wide_fp32": False}) == {"wide_fp32": False}
    with pytest.raises(ValueError, match="wide_fp32"):
        validate_engine_options({"wide_fp32": "yes"})


# -- wide thresholds timed per weight shape (workers/wide_rows.py) ---------------------------------

def test_crossover_reads_the_fitted_cost_lines():
    from workers.wide_rows import _crossover

    rows = (6, 8, 10, 12)
    bf16 = {r: 10.0 * r for r in rows}                     # emulated bf16: grows with every row
    assert _crossover(bf16, {r: 75.0 + 0.5 * r for r in rows}) == 8   # 79 <= 80 at 8, not at 7
    noisy = {r: 75.0 + 0.5 * r for r in rows} | {12: 130.0}  # one slow timing (fp32 loses at 12)
    assert 8 <= _crossover(bf16, noisy) <= 10  # the line moves by a row or two; one by one it would say 12
    assert _crossover(bf16, {r: 500.0 for r in rows}) == 12  # never wins: the largest candidate
    assert _crossover(bf16, {r: 1.0 for r in rows}) == 6     # always wins: the smallest


def test_calibration_times_each_shape_once_and_sets_only_wide_path_linears(tmp_path, monkeypatch):
    """On a CPU with emulated bf16 every linear a forward calls gets its shape's timed crossover
    (fused projections, not their unused parts); a machine times a shape once (a later process
    reads the cache directory's JSON); fp32 weights and linears with the wide path off are left
    alone."""
    import json

    import workers.wide_rows as wide

    monkeypatch.setattr("workers.linear.can_pack", lambda weight: False)  # as on an AVX2-only CPU
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(wide, "_MEMO", {})
    timed = []
    real = wide._time_crossover

    def counting(layers, candidates, repeats):
        timed.append((layers[0].out_features, layers[0].in_features, len(layers)))
        return real(layers, candidates, repeats)

    monkeypatch.setattr(wide, "_time_crossover", counting)
    path = make_tiny_target(tmp_path / "t", family="llama", vocab=64, seed=1)
    model = load_target(path, dtype=torch.bfloat16)
    table = wide.calibrate_wide_rows(model)
    calls = wide.forward_linears(model)
    assert {(m.out_features, m.in_features) for m in calls} == set(table)
    assert len(timed) == len(table)  # one timing per shape
    assert all(min(wide.CANDIDATE_ROWS) <= rows <= max(wide.CANDIDATE_ROWS) for rows in table.values())
    assert all(m.wide_rows == table[(m.out_features, m.in_features)] for m in calls)
    layer = model.model.layers[0]
    assert layer.self_attn.fused("qkv") in calls and layer.self_attn.q_proj not in calls
    again = load_target(path, dtype=torch.bfloat16)
    assert wide.calibrate_wide_rows(again) == table and len(timed) == len(table)  # memo: not timed again
    stored = json.loads((tmp_path / "cache" / "crossovers.json").read_text())
    assert sorted(stored.values()) == sorted(table.values())
    monkeypatch.setattr(wide, "_MEMO", {})  # as a new process on the same machine
    assert wide.calibrate_wide_rows(load_target(path, dtype=torch.bfloat16)) == table and len(timed) == len(table)
    (tmp_path / "cache" / "crossovers.json").write_text("[1, 2")  # a damaged file: timed again, rewritten
    monkeypatch.setattr(wide, "_MEMO", {})
    wide.calibrate_wide_rows(load_target(path, dtype=torch.bfloat16))
    assert len(timed) == 2 * len(table) and json.loads((tmp_path / "cache" / "crossovers.json").read_text())
    off = load_target(path, dtype=torch.bfloat16, wide_rows=None)
    assert wide.calibrate_wide_rows(off) == {} and {m.wide_rows for m in wide.forward_linears(off)} == {None}
    assert wide.calibrate_wide_rows(load_target(path, dtype=torch.float32)) == {}


def test_engine_wide_rows_option(tmp_path, monkeypatch):
    """`EngineConfig.wide_rows`: "auto" times the crossovers (where bf16 is emulated) and keeps
    them in `Engine.wide_table`; an int is every layer's threshold; anything else is refused by
    name, by the engine and by serving's option check."""
    from adapt.serving.engine_options import validate_engine_options
    from workers.engine import Engine, EngineConfig
    from workers.request import EngineInputError
    from workers.wide_rows import forward_linears

    monkeypatch.setattr("workers.linear.can_pack", lambda weight: False)
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path))
    auto = Engine(EngineConfig(dtype="bfloat16", max_batch=2, max_len=64))
    calls = forward_linears(auto.target, auto.drafter)
    assert auto.wide_table and {m.wide_rows for m in calls} == set(auto.wide_table.values())
    fixed = Engine(EngineConfig(dtype="bfloat16", max_batch=2, max_len=64, wide_rows=7))
    assert fixed.wide_table == {} and {m.wide_rows for m in forward_linears(fixed.target, fixed.drafter)} == {7}
    for bad in (0, "fast", True):
        with pytest.raises(EngineInputError, match="wide_rows"):
            Engine(EngineConfig(dtype="bfloat16", max_batch=2, max_len=64, wide_rows=bad))
    assert validate_engine_options({"wide_rows": 7}) == {"wide_rows": 7}
    assert validate_engine_options({"wide_rows": "auto"}) == {"wide_rows": "auto"}
    with pytest.raises(ValueError, match="wide_rows"):
        validate_engine_options({"wide_rows": "fast"})
