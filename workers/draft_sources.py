"""Draft sources: where a row's draft comes from in a decode step, named by a small integer code.

A decision maker names one source per row (`workers.decisions.DraftIntent.source`, a [B] int64
host tensor of these codes); the engine drafts each row from its source and verifies the drafts
of all rows together.

- ``none`` (code 0): no draft; the row decodes one token autoregressively;
- ``diffusion`` (code 1): the block-diffusion drafter denoises ``[anchor, MASK x span]`` in the
  row's ``steps`` passes (workers/drafting.py);
- ``suffix`` (code 2): the row copies the continuation of its longest match in text already seen
  (workers/suffix.py): free to draft, a point mass, so only exact rules apply.
"""

from __future__ import annotations

NONE_CODE = 0       # no draft
DIFFUSION_CODE = 1  # the block-diffusion drafter
SUFFIX_CODE = 2     # the suffix drafter's copy
