"""Step backends (workers/backends.py): what every `compile` setting resolves to, and that the
engine takes its behaviour from the backend's fields (packing, warm-up, fallback, labels)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_models import make_tiny_pair, single_thread
from workers.backends import BACKEND_NAMES, StepBackend, resolve_backend
from workers.compiled import CompiledTarget
from workers.engine import Engine, EngineConfig
from workers.request import COMPILE_CHOICES

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)

# setting -> (name, packs_verify on a CPU, partial_span, times_wide_rows, needs_warm_up, builds)
TABLE = {
    "off": ("eager", True, True, True, False, False),
    False: ("eager", True, True, True, False, False),
    "on": ("compiled", False, False, False, True, False),
    True: ("compiled", False, False, False, True, False),
    "aot": ("aot", False, True, True, False, True),
    "auto": ("aot", False, True, True, False, False),  # a built package, else eager: never builds
}


def _fields(b: StepBackend) -> tuple:
    return b.name, b.packs_verify, b.partial_span, b.times_wide_rows, b.needs_warm_up, b.builds


@pytest.mark.parametrize("setting", list(TABLE), ids=str)
def test_every_setting_resolves_to_one_backend_on_a_cpu(setting):
    got = resolve_backend(setting, torch.device("cpu"))
    assert _fields(got) == TABLE[setting] and got.info == {} and got.label == got.name
    assert resolve_backend(setting, "cpu") == got  # a device name or a torch.device


def test_the_table_covers_every_choice_and_backend():
    assert set(COMPILE_CHOICES) <= set(TABLE) and {v[0] for v in TABLE.values()} == set(BACKEND_NAMES)


@pytest.mark.parametrize("setting", list(TABLE), ids=str)
def test_off_a_cpu_only_packing_differs(setting):
    """Packed verification pays where the forward is compute-bound (a CPU); the rest of a backend,
    and what "auto" means, is the same on every device (resolution touches no GPU)."""
    cpu, gpu = resolve_backend(setting, "cpu"), resolve_backend(setting, "cuda")
    assert not gpu.packs_verify
    assert _fields(gpu)[:1] + _fields(gpu)[2:] == _fields(cpu)[:1] + _fields(cpu)[2:]


def test_build_applies_to_aot_only_and_bad_settings_are_named():
    assert not resolve_backend("aot", "cpu", build=False).builds
    assert not resolve_backend("auto", "cpu", build=True).builds
    assert not resolve_backend("on", "cpu", build=True).builds
    for bad in ("fast", "yes", None, 1):
        with pytest.raises(ValueError, match="compile must be one of auto, on, off, aot"):
            resolve_backend(bad, "cpu")


def test_labels_say_which_packages_loaded():
    aot = resolve_backend("aot", "cpu")
    assert StepBackend(**{**aot.__dict__, "info": {"path": "p"}}).label == "aot"
    assert StepBackend(**{**aot.__dict__, "info": {"path": "p", "drafter": {}}}).label == "aot+drafter"
    assert StepBackend(**{**aot.__dict__, "info": {"x": 1}}) == aot  # info is not part of the value's identity
    assert json.loads(json.dumps(aot.facts()))["name"] == "aot"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("backends"), vocab=512, seed=8)


def _engine(pair, **config) -> Engine:
    target, drafter = pair
    return Engine(EngineConfig(target=target, drafter=drafter, dtype="float32", max_batch=2, max_len=64, **config))


def test_an_eager_engine_packs_and_has_nothing_to_warm_up(pair):
    engine = _engine(pair, compile="off")
    assert engine.backend == resolve_backend("off", "cpu") and engine.pack
    assert not isinstance(engine.target_forward, CompiledTarget)
    assert engine.warm_up() == {"seconds": 0.0, "steps": 0}


def test_a_compiled_engine_pads_and_compiles_its_steps(pair):
    """Built, not run (compiling takes minutes on 2 cores; tests/test_compiled.py decodes with it)."""
    engine = _engine(pair, compile="on")
    assert engine.backend.name == "compiled" and not engine.pack and engine.backend.needs_warm_up
    assert engine.pack_prefill  # prefills run the eager forward on every backend: packed on a CPU
    assert isinstance(engine.target_forward, CompiledTarget)
    assert _engine(pair, compile="on", pack="on").pack  # an explicit pack setting wins over the default
    assert not _engine(pair, compile="on", pack="off").pack_prefill


def test_auto_without_a_package_is_eager_and_builds_nothing(pair, tmp_path, monkeypatch):
    from workers.package_cache import list_packages

    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path))
    engine = _engine(pair, compile="auto")
    assert engine.backend == resolve_backend("off", "cpu") and engine.backend.info == {}
    assert engine.pack and engine.drafting.program is None and list_packages(tmp_path) == []


@pytest.mark.parametrize("command", ["generate", "serve", "info"])
def test_the_clis_default_to_auto(command):
    from adapt.cli import build_parser

    argv = {"generate": ["generate", "x"], "serve": ["serve"], "info": ["info"]}[command]
    assert build_parser().parse_args(argv).compile == "auto"


def test_generate_and_info_show_the_backend(pair, tmp_path, monkeypatch, capsys):
    from adapt.cli import main

    monkeypatch.setenv("ADAPT_CACHE_DIR", str(tmp_path))
    target, drafter = pair
    models = ["--target", str(target), "--drafter", str(drafter), "--cache-dir", str(tmp_path)]
    assert main(["generate", "x = 1", *models, "--dtype", "float32", "--draft-len", "4", "--max-tokens", "4",
                 "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["backend"] == "eager" and stats["decode_steps"] == "eager"  # auto, no package built
    assert main(["info", *models, "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]["step_backend"]
    assert chosen["compile"] == "auto" and chosen["backend"] == "aot" and not chosen["builds"]
    assert "eager steps" in chosen["why"]
    assert main(["info", *models]) == 0
    assert "step backend: aot: eager steps: no compiled package is built" in capsys.readouterr().out
    assert main(["info", *models, "--json", "--compile", "on"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["step_backend"]["backend"] == "compiled"
