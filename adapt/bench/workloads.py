"""Benchmark workloads: chat, code, edit and a mix, made from the held-out stdlib files.

Words used here:
- **chat**: open instructions (workers/training/chat_prompts.py, held-out split): the answers
  are new text, so free drafts copied from the prompt rarely match.
- **code**: "complete this function" with the function's first half given: the answer repeats
  that half and continues it (identifiers and lines recur).
- **edit**: a whole function and a small change to make ("rename the variable x", "add type
  hints", ...): the answer copies long spans of the prompt, as edit / RAG-style requests do
  (where suffix and n-gram drafts win).
- **mixed**: the three in turn, in one run.
- **longdoc**: a long document (the docstrings of held-out stdlib modules, at least
  `LONGDOC_MIN_CHARS` characters: ≥ 1,500 SmolLM2 tokens) and a request to summarise it: the
  answer is new text about a long context, where drafts are accepted least (vLLM #52258).
- **longdoc-chat**: longdoc and chat prompts in turn, in one run (reported per class by the
  prompts' ``workload``).

Every prompt is one user message for the target's chat template (`{"messages": [...]}` JSON
Lines, the format of `adapt bench speed --prompts FILE`), built from functions of the stdlib
files the drafters never trained on (`workers.training.corpus`, held-out split), seeded.

    python -m adapt.bench.workloads --workload edit --count 32 --out edit_prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import random
import textwrap
from pathlib import Path

WORKLOADS = ("chat", "code", "edit", "longdoc", "longdoc-chat", "mixed")
# characters of documentation in a longdoc prompt: SmolLM2's tokenizer reads the stdlib's
# docstrings at 3.4–4.1 characters a token, so 6,500 characters are ≥ 1,500 tokens with a margin
LONGDOC_MIN_CHARS = 6500
LONGDOC_PART_CHARS = 1200  # one docstring's share at most (a document stays under ~2,300 tokens)
MIN_LINES, MAX_LINES = 6, 28  # function sizes used by code and edit prompts


@functools.lru_cache(maxsize=4)
def _functions(seed: int, split: str = "heldout") -> tuple[tuple[str, ast.FunctionDef], ...]:
    """(source, node) of stdlib functions of `split` with MIN_LINES..MAX_LINES lines, shuffled."""
    from workers.training.chat_prompts import parsed_files

    found = []  # (cached: parsing a split's files takes seconds)
    for _, source, tree in parsed_files(split):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                text = textwrap.dedent(ast.get_source_segment(source, node) or "")
                if MIN_LINES <= text.count("\n") + 1 <= MAX_LINES and "\t" not in text:
                    found.append((text, node))
    random.Random(seed).shuffle(found)
    return tuple(found)


def _local_name(node: ast.FunctionDef) -> str | None:
    """A variable the function assigns (for a rename), or None."""
    names = sorted({t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
                    for t in n.targets if isinstance(t, ast.Name) and len(t.id) > 1})
    return names[0] if names else None


def edit_instruction(text: str, node: ast.FunctionDef, rng: random.Random) -> str:
    var = _local_name(node)
    changes = [f"Rename the function to `{node.name}_v2`.", "Add type hints to its parameters.",
               "Add a one-line docstring at the top of it."]
    if var:
        changes.append(f"Rename the variable `{var}` to `{var}_value` everywhere.")
    change = rng.choice(changes)
    return (f"Here is a Python function:\n```python\n{text}\n```\n{change} "
            "Reply with the complete updated function only.")


def code_instruction(text: str) -> str:
    lines = text.splitlines()
    head = "\n".join(lines[: max(2, len(lines) // 2)])
    return f"Complete this Python function. Reply with the whole function:\n```python\n{head}\n```"


@functools.lru_cache(maxsize=8)
def _chat(split: str, count: int, seed: int) -> tuple:
    from workers.training.chat_prompts import make_prompts

    return tuple(make_prompts(split, count, seed=seed))


@functools.lru_cache(maxsize=4)
def _documents(seed: int, split: str = "heldout", min_chars: int = LONGDOC_MIN_CHARS) -> tuple[str, ...]:
    """Documents of ``min_chars`` to ``min_chars + LONGDOC_PART_CHARS`` characters: the module,
    class and function docstrings of `split`'s stdlib files (each cut to `LONGDOC_PART_CHARS`),
    each under a heading naming it, one file after another in a seeded order."""
    from workers.training.chat_prompts import parsed_files

    files = [(path, tree) for path, _, tree in parsed_files(split)]
    random.Random(seed).shuffle(files)
    docs, current, size = [], [], 0
    for path, tree in files:
        seen = set()
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and (doc := ast.get_docstring(node)):
                doc = doc.strip()[:LONGDOC_PART_CHARS]
                if doc in seen:
                    continue
                seen.add(doc)
                name = path.stem if isinstance(node, ast.Module) else f"{path.stem}.{node.name}"
                current.append(f"{name}:\n{doc}")
                size += len(current[-1]) + 2
                if size >= min_chars:
                    docs.append("\n\n".join(current))
                    current, size = [], 0
    return tuple(docs)


def longdoc_instruction(document: str) -> str:
    return (f"Here is the documentation of some Python modules:\n\n{document}\n\n"
            "Summarize what these modules do in one short paragraph.")


def make_workload(name: str, count: int, seed: int = 0, split: str = "heldout") -> list[dict]:
    """`count` prompts of workload `name` as `{"messages": [...], "workload": kind}` dicts, from the
    stdlib files of `split` ('heldout' for benchmarks; 'train' for fitting, e.g. adapt/suffix_fit.py)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {name!r}")
    if name == "mixed":
        parts = {k: make_workload(k, (count + 2) // 3, seed, split) for k in ("chat", "code", "edit")}
        return [parts[k][i // 3] for i, k in zip(range(count), ("chat", "code", "edit") * count)]
    if name == "longdoc-chat":
        parts = {k: make_workload(k, (count + 1) // 2, seed, split) for k in ("longdoc", "chat")}
        return [parts[k][i // 2] for i, k in zip(range(count), ("longdoc", "chat") * count)]
    if name == "chat":
        return [{"messages": m, "workload": "chat"} for m in _chat(split, count, seed)]
    if name == "longdoc":
        docs = _documents(seed, split)
        if not docs:
            raise ValueError(f"workload: no stdlib documentation found in the {split} split")
        return [{"messages": [{"role": "user", "content": longdoc_instruction(docs[i % len(docs)])}],
                 "workload": "longdoc"} for i in range(count)]
    rng = random.Random(seed)
    funcs = _functions(seed, split)
    if not funcs:
        raise ValueError(f"workload: no stdlib functions found in the {split} split")
    out = []
    for i in range(count):
        text, node = funcs[i % len(funcs)]
        content = edit_instruction(text, node, rng) if name == "edit" else code_instruction(text)
        out.append({"messages": [{"role": "user", "content": content}], "workload": name})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="edit", choices=WORKLOADS)
    p.add_argument("--count", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    prompts = make_workload(args.workload, args.count, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(x) + "\n" for x in prompts))
    print(f"{len(prompts)} {args.workload} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
