"""The machine profile on disk (adapt/profile_cache.py) and the measured --dtype auto choice
(adapt/dtype_choice.py), on a real tiny engine: a stored profile is read back without timing
anything, a changed key or a corrupt file profiles again, and `adapt generate` reuses both."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tests.tiny_models import make_tiny_pair, single_thread

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

ARGS = {"token_grid": (1, 2, 5), "row_grid": (1, 2), "repeats": 1, "overhead_steps": 2}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("profile"), vocab=512, seed=3)


def _engine(pair, **kw):
    from workers.engine import Engine, EngineConfig

    return Engine(EngineConfig(target=pair[0], drafter=pair[1], device="cpu", **{"dtype": "float32", "max_batch": 2,
                                                                               "max_len": 128, **kw}))


class _Counted:
    """Counts the engine's model calls: target forwards, drafter passes and decode steps."""

    def __init__(self, engine):
        self.calls = 0
        forward, block_pass, step = engine.target_forward, engine.drafting.block_pass, engine.step

        def count(fn):
            def wrapped(*a, **k):
                self.calls += 1
                return fn(*a, **k)
            return wrapped

        engine.target_forward = count(forward)
        engine.drafting.block_pass = count(block_pass)
        engine.step = count(step)


def test_a_stored_profile_is_read_back_without_timing_anything(pair, tmp_path):
    from adapt.profile_cache import engine_profile

    engine = _engine(pair)
    counted = _Counted(engine)
    built, info = engine_profile(engine, tmp_path, say=None, **ARGS)
    assert not info["cached"] and counted.calls > 0  # the counter sees a real profile's calls
    assert built.source == "profile" and built.verify.at(5.0) > 0 and built.draft_pass.at(1.0) > 0
    stored = json.loads(open(info["path"]).read())
    assert stored["key"]["machine"]["cpu"] and stored["key"]["dtype"] == "float32" and stored["key"]["backend"]
    counted.calls = 0
    again, info2 = engine_profile(engine, tmp_path, say=None, **ARGS)
    assert info2["cached"] and info2["path"] == info["path"]
    assert counted.calls == 0  # no forward, no pass, no step
    assert again.to_dict() == built.to_dict()
    # --reprofile: timed again
    _, info3 = engine_profile(engine, tmp_path, refresh=True, say=None, **ARGS)
    assert not info3["cached"] and counted.calls > 0


def test_a_changed_key_profiles_again(pair, tmp_path):
    from adapt.profile_cache import engine_profile

    engine = _engine(pair)
    _, first = engine_profile(engine, tmp_path, say=None, **ARGS)
    _, other_shape = engine_profile(_engine(pair, max_batch=3), tmp_path, say=None, **ARGS)
    assert not other_shape["cached"] and other_shape["path"] != first["path"]
    _, other_grid = engine_profile(engine, tmp_path, say=None, **dict(ARGS, token_grid=(1, 3)))
    assert not other_grid["cached"]
    # other compiled programs (a rebuilt package, a one-row program's verdict): other step costs
    saved = engine.backend
    try:
        engine.backend = dataclasses.replace(saved, info={**saved.info, "key": "rebuilt",
                                                          "one_row": {"key": "k", "verdict": {"tokens": [1, 2]}}})
        _, other_programs = engine_profile(engine, tmp_path, say=None, **ARGS)
        assert not other_programs["cached"] and other_programs["path"] != first["path"]
        stored = json.loads(open(other_programs["path"]).read())["key"]["programs"]
        assert stored == {"packages": ["rebuilt", "k"], "one_row_tokens": [1, 2]}
    finally:
        engine.backend = saved
    # a retrained (rewritten) drafter: its weights file changes, so does the key
    weights = next(p for p in pair[1].iterdir() if p.suffix == ".safetensors")
    st = weights.stat()
    try:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        _, retrained = engine_profile(engine, tmp_path, say=None, **ARGS)
        assert not retrained["cached"] and retrained["path"] != first["path"]
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    _, same = engine_profile(engine, tmp_path, say=None, **ARGS)
    assert same["cached"] and same["path"] == first["path"]


@pytest.mark.parametrize("garbage", ["{not json", '{"format": 1, "key": {"other": 1}, "cost": {}}',
                                     "[1, 2]"])
