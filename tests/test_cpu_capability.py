"""The effective CPU capability (workers/cpu_capability.py) is part of every key of something timed
or built per machine: a process run under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``
(what an AVX2-only CPU runs) never reads a cost profile, dtype choice, wide-row crossover or
compiled package made at the CPU's full capability. Each key is computed in a subprocess, with and
without the variables, since the libraries read them once at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
LIMIT = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

KEYS = f"""
import json, torch
from workers.kv_cache import KVCache
from adapt.dtype_choice import choice_facts
from adapt.profile_cache import key_digest, machine_facts
from workers.aot import _shared_facts, inductor_configs, offers_one_row
from workers.package_cache import SOURCES
from workers.cpu_capability import capability_label, effective_capability
from workers.wide_rows import _key
torch.set_num_threads(1)
cache = KVCache(num_layers=2, max_batch=1, kv_heads=1, max_len=8, head_dim=4)
print(json.dumps({{
    "capability": effective_capability(), "label": capability_label(),
    "profile": key_digest(machine_facts("cpu")),
    "dtype_choice": key_digest(choice_facts("{DEMO / 'target'}", "{DEMO / 'drafter'}")),
    "wide_rows": _key((1536, 576), 30, torch.bfloat16, (6, 8)),
    "aot": _shared_facts(SOURCES, cache)["cpu_capability"],
    "inductor_bf16": inductor_configs(torch.bfloat16), "inductor_fp32": inductor_configs(torch.float32),
    "one_row": [offers_one_row(torch.bfloat16, "cpu"), offers_one_row(torch.float32, "cpu"),
                offers_one_row(torch.bfloat16, "meta")],
}}))
"""

# a bf16 engine of the tiny pair, 8 rows, its packages built under the variables: the decode
# program's logits against the eager forward's on the same cache, for calls of B rows x T tokens
PACKAGE = """
import json, sys, torch
from tests.tiny_models import make_tiny_pair
from workers.engine import Engine, EngineConfig
torch.set_num_threads(1)
target, drafter = make_tiny_pair(sys.argv[1], vocab=64, seed=5)
engine = Engine(EngineConfig(target=target, drafter=drafter, dtype="bfloat16", max_batch=8, max_len=96, compile="aot"))
aot, cache = engine.target_forward, engine.tcache
gen = torch.Generator().manual_seed(2)
for t in (*cache.k, *cache.v):
    t.copy_(torch.randn(t.shape, generator=gen))
errors = {}
with torch.inference_mode():
    for B, T in ((1, 1), (1, 3), (8, 1), (4, 5)):
        ids = torch.randint(0, engine.vocab, (B, T), generator=gen)
        start = torch.full((B,), 20)
        got = aot._run(ids, start, 20 + T)[0].float()
        want = aot.target(ids, start, cache, 0, 20 + T, aot.capture, None, None)[0].float()
        errors[f"{B}x{T}"] = float((got - want).abs().max() / want.abs().max())
print(json.dumps({"errors": errors, "built": [engine.backend.info["built"], engine.backend.info["drafter"]["built"]]}))
"""


def _unlimited_env() -> dict:
    """This process's environment without the variables that limit the capability."""
    return {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                              "DNNL_MAX_CPU_ISA")}


def _keys(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", KEYS], env={**_unlimited_env(), **env}, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def keys():
    return _keys(), _keys(**LIMIT)


def test_the_limited_process_reports_its_capability_and_what_limits_it(keys):
    full, limited = keys
    assert limited["capability"]["torch_capability"] == "AVX2"
    assert limited["capability"]["limited_by"] == LIMIT and limited["capability"]["onednn_isa_limit"] == "AVX2"
    assert limited["capability"]["native_bf16"] is False  # oneDNN limited to AVX2 has no bf16 dot products
    assert full["capability"]["limited_by"] == {} and full["capability"]["onednn_isa_limit"] is None
    assert limited["label"] == "AVX2 onednn=AVX2" and full["label"] == full["capability"]["torch_capability"]


@pytest.mark.parametrize("key", ["profile", "dtype_choice", "wide_rows", "aot"])
def test_every_per_machine_key_differs_under_the_limit(keys, key):
    full, limited = keys
    assert full[key] != limited[key]


def test_bf16_packages_take_the_cpp_gemm_template_only_without_native_bf16(keys):
    """Without native bf16 matmuls (the limit; a real AVX2-only CPU) bf16 packages compile with
    inductor's C++ GEMM template as a candidate (workers/aot.py `inductor_configs`); fp32 ones never."""
    full, limited = keys
    assert limited["inductor_bf16"]["max_autotune"] is True
    assert limited["inductor_bf16"]["max_autotune_gemm_backends"] == "CPP,ATEN"
    for k in (full, limited):
        assert k["inductor_fp32"] == {"freezing": True} and k["inductor_bf16"]["freezing"] is True
    assert ("max_autotune" in full["inductor_bf16"]) == (not full["capability"]["native_bf16"])


def test_only_bf16_engines_on_native_bf16_cpus_try_a_one_row_program(keys):
    """Where the decode package already times the template (no native bf16), no one-row program
    (workers/aot.py `offers_one_row`); fp32 engines and other devices never."""
    full, limited = keys
    assert limited["one_row"] == [False, False, False]
    assert full["one_row"] == [full["capability"]["native_bf16"], False, False]


def test_bf16_packages_built_under_the_limit_compute_the_eager_forward(tmp_path):
    """The packages of an 8-row bf16 engine build under the limit (each matmul picked between the
    template and oneDNN by timing; a program the template fails on builds without it) and the
    decode program's logits match the eager forward's to bf16 precision."""
    env = {**_unlimited_env(), **LIMIT, "ADAPT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PACKAGE, str(tmp_path / "pair")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["built"] == [True, True]
    assert all(e < 0.05 for e in result["errors"].values()), result["errors"]


def test_the_keys_are_stable_without_the_limit(keys):
    assert _keys() == keys[0]


def test_adapt_info_shows_the_effective_capability_and_what_limits_it(tmp_path):
    env = {**os.environ, **LIMIT}
    cmd = [sys.executable, "-m", "adapt.cli", "info", "--pair", "demo", "--cache-dir", str(tmp_path)]
    text = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "kernels AVX2, oneDNN limited to AVX2" in text
    assert "limited by the environment (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)" in text
    info = json.loads(subprocess.run(cmd + ["--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                                     check=True).stdout)
    assert info["machine"]["torch_capability"] == "AVX2" and info["machine"]["limited_by"] == LIMIT
    assert info["machine"]["native_bf16_matmul"] is False
