"""Acceptance rules and verification kernels (Triton on CUDA, torch references elsewhere).

`verify` checks a ragged batch of drafts under per-row rules (`Rule`); `select_commit` picks
the positions a denoising step of the drafter commits. Imports nothing else of the project;
Triton is imported only when a Triton backend is used.
"""

from kernels.denoise import select_commit
from kernels.layout import RaggedLayout
from kernels.noise import Noise, draw_noise
from kernels.rules import (DEFAULT_PARAMS, EXACT_RULES, LOSSY_RULES, NEEDS_DRAFT_PROBS, Rule, is_exact,
                           parse_rule)
from kernels.verify import VerifyOutput, verify

__all__ = [
    "DEFAULT_PARAMS", "EXACT_RULES", "draw_noise", "LOSSY_RULES", "NEEDS_DRAFT_PROBS", "Noise",
    "RaggedLayout", "Rule", "VerifyOutput", "is_exact", "parse_rule", "select_commit", "verify",
]
