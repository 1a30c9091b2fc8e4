"""`--dtype auto` on a CPU: the dtype whose decode steps run fastest on this machine, by measurement.

Which dtype is faster depends on the CPU, not only on the model: bf16 reads half the bytes, so a
one-token step (memory-bound) is faster in bf16 on most CPUs, but without native bf16 dot
products (AVX2 only) every extra token of a verify costs bf16 far more than fp32 (issue 62 on a
2-core AVX2 EPYC: a 16-token forward cost 7.8x a one-token one in bf16, 2.5x in fp32); with
avx512_bf16 or AMX bf16 wins both. So the choice is measured: for each candidate dtype an engine
is loaded and the steps the policy takes at batch 1 are timed (`step_score`): a one-token step,
and a speculative step: a verify of `PROFILE_SPAN` + 1 tokens with its drafter pass. The dtype with
the smaller sum wins.

The choice is stored beside the cost profiles (`adapt.profile_cache`, ``profiles/dtype-<hash>.json``)
under the profile key without the dtype (machine with its effective capability, models, step
backend choice, engine shape, the compiled packages those engines may load), so it is measured
once per machine and model; ``refresh`` measures again. Where the timing engines built those
packages themselves, the choice is stored under the key with them too (the key the next command
reads). `adapt generate` and `adapt serve`'s decoder workers (`resolve_engine_dtype`) ask for the
same key, a batch-1 engine of the pair, so either one's measurement serves the other.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable

CANDIDATES = ("bfloat16", "float32")


def step_score(engine) -> dict[str, float]:
    """ms of the steps a policy takes at batch 1 on ``engine``: ``one`` (a one-token target
    forward), ``verify`` (a forward over `PROFILE_SPAN` + 1 tokens), ``draft`` (one drafter pass
    over a block row; 0 without a drafter) and ``score`` = one + verify + draft. Timed with
    `adapt.controller.profile_engine`'s own calls (no per-step overhead steps)."""
    from adapt.controller import PROFILE_SPAN, profile_engine

    wide = min(PROFILE_SPAN, max(engine.block, 1)) + 1
    cost = profile_engine(engine, token_grid=(1, wide), row_grid=(1, 2), repeats=3, overhead_steps=0)
    one, verify = float(cost.verify.at(1.0)), float(cost.verify.at(float(wide)))
    draft = float(cost.draft_pass.at(1.0)) if engine.drafter is not None else 0.0
    return {"one": round(one, 3), "verify": round(verify, 3), "verify_tokens": wide, "draft": round(draft, 3),
            "score": round(one + verify + draft, 3)}


def _reason(best: str, scores: dict[str, dict[str, float]]) -> str:
    """One sentence: why ``best`` won, with each candidate's timings."""
    parts = [f"{d}: one-token step {s['one']:.1f} ms, {s['verify_tokens']}-token verify {s['verify']:.1f} ms"
             + (f" + drafter pass {s['draft']:.1f} ms" if s["draft"] else "") for d, s in scores.items()]
    return f"measured on this machine, {best} is faster ({'; '.join(parts)})"


def choice_facts(target, drafter, compile_choice: str = "auto", max_batch: int = 1, max_len: int | None = None) -> dict:
    """The key of a stored choice for a command line's models and options (the profile key
    without the dtype): machine, both models' digests, the --compile choice, engine shape and the
    compiled packages in the cache directory built for the timing engines' cache shape (`max_batch`
    rows of `timing_cache_length`: those they may load; a package of another shape, say a
    benchmark's 8 rows or its longer prompts, leaves the choice standing)."""
    from pathlib import Path

    from adapt.profile_cache import machine_facts, model_digest
    from workers.package_cache import list_packages
    from workers.engine import EngineConfig

    max_len = int(max_len or EngineConfig.max_len)
    packages = []
    if compile_choice in ("auto", "aot"):  # the other choices load no package
        shape = [int(max_batch), timing_cache_length(drafter, max_len)]  # rows, positions
        packages = sorted(Path(p["path"]).name for p in list_packages()
                          if (p.get("cache_shape") or [None] * 3)[0:3:2] == shape)
    return {"machine": machine_facts("cpu"), "target": model_digest(target), "drafter": model_digest(drafter),
            "compile": compile_choice, "packages": packages, "max_batch": int(max_batch), "max_len": max_len}


def timing_cache_length(drafter, max_len: int) -> int:
    """Positions in the KV caches of an engine of these models and `max_len` (`Engine`: max_len,
    its widest draft, one more): the drafter's block, or `SUFFIX_WIDTH` without a drafter."""
    import json
    from pathlib import Path

    from workers.engine import SUFFIX_WIDTH

    config = None if drafter is None else Path(drafter) / "config.json"
    width = json.loads(config.read_text())["block_size"] if config is not None and config.is_file() else SUFFIX_WIDTH
    return max_len + int(width) + 1


def _choice_path(facts: dict, candidates: tuple[str, ...], cache_dir) -> tuple[dict, "os.PathLike"]:
    from adapt.profile_cache import key_digest, profiles_dir

    facts = dict(facts, kind="dtype", candidates=list(candidates))
    return facts, profiles_dir(cache_dir) / f"dtype-{key_digest(facts)}.json"


def stored_choice(facts: dict, cache_dir: str | os.PathLike | None = None,
                  candidates: tuple[str, ...] = CANDIDATES) -> dict | None:
    """The stored choice for ``facts`` ({"dtype", "reason", "ms", ...}), None when none is stored."""
    from adapt.profile_cache import read_record

    facts, path = _choice_path(facts, candidates, cache_dir)
    record = read_record(path, facts)
    choice = record.get("choice") if record else None
    return dict(choice, path=str(path)) if isinstance(choice, dict) and choice.get("dtype") in candidates else None


