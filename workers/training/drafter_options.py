"""Command-line options of drafter training (no heavy imports: `adapt --help` stays fast)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, required=True, help="target HF directory (Llama / Qwen2 / Qwen3)")
    p.add_argument("--out", type=Path, required=True, help="drafter output directory")
    p.add_argument("--data", nargs="*", default=None,
                   help="training text: files or directories (default: the stdlib training split)")
    p.add_argument("--eval-data", nargs="*", default=None,
                   help="held-out text for the final evaluation (default: the stdlib held-out split)")
    p.add_argument("--regenerate", action="store_true", help="train on the target's own continuations")
    p.add_argument("--features", type=Path, nargs="+", default=None,
                   help="train on harvest directories instead (the target's answers and hidden states, "
                        "workers.training.harvest), concatenated: no target forward while training")
    p.add_argument("--init", type=Path, default=None,
                   help="with --features: warm start from this drafter directory (its shape and draft vocabulary)")
    p.add_argument("--soft-weight", type=float, default=0.0,
                   help="with --features: share of the loss on the target's top-k soft labels (harvest --top-k)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="with --features: a reduced draft vocabulary of the N most frequent answer tokens (0 = all)")
    p.add_argument("--sample-frac", type=float, default=0.25,
                   help="share of regenerated rows sampled at temperature 1 (rest greedy)")
    p.add_argument("--num-sequences", type=int, default=2048, help="regenerated sequences in the pool")
    p.add_argument("--regen-batch", type=int, default=128, help="rows generated together")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of a regenerated sequence")
    p.add_argument("--seq-len", type=int, default=384, help="tokens per training sequence")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--anchors", type=int, default=24, help="anchor positions per sequence")
    p.add_argument("--layers", type=int, default=2, help="drafter transformer layers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layer-ids", type=int, nargs="*", default=None, help="target layers feeding the context")
    p.add_argument("--intermediate", type=int, default=None, help="drafter MLP size (default: the target's)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--gamma", type=float, default=7.0, help="position weight decay w_k = exp(-(k-1)/gamma)")
    p.add_argument("--tv-weight", type=float, default=1.0, help="λ, weight of the TV term")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint/state.pt")
    p.add_argument("--stop-after", type=int, default=0,
                   help="checkpoint and exit after this many steps of this run (time-sliced training; then --resume)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    p.add_argument("--no-compile", action="store_true",
                   help="eager loss terms (default: compiled with torch.compile, ~3x faster on CPU)")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the evaluation (0 = skip)")
    p.add_argument("--eval-prompt-len", type=int, default=128)
    p.add_argument("--eval-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N data files (tests)")
    p.add_argument("--no-progress", action="store_true")