def test_a_corrupt_profile_is_rebuilt_with_a_warning(pair, tmp_path, capsys, garbage):
    from adapt.profile_cache import engine_profile

    engine = _engine(pair)
    _, info = engine_profile(engine, tmp_path, say=None, **ARGS)
    capsys.readouterr()
    open(info["path"], "w").write(garbage)
    cost, again = engine_profile(engine, tmp_path, say=None, **ARGS)
    assert not again["cached"] and cost.verify.at(1.0) > 0
    assert "warning" in capsys.readouterr().err
    json.loads(open(info["path"]).read())  # written whole again
    assert engine_profile(engine, tmp_path, say=None, **ARGS)[1]["cached"]


def test_a_stored_record_with_a_bad_cost_table_is_rebuilt(pair, tmp_path, capsys):
    from adapt.profile_cache import engine_profile

    engine = _engine(pair)
    _, info = engine_profile(engine, tmp_path, say=None, **ARGS)
    record = json.loads(open(info["path"]).read())
    record["cost"]["verify"] = {"x": [2, 1], "ms": [1, 1]}  # x must increase
    open(info["path"], "w").write(json.dumps(record))
    _, again = engine_profile(engine, tmp_path, say=None, **ARGS)
    assert not again["cached"] and "warning" in capsys.readouterr().err


def test_the_dtype_choice_is_measured_once_then_read_back(pair, tmp_path):
    from adapt.dtype_choice import choose_dtype
    from adapt.profile_cache import machine_facts, model_digest

    built = []

    def make(dtype):
        built.append(dtype)
        return _engine(pair, dtype=dtype, max_batch=1)

    facts = {"machine": machine_facts(), "target": model_digest(pair[0]), "drafter": model_digest(pair[1])}
    engine, choice = choose_dtype(make, facts, tmp_path, say=lambda _: None)
    assert built == ["bfloat16", "float32"] and not choice["cached"]
    assert choice["dtype"] in ("bfloat16", "float32") and str(engine.dtype) == f"torch.{choice['dtype']}"
    assert set(choice["ms"]) == {"bfloat16", "float32"} and choice["dtype"] in choice["reason"]
    scores = {d: s["score"] for d, s in choice["ms"].items()}
    assert scores[choice["dtype"]] == min(scores.values())  # the faster one, by measurement
    built.clear()
    engine2, again = choose_dtype(make, facts, tmp_path, say=lambda _: None)
    assert built == [choice["dtype"]] and again["cached"] and again["dtype"] == choice["dtype"]


def test_the_dtype_choice_key_holds_only_packages_its_engines_may_load(pair, tmp_path, monkeypatch):
    """A package built for another batch size (a benchmark's 8 rows) or another cache length (a
    benchmark's long prompts) leaves the stored choice standing; one built for the timing engines'
    shape (one row, the default length) is part of the key."""
    from adapt.dtype_choice import choice_facts, timing_cache_length
    from adapt.profile_cache import key_digest
    from workers.engine import EngineConfig

    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "aot"
    folder.mkdir()
    length = _engine(pair, max_batch=1, max_len=EngineConfig.max_len).tcache.max_len  # a timing engine's cache
    assert timing_cache_length(pair[1], EngineConfig.max_len) == length

    def package(name: str, rows: int, positions: int) -> None:
        (folder / f"{name}.pt2").write_bytes(b"")
        (folder / f"{name}.json").write_text(json.dumps({"cache_shape": [rows, 1, positions, 4]}))

    before = key_digest(choice_facts(*pair))
    package("decode-8rows", 8, length)
    package("decode-long", 1, 2 * length)
    assert key_digest(choice_facts(*pair)) == before
    assert choice_facts(*pair, compile_choice="off")["packages"] == []
    package("decode-1row", 1, length)
    assert choice_facts(*pair)["packages"] == ["decode-1row.pt2"]


