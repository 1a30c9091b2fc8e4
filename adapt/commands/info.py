"""`adapt info`: what this machine can do and what adapt has chosen and kept for it.

    adapt info            # a readable summary
    adapt info --json     # the same as one JSON object

Prints the machine's capability (CPU model, the instruction sets torch's kernels and oneDNN
really use, and the environment variables that limit them: workers/cpu_capability.py; cores and
torch threads, torch version, CUDA devices, the kernel's transparent huge page mode:
workers/huge_pages.py), the dtype and step backend `adapt generate` would
use for the pair and why (a measured `--dtype auto` choice, adapt/dtype_choice.py; the compiled
packages `--compile auto` loads, workers/aot.py), and what the cache directory holds: pulled
models, compiled packages, stored cost profiles and dtype choices (adapt/profile_cache.py), with
their sizes. Nothing is timed, built or pulled.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from adapt.commands import add_pair_arguments
from workers.request import COMPILE_CHOICES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("info", help="machine capability, chosen dtype and step backend, what is cached",
                              description=__doc__.split("\n\n")[0])
    add_pair_arguments(p)
    p.add_argument("--compile", default="auto", choices=COMPILE_CHOICES,
                   help="the --compile choice to report for (default auto; workers/backends.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _dir_mb(path: Path) -> float:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return round(total / 2**20, 1)


def machine() -> dict:
    """The machine's capability as torch sees it."""
    import torch

    from adapt.profile_cache import cpu_facts
    from workers import huge_pages

    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - a torch build without oneDNN
        native_bf16 = False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return dict(cpu_facts(), native_bf16_matmul=native_bf16, cores=cores, torch_threads=torch.get_num_threads(),
                torch=torch.__version__, cuda=cuda, transparent_huge_pages=huge_pages.thp_mode())


def chosen(pair: str, target, drafter, cache_dir, compile_choice: str) -> dict:
    """The dtype and step backend `adapt generate` would use for these models, and why."""
    import torch

    from adapt.dtype_choice import choice_facts, stored_choice
    from workers.package_cache import list_packages
    from workers.backends import resolve_backend

    out: dict = {"pair": pair, "target": str(target), "drafter": None if drafter is None else str(drafter)}
    if not (Path(target) / "config.json").is_file():
        out["dtype"] = {"dtype": None, "why": f"the target is not there yet ({target}); `adapt pull {pair}` fetches it"}
    else:
        found = stored_choice(choice_facts(target, drafter, compile_choice), cache_dir)
        out["dtype"] = ({"dtype": found["dtype"], "why": found["reason"], "stored": found["path"]} if found else
                        {"dtype": None, "why": "not measured yet: the first `adapt generate` (--dtype auto) times "
                                              "bfloat16 and float32 decode steps and keeps the faster"})
    packages = list_packages()
    backend = resolve_backend(compile_choice, "cuda" if torch.cuda.is_available() else "cpu")
    if compile_choice == "auto":
        why = (f"{len(packages)} compiled package(s) in the cache: loaded where one was built for this model and "
               "engine shape, else eager steps" if packages else
               "eager steps: no compiled package is built (`adapt compile` builds them: ~1.7x faster steps on a CPU)")
    else:
        why = {"aot": "--compile aot: the compiled packages, built at start when missing (minutes)",
               "compiled": "--compile on: torch.compile in every process (minutes at start)",
               "eager": "--compile off: eager steps"}[backend.name]
    out["step_backend"] = {"compile": compile_choice, "backend": backend.name, "builds": backend.builds, "why": why}
    return out


def cached(cache_dir) -> dict:
    """What the cache directory holds: models, compiled packages, profiles, with sizes."""
    from adapt.profile_cache import list_profiles
    from workers.package_cache import list_packages
    from workers.pull import cache_root

    root = cache_root(cache_dir)
    models_dir = root / "models"
    models = [{"name": d.name, "path": str(d), "mb": _dir_mb(d)} for d in sorted(models_dir.iterdir())
              if d.is_dir()] if models_dir.is_dir() else []
    packages = [{k: p[k] for k in ("path", "kind", "mb", "verdict") if k in p} for p in list_packages()]
    crossovers = root / "crossovers.json"
    return {"cache_dir": str(root), "models": models, "packages": packages, "profiles": list_profiles(cache_dir),
            "wide_rows": str(crossovers) if crossovers.is_file() else None}


def report(args) -> dict:
    from workers.pairs import get_pair

    p = get_pair(args.pair, args.cache_dir)
    target = Path(args.target) if args.target else p.target
    drafter = (None if str(args.drafter).lower() == "none" else Path(args.drafter)) if args.drafter else p.drafter
    return {"machine": machine(), "chosen": chosen(args.pair, target, drafter, args.cache_dir, args.compile),
            "cache": cached(args.cache_dir)}


def _verdict(verdict: dict | None) -> str:
    """A one-row program's verdict (workers/aot.py `aot_one_row`) in words: its time over the decode
    package's per token count, and the counts it runs."""
    if not verdict:
        return ""
    ratios = ", ".join(f"{t} token(s) {b / a:.2f}x" for t, (a, b) in verdict["ms"].items() if a > 0)
    runs = ", ".join(map(str, verdict["tokens"])) or "none"
    return f"; measured against the decode package at one row: {ratios}; runs one-row calls of {runs} token(s)"


def _text(info: dict) -> str:
    m, c, k = info["machine"], info["chosen"], info["cache"]
    limited = m.get("limited_by") or {}
    lines = [f"machine: {m['cpu']} ({m['cores']} cores, torch {m['torch']} on {m['torch_threads']} threads, "
             f"kernels {m['torch_capability']}"
             + (f", oneDNN limited to {m['onednn_isa_limit']}" if m.get("onednn_isa_limit") else "") + ")",
             f"  flags: {' '.join(m['flags']) or 'none of ' + 'avx2/avx512/amx'}; native bf16 matmuls: "
             f"{'yes' if m['native_bf16_matmul'] else 'no'}",
             *([f"  capability limited by the environment ({' '.join(f'{k}={v}' for k, v in limited.items())}): "
                f"this process runs below the CPU's flags, and profiles, dtype choices and packages are kept "
                f"apart for it"] if limited else []),
             f"  cuda: {', '.join(m['cuda']) or 'none'}",
             f"  transparent huge pages: {m['transparent_huge_pages'] or 'not available'} (engines move their weights "
             f"onto them where the kernel allows: workers/huge_pages.py)",
             f"pair {c['pair']}: target {c['target']}",
             f"  dtype: {c['dtype']['dtype'] or '-'}: {c['dtype']['why']}",
             f"  step backend: {c['step_backend']['backend']}: {c['step_backend']['why']}",
             f"cache {k['cache_dir']}:"]
    lines += [f"  model {x['name']}: {x['mb']} MB" for x in k["models"]] or ["  no models pulled"]
    lines += [f"  package {x['kind']}: {x['mb']} MB ({x['path']}){_verdict(x.get('verdict'))}"
              for x in k["packages"]] or ["  no compiled packages"]
    for x in k["profiles"]:
        what = f"dtype choice {x['choice']['dtype']}" if x.get("choice") else f"cost profile ({x.get('dtype')}, {x.get('backend')})"
        lines.append(f"  {what}: {x['kb']} KB, {x.get('created')} ({x['path']})")
    if not k["profiles"]:
        lines.append("  no stored profiles (the first `adapt generate` builds one)")
    return "\n".join(lines)


def run(args) -> int:
    try:
        info = report(args)
    except ValueError as exc:
        print(f"adapt info: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1) if args.json else _text(info))
    return 0
