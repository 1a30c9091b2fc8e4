"""A machine profile kept on disk: the engine's cost model, timed once per machine and model.

Words used here:
- **machine facts**: what decides how fast a step runs besides the model: the CPU's model name and
  the instruction sets torch's kernels pick from (`workers.cpu_capability.CAPABILITY_FLAGS`), the capability this process
  really uses (`workers.cpu_capability`: lowered by ``ATEN_CPU_CAPABILITY`` or
  ``ONEDNN_MAX_CPU_ISA``), torch's thread count and version, and the GPU's name where the engine
  runs on one.
- **model digest**: a cheap fingerprint of a model directory: the name, size and modification
  time of each weights and config file (no weights are read; a retrained or replaced model
  changes it).
- **profile key**: machine facts, both models' digests, dtype, *step backend* (eager,
  torch.compile, or compiled packages: `step_backend`), engine shape (max batch, max length,
  block) and the profile's own arguments. A profile is valid only for its key.

`engine_profile(engine)` returns the engine's `CostModel` from `profiles/cost-<hash>.json` in the
cache directory (`workers.pull.cache_root`: ``--cache-dir``, else $ADAPT_CACHE_DIR, else
~/.cache/adapt) when one was stored for this key, timing nothing; else it profiles the engine
(`adapt.controller.profile_engine` on a coarse grid, `coarse_grid`), prints one progress line
on stderr and stores the result (JSON, written atomically). A file that does not parse, or
whose key differs from the one asked for, is rebuilt with a warning. The online corrections
the policy makes while decoding refine the stored profile in the running process.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from workers.atomic_file import write_text_atomic

log = logging.getLogger(__name__)

# Bump when what a stored profile means changes (what `profile_engine` times, the CostModel format).
PROFILE_FORMAT = 1
# Files of a model directory whose name, size and mtime make its digest.
_MODEL_SUFFIXES = (".safetensors", ".bin", ".json", ".gguf")
PROFILE_REPEATS = 3  # timed sweeps of the coarse grid (`CostModel.profile`); the policy corrects online


@functools.cache
def cpu_facts() -> dict[str, Any]:
    """{"cpu": model name, "flags": the `CAPABILITY_FLAGS` this CPU has, and this process's
    effective capability (`workers.cpu_capability.effective_capability`): "torch_capability" (the
    vector ISA torch's kernels dispatch to, e.g. AVX512, AVX2), "onednn_isa_limit",
    "native_bf16", "limited_by" (the environment variables that lower it)}. The flags alone would
    let a run under ``ATEN_CPU_CAPABILITY=avx2`` reuse a profile timed with AVX-512 kernels."""
    from workers.cpu_capability import cpu_identity, effective_capability

    return {**cpu_identity(), **effective_capability()}


def machine_facts(device: torch.device | str = "cpu") -> dict[str, Any]:
    """`cpu_facts` plus torch's thread count and version, and the GPU's name on a CUDA device."""
    facts = dict(cpu_facts(), threads=torch.get_num_threads(), torch=torch.__version__)
    dev = torch.device(device)
    if dev.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(dev)
    return facts


def model_digest(path: str | os.PathLike | None) -> str | None:
    """A fingerprint of a model directory (see the module docstring); None for no model."""
    if path is None:
        return None
    folder = Path(path).expanduser().resolve()
    h = hashlib.sha256(str(folder).encode())
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            if f.suffix in _MODEL_SUFFIXES and f.is_file():
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:24]


def step_backend(engine) -> str:
    """How ``engine``'s decode steps run (`workers.backends.StepBackend.label`): "aot+drafter"
    (compiled packages of both models), "aot" (the target's package, eager drafter passes),
    "compiled" (torch.compile) or "eager"."""
    return engine.backend.label


def step_programs(engine) -> dict[str, Any]:
    """The keys of the compiled packages ``engine`` runs (workers/aot.py: decode, one-row, drafter
    pass, context commit; none on eager steps) and the token counts its one-row program takes: a
    rebuilt package, or another verdict, is another step cost."""
    info = dict(getattr(engine.backend, "info", None) or {})
    keys = [info.get("key")] + [(info.get(part) or {}).get("key") for part in ("one_row", "drafter", "context")]
    verdict = (info.get("one_row") or {}).get("verdict") or {}
    return {"packages": [k for k in keys if k], "one_row_tokens": list(verdict.get("tokens", []))}


def engine_facts(engine) -> dict[str, Any]:
    """The profile key's parts that come from ``engine`` (machine, models, dtype, backend and its
    compiled programs, shape, whether its memory is on huge pages: steps ~1.05-1.14x faster,
    workers/huge_pages.py)."""
    cfg = engine.config
    return {"machine": machine_facts(engine.device), "target": model_digest(cfg.target),
            "drafter": model_digest(cfg.drafter), "dtype": str(engine.dtype).removeprefix("torch."),
            "backend": step_backend(engine), "programs": step_programs(engine),
            "pack": bool(getattr(engine, "pack", False)),
            "huge_pages": bool((getattr(engine, "huge_pages", None) or {}).get("mb")),  # memory really moved
            "max_batch": int(cfg.max_batch), "max_len": int(engine.max_len), "block": int(engine.block)}


def key_digest(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def profiles_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where stored profiles live: ``profiles/`` of the cache directory, or ``$ADAPT_PROFILE_DIR``
    when set and no cache directory is given (the test suite points it at a folder of its own, so
    that tests neither read a user's profiles nor leave theirs behind)."""
    from workers.pull import cache_root

    if cache_dir is None and os.environ.get("ADAPT_PROFILE_DIR"):
        return Path(os.environ["ADAPT_PROFILE_DIR"])
    return cache_root(cache_dir) / "profiles"


def progress(message: str) -> None:
    """One line on stderr (what a user sees while a profile is built)."""
    print(f"adapt: {message}", file=sys.stderr, flush=True)


def read_record(path: Path, facts: dict) -> dict | None:
    """The stored record at ``path`` if it holds ``facts`` as its key; None when there is none;
    a file that does not parse or holds another key is reported (warning) and treated as none."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or record.get("format") != PROFILE_FORMAT:
            raise ValueError("not a profile record of this format")
        if record.get("key") != json.loads(json.dumps(facts, default=str)):
            raise ValueError("its key does not match this machine and engine")
        return record
    except (OSError, ValueError, TypeError) as exc:
        log.warning("stored profile %s is unusable (%s); building it again", path, exc)
        progress(f"warning: stored profile {path} is unusable ({exc}); building it again")
        return None


def write_record(path: Path, facts: dict, **fields) -> None:
    record = {"format": PROFILE_FORMAT, "key": facts, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **fields}
    write_text_atomic(path, json.dumps(record, indent=1, default=str) + "\n")


def coarse_grid(engine) -> dict[str, Any]:
    """`profile_engine` arguments for a first profile: every token count up to 8 and coarser up to
    what this engine's batch verifies (``max_batch · (block + 1)``, at most 128; the table
    extrapolates beyond), `PROFILE_REPEATS` sweeps."""
    from adapt.cost_model import DEFAULT_ROW_GRID, PROFILE_TOKEN_GRID, profile_token_grid

    top = min(max(engine.config.max_batch, 1) * (max(engine.block, 1) + 1), PROFILE_TOKEN_GRID[14])
    return {"token_grid": tuple(profile_token_grid(top)), "row_grid": DEFAULT_ROW_GRID[:7], "repeats": PROFILE_REPEATS}


def engine_profile(engine, cache_dir: str | os.PathLike | None = None, refresh: bool = False,
                   say: Callable[[str], None] | None = progress, **profile_args):
    """(the engine's `CostModel`, info) from the stored profile for its key, else profiled on the spot and
    stored (see the module docstring). ``refresh``: profile again even when one is stored.
    ``profile_args``: `profile_engine` arguments (default: `coarse_grid`); they are part of the key.
    info: {"path", "cached" (True: read from disk, nothing timed), "built_s", "key"}."""
    args = coarse_grid(engine) if not profile_args else profile_args
    facts = dict(engine_facts(engine), profile={k: (list(v) if isinstance(v, tuple) else v) for k, v in args.items()},
                 kind="cost")
    path = profiles_dir(cache_dir) / f"cost-{key_digest(facts)}.json"
    with locked(path):  # workers starting together: one profiles, the others read its file
        return _read_or_build(engine, path, facts, args, refresh, say)


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock beside ``path`` (``<name>.lock``) for the block; no lock where the
    directory cannot be written (the profile is then built and not kept)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "w")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _read_or_build(engine, path: Path, facts: dict, args: dict, refresh: bool, say):
    from adapt.controller import profile_engine
    from adapt.cost_model import CostModel

    record = None if refresh else read_record(path, facts)
    if record is not None:
        try:
            cost = CostModel.from_dict(record["cost"])
            return cost, {"path": str(path), "cached": True, "built_s": record.get("built_s"), "key": facts}
        except (KeyError, TypeError, ValueError) as exc:
            progress(f"warning: stored profile {path} is unusable ({exc}); building it again")
    if say:
        say(f"profiling this machine's step costs for {Path(engine.config.target).name} "
            f"({facts['dtype']}, {facts['backend']}; once per machine and model, kept in {path.parent}) ...")
    t0 = time.perf_counter()
    cost = profile_engine(engine, **args)
    built = round(time.perf_counter() - t0, 2)
    try:
        write_record(path, facts, cost=cost.to_dict(), built_s=built)
    except OSError as exc:  # a read-only cache: use the profile, keep nothing
        log.warning("could not store the profile in %s: %s", path, exc)
    if say:
        say(f"profiled in {built:.1f} s")
    return cost, {"path": str(path), "cached": False, "built_s": built, "key": facts}


def list_profiles(cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every stored profile / dtype choice: path, kind, size (KB) and the main parts of its key."""
    folder = profiles_dir(cache_dir)
    out = []
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:  # (not the .lock files)
        row: dict[str, Any] = {"path": str(f), "kb": round(f.stat().st_size / 1024, 1)}
        try:
            rec = json.loads(f.read_text())
            key = rec.get("key", {})
            row.update(kind=key.get("kind"), dtype=key.get("dtype"), backend=key.get("backend"),
                       created=rec.get("created"), built_s=rec.get("built_s"))
            if "choice" in rec:
                row["choice"] = rec["choice"]
        except (OSError, ValueError, AttributeError):
            row["kind"] = "unreadable"
        out.append(row)
    return out