def test_a_choice_whose_timing_built_the_packages_is_read_back(pair, tmp_path, monkeypatch):
    """Timing engines that build the compiled packages of their shape (``--compile aot`` on an
    empty cache) change the key's package list between one command and the next; the choice is
    kept under the key the next command asks for, so that command times nothing."""
    import adapt.dtype_choice as dc
    from workers.engine import EngineConfig

    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "aot"
    folder.mkdir()
    length = dc.timing_cache_length(pair[1], EngineConfig.max_len)
    real, timed = dc.choose_dtype, []

    def building(make_engine, facts, *args, **kwargs):
        def make(dtype):  # each timing engine leaves a package of its shape, as an aot build does
            timed.append(dtype)
            (folder / f"decode-{dtype}.pt2").write_bytes(b"")
            (folder / f"decode-{dtype}.json").write_text(json.dumps({"cache_shape": [1, 1, length, 4]}))
            return make_engine(dtype)
        return real(make, facts, *args, **kwargs)

    monkeypatch.setattr(dc, "choose_dtype", building)
    config = {"target": str(pair[0]), "drafter": str(pair[1]), "device": "cpu", "compile": "auto", "dtype": "auto"}
    before = dc.choice_facts(pair[0], pair[1], "auto")
    _, first = dc.resolve_engine_dtype(config, tmp_path, say=lambda _: None)
    assert not first["cached"] and timed == ["bfloat16", "float32"]
    assert dc.choice_facts(pair[0], pair[1], "auto") != before  # the packages are in the key now
    timed.clear()
    _, later = dc.resolve_engine_dtype(config, tmp_path, say=lambda _: None)
    assert later["cached"] and later["dtype"] == first["dtype"] and timed == []


def test_generate_reuses_the_stored_profile_and_reports_why(pair, tmp_path, capsys):
    from adapt.cli import main

    def run(*flags):
        rc = main(["generate", "def add(a, b):", "--target", str(pair[0]), "--drafter", str(pair[1]),
                   "--policy", "adaptive", "--max-tokens", "12", "--ignore-eos", "--json",
                   "--cache-dir", str(tmp_path), *flags])
        assert rc == 0
        captured = capsys.readouterr()
        return json.loads(captured.out)["stats"], captured.err

    first, err = run()
    assert "profiling this machine's step costs" in err and "pick the faster dtype" in err
    assert first["cost_profile"]["cached"] is False and first["dtype_choice"]["cached"] is False
    assert first["dtype"] == first["dtype_choice"]["dtype"] and "measured" in first["dtype_choice"]["reason"]
    later, err = run()
    assert later["cost_profile"]["cached"] is True and later["dtype_choice"]["cached"] is True
    assert "profiling" not in err and later["cost_profile"]["path"] == first["cost_profile"]["path"]
    forced, err = run("--reprofile")
    assert forced["cost_profile"]["cached"] is False and "profiling" in err
    fixed, _ = run("--dtype", "float32")
    assert fixed["dtype"] == "float32" and fixed["dtype_choice"]["reason"] == "given (--dtype)"


def test_a_serving_worker_reads_the_stored_profile(pair, tmp_path, monkeypatch):
    from adapt.serving.worker_plugin import ServingPlugin

    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ADAPT_PROFILE_DIR", raising=False)  # the test run's own folder (conftest)
    engine = _engine(pair)
    first = ServingPlugin("w0", store=None, policy="adaptive", heartbeat_s=60)
    try:
        assert first.decisions(engine) is not None and first.cost.source == "profile"
    finally:
        first.close()
    assert [p.name.startswith("cost-") for p in (tmp_path / "profiles").glob("*.json")] == [True]
    counted = _Counted(engine)
    later = ServingPlugin("w1", store=None, policy="adaptive", heartbeat_s=60)
    try:
        later.decisions(engine)
        assert counted.calls == 0 and later.cost.to_dict() == first.cost.to_dict()
        monkeypatch.setenv("ADAPT_REPROFILE", "1")  # a worker started to time the machine again
        later.decisions(engine)
        assert counted.calls > 0
    finally:
        later.close()


def test_workers_starting_together_profile_once(pair, tmp_path):
    """Two engines of one key asking at once: one profiles, the other waits and reads its file."""
    import threading

    from adapt.profile_cache import engine_profile

    engines = [_engine(pair), _engine(pair)]
    infos = [None, None]

    def ask(i):
        infos[i] = engine_profile(engines[i], tmp_path, say=None, **ARGS)[1]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(info["cached"] for info in infos) == [False, True]
    assert infos[0]["path"] == infos[1]["path"]
