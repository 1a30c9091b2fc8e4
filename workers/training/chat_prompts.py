"""Instruction prompts for a chat target, made from material every Python install ships.

A drafter for an instruct model must learn what the model says *as an assistant*, so its training
data are the model's own answers to instructions. The instructions are built from the Python
standard library's source (the demo corpus, workers/training/corpus.py, with its train / held-out
split by file): every documented function or class gives one prompt from one of a few task
templates (write code from a docstring, explain code, document code, summarise a docstring,
answer a question about an API). The held-out split gives the evaluation prompts.

    python -m workers.training.chat_prompts --split heldout --count 64 --out prompts.jsonl

Each JSONL line is `{"messages": [{"role": "user", "content": ...}]}`, the format of
`adapt bench speed --prompts FILE`.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import textwrap
from pathlib import Path

from workers.training.corpus import stdlib_files, stdlib_root

MAX_SNIPPET_LINES = 24
MAX_DOC_CHARS = 600


def _first_sentence(doc: str) -> str:
    line = " ".join(doc.strip().split("\n\n")[0].split())
    cut = line.find(". ")
    return (line if cut < 0 else line[: cut + 1]).rstrip(".")


def _snippet(source: str, node: ast.AST) -> str:
    text = textwrap.dedent(ast.get_source_segment(source, node, padded=True) or "")
    return "\n".join(text.splitlines()[:MAX_SNIPPET_LINES])


def _signature(node: ast.FunctionDef) -> str:
    args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    return f"{node.name}({', '.join(args)})"


def _tasks(module: str, source: str, node: ast.AST) -> list[str]:
    """The prompts one documented definition can give."""
    doc = ast.get_docstring(node) or ""
    sentence = _first_sentence(doc)
    if len(sentence) < 12:
        return []
    code = _snippet(source, node)
    kind = "class" if isinstance(node, ast.ClassDef) else "function"
    name = node.name if kind == "class" else _signature(node)
    short = doc.strip()[:MAX_DOC_CHARS]
    tasks = [
        f"Write a Python {kind} `{name}`: {sentence[0].lower() + sentence[1:]}.",
        f"Explain what this Python code does:\n```python\n{code}\n```",
        f"What does `{module}.{node.name}` do in Python? Give a short example.",
        f"Summarize this documentation in two sentences:\n\n{short}",
    ]
    if kind == "function" and code.count("\n") >= 3:
        tasks.append(f"Add comments to this function:\n```python\n{code}\n```")
    return tasks


def parsed_files(split: str):
    """(path, source, syntax tree) of every stdlib file of `split` that reads and parses."""
    for path in stdlib_files(split):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        yield path, source, tree


def make_prompts(split: str, count: int, seed: int = 0) -> list[list[dict]]:
    """`count` chat conversations (one user message each) from stdlib files of `split`, seeded."""
    root = stdlib_root()
    pool: list[str] = []
    for path, source, tree in parsed_files(split):
        module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                pool.extend(_tasks(module, source, node))
    if not pool:
        raise ValueError(f"no documented definitions found in the stdlib split {split!r}")
    rng = random.Random(seed)
    rng.shuffle(pool)
    picked = pool[:count] if count <= len(pool) else [rng.choice(pool) for _ in range(count)]
    return [[{"role": "user", "content": text}] for text in picked]


def write_jsonl(conversations: list[list[dict]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="heldout", choices=["train", "heldout"])
    p.add_argument("--count", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    write_jsonl(make_prompts(args.split, args.count, args.seed), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