def _compile_choice(config: dict) -> str:
    """The CLIs' ``--compile`` choice behind engine options (``compile``, ``aot_build``; the engine's
    default is eager): the package-if-built setting is "auto" whichever way the options spell it."""
    from workers.engine import EngineConfig

    choice = config.get("compile", EngineConfig.compile)
    choice = {False: "off", True: "on"}[choice] if isinstance(choice, bool) else str(choice)
    return "auto" if choice == "aot" and config.get("aot_build") is False else choice


def resolve_engine_dtype(config: dict, cache_dir: str | os.PathLike | None = None, refresh: bool = False,
                         say: Callable[[str], None] | None = None) -> tuple[dict, dict | None]:
    """(``config`` with a CPU engine's ``dtype: "auto"`` replaced by this machine's measured choice,
    the choice {"dtype", "reason", "cached", "ms", "path"}); ``config`` unchanged and None for a given
    dtype or a GPU (`workers.target_model.resolve_dtype` decides there).

    ``config``: `workers.engine.EngineConfig` keyword arguments (a serving worker's engine options).
    The choice is `adapt generate`'s: timed on batch-1 engines of the same models and compile
    choice (`choice_facts`), read back when stored, so a worker that starts on a machine where
    either command ran times nothing; the timing engines are dropped before the worker builds
    its own."""
    import torch

    device = str(config.get("device", "auto"))
    on_cpu = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device).type == "cpu"
    if config.get("dtype", "auto") != "auto" or not on_cpu:
        return config, None
    facts = choice_facts(config["target"], config.get("drafter"), _compile_choice(config))
    choice = None if refresh else stored_choice(facts, cache_dir)
    if choice is not None:
        choice = dict(choice, cached=True)
    else:
        from workers.engine import Engine, EngineConfig

        timing = {k: config[k] for k in ("target", "drafter", "device", "compile", "aot_build") if k in config}

        def make_engine(dtype: str):
            engine = Engine(EngineConfig(**timing, dtype=dtype, max_batch=1, huge_pages=False))  # a few timings: not worth ~3 s
            engine.warm_up()
            return engine

        engine, choice = choose_dtype(make_engine, facts, cache_dir, refresh=refresh, say=say)
        del engine
        gc.collect()
        if not choice["cached"]:
            keep_under_built_packages(facts, choice, config, cache_dir)
    return dict(config, dtype=choice["dtype"]), choice


def keep_under_built_packages(facts: dict, choice: dict, config: dict, cache_dir) -> None:
    """Store a fresh ``choice`` again under the key the next command will ask for, where its
    timing engines built the compiled packages of their shape (``--compile aot`` on an empty
    cache): the key read before timing lists no package, the next command's lists them, and it
    would time both dtypes again (measured: a second benchmark run re-timed them, 24.7 s)."""
    after = choice_facts(config["target"], config.get("drafter"), _compile_choice(config))
    if after != facts:
        _keep(*_choice_path(after, CANDIDATES, cache_dir), choice)


def _keep(facts: dict, path, choice: dict) -> None:
    """Write ``choice`` (less what only a read answer carries: "cached", "path") as the record of
    ``facts`` at ``path``; a cache directory that cannot be written keeps nothing."""
    from adapt.profile_cache import write_record

    stored = {k: v for k, v in choice.items() if k not in ("cached", "path")}
    try:
        write_record(path, facts, choice=stored, built_s=stored.get("measured_s"))
    except OSError:
        pass


def choose_dtype(make_engine: Callable[[str], Any], facts: dict, cache_dir: str | os.PathLike | None = None,
                 refresh: bool = False, candidates: tuple[str, ...] = CANDIDATES,
                 say: Callable[[str], None] | None = None):
    """(engine in the chosen dtype, choice) where choice = {"dtype", "reason", "cached", "ms"}.

    ``make_engine(dtype)`` builds a ready engine; ``facts``: the profile key without the dtype
    (`adapt.profile_cache.engine_facts` minus "dtype", or the same parts from a command line).
    With a stored choice for ``facts`` only the chosen engine is built and nothing is timed."""
    from adapt.profile_cache import locked

    facts, path = _choice_path(facts, candidates, cache_dir)
    with locked(path):  # workers starting together: one measures, the others read its file
        return _read_or_choose(make_engine, facts, path, refresh, candidates, say)


def _read_or_choose(make_engine, facts: dict, path, refresh: bool, candidates: tuple[str, ...], say):
    from adapt.profile_cache import progress, read_record

    say = progress if say is None else say
    record = None if refresh else read_record(path, facts)
    choice = record.get("choice") if record else None
    if isinstance(choice, dict) and choice.get("dtype") in candidates:
        return make_engine(choice["dtype"]), dict(choice, cached=True, path=str(path))
    say(f"timing decode steps in {', '.join(candidates)} to pick the faster dtype on this machine "
        f"(once per machine and model, kept in {path.parent}) ...")
    t0 = time.perf_counter()
    best, best_engine, scores = None, None, {}
    for dtype in candidates:
        engine = make_engine(dtype)
        scores[dtype] = step_score(engine)
        if best is None or scores[dtype]["score"] < scores[best]["score"]:
            best, best_engine = dtype, engine
        else:
            del engine
        gc.collect()
    choice = {"dtype": best, "reason": _reason(best, scores), "ms": scores,
              "measured_s": round(time.perf_counter() - t0, 2)}
    _keep(facts, path, choice)
    say(f"dtype {best} (measured in {choice['measured_s']:.1f} s): {choice['reason']}")
    return best_engine, dict(choice, cached=False, path=str(path))
