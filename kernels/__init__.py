"""Acceptance rules and verification kernels (Triton on CUDA, torch references elsewhere).

`verify` checks a ragged batch of drafts under per-row rules (the table `kernels.rules.RULES`); `select_commit` picks
the positions a denoising step of the drafter commits. Imports nothing else of the project;
Triton is imported only when a Triton backend is used.
"""

from kernels.denoise import select_commit
from kernels.layout import RaggedLayout
from kernels.noise import Noise, draw_noise
from kernels.rules import (DEFAULT_PARAMS, EXACT_RULES, LENIENT_RULE, LOSSY_RULES, NEEDS_DRAFT_PROBS, RULES, Param,
                           Rule, RuleSpec, is_exact, parse_rule, register, rule_name, spec_of)
from kernels.verify import VerifyOutput, verify, verify_greedy

__all__ = [
    "DEFAULT_PARAMS", "EXACT_RULES", "draw_noise", "LENIENT_RULE", "LOSSY_RULES", "NEEDS_DRAFT_PROBS", "Noise",
    "Param", "RULES", "RaggedLayout", "Rule", "RuleSpec", "VerifyOutput", "is_exact", "parse_rule", "register",
    "rule_name", "select_commit", "spec_of", "verify", "verify_greedy",
]
