"""Write (or check) the demo pair's manifest: what is shipped, how it was made, how good it is.

    python -m workers.training.manifest --root models/demo --build models/demo/build.sh
    python -m workers.training.manifest --root models/demo --check

MANIFEST.json holds the sha256 and size of every shipped file (checkpoints excluded), the exact
commands of the build script, the seeds, the software versions, the target's held-out metrics and
the drafter's evaluation (τ and per-position acceptance per temperature, s and commit order).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import shlex
import sys
from pathlib import Path

SIZE_LIMIT_MB = 40.0


def shipped_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and "checkpoint" not in p.relative_to(root).parts
                  and p.name != "MANIFEST.json")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_commands(build_script: Path) -> list[str]:
    """The python commands of the build script (continuation lines joined)."""
    text = build_script.read_text().replace("\\\n", " ")
    cmds = [re.sub(r"\s+", " ", line).strip() for line in text.splitlines()]
    return [c for c in cmds if re.match(r'^(\$PY|"\$PY"|python)\b', c)]


def seeds_of(commands: list[str]) -> dict:
    seeds = {}
    for cmd in commands:
        words = shlex.split(cmd)
        if "--seed" in words:
            name = ("target" if "workers.training.target" in cmd else "drafter" if "train-drafter" in cmd
                    else "policy" if "bench policies" in cmd else cmd[:40])
            seeds[name] = int(words[words.index("--seed") + 1])
    return seeds


def write_manifest(root: Path, build_script: Path) -> dict:
    import tokenizers
    import torch
    import transformers

    files = {p.relative_to(root).as_posix(): {"sha256": sha256(p), "bytes": p.stat().st_size} for p in shipped_files(root)}
    total_mb = sum(f["bytes"] for f in files.values()) / 2**20
    if total_mb > SIZE_LIMIT_MB:
        raise ValueError(f"shipped files total {total_mb:.1f} MB, over the {SIZE_LIMIT_MB} MB limit")
    commands = build_commands(build_script)
    target_metrics = json.loads((root / "target" / "train_metrics.json").read_text()) if (root / "target" / "train_metrics.json").exists() else {}
    drafter_eval = json.loads((root / "drafter" / "eval.json").read_text()) if (root / "drafter" / "eval.json").exists() else {}
    target_eval = json.loads((root / "target_eval.json").read_text()) if (root / "target_eval.json").exists() else {}
    manifest = {
        "v": 1,
        "files": files,
        "total_mb": round(total_mb, 2),
        "build_script": build_script.as_posix(),
        "commands": commands,
        "seeds": seeds_of(commands),
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "stdlib_corpus": f"Python {sys.version_info.major}.{sys.version_info.minor} standard library"},
        "target_heldout": target_metrics.get("heldout", {}),
        "target_eval": target_eval,
        "drafter_eval": drafter_eval.get("eval", []),
        "drafter_eval_setup": drafter_eval.get("eval_setup", {}),
    }
    (root / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check_manifest(root: Path) -> list[str]:
    """Files whose hash or presence differs from MANIFEST.json (empty when all match)."""
    manifest = json.loads((root / "MANIFEST.json").read_text())
    problems = []
    for rel, meta in manifest["files"].items():
        path = root / rel
        if not path.exists():
            problems.append(f"missing: {rel}")
        elif sha256(path) != meta["sha256"]:
            problems.append(f"sha256 differs: {rel}")
    extra = {p.relative_to(root).as_posix() for p in shipped_files(root)} - set(manifest["files"])
    problems += [f"not in manifest: {rel}" for rel in sorted(extra)]
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("models/demo"))
    p.add_argument("--build", type=Path, default=Path("models/demo/build.sh"))
    p.add_argument("--check", action="store_true", help="verify the files against MANIFEST.json")
    args = p.parse_args(argv)
    if args.check:
        problems = check_manifest(args.root)
        print("\n".join(problems) or "all files match MANIFEST.json")
        return 1 if problems else 0
    m = write_manifest(args.root, args.build)
    print(f"wrote {args.root / 'MANIFEST.json'}: {len(m['files'])} files, {m['total_mb']} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
