"""`workers.sampling.argmax`: the two-level search over vocabulary-sized rows gives torch's
`argmax` index (the first maximum) for every shape and tie; the greedy verifier's argmax of the
logits matches the argmax of p it replaced."""

from __future__ import annotations

import pytest
import torch

from workers.sampling import ARGMAX_CHUNK, argmax
from workers.verification import Verifier

V = 48 * ARGMAX_CHUNK  # SmolLM2's 49,152


@pytest.mark.parametrize("shape", [(1, V), (17, V), (2, 3, V), (4, 8 * ARGMAX_CHUNK), (3, 5000), (2, 100), (0, V)])
def test_argmax_is_torch_argmax(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    got = argmax(x)
    assert got.shape == x.shape[:-1] and got.dtype == torch.int64
    assert torch.equal(got, x.argmax(-1))


def test_argmax_takes_the_first_of_tied_maxima():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, V, generator=g)
    x[0, [5000, 40000]] = 9.0                        # in two chunks
    x[1, [ARGMAX_CHUNK + 1, ARGMAX_CHUNK + 6]] = 9.0  # twice in one chunk
    x[2, V - 1] = 9.0                                 # the last column
    x[3, 0] = 9.0                                     # the first column
    x[4] = 1.0                                        # all equal
    x[5] = x[5].bfloat16().float()                    # many ties below the top
    x[6, [ARGMAX_CHUNK - 1, ARGMAX_CHUNK]] = 9.0      # either side of a chunk border
    assert torch.equal(argmax(x), x.argmax(-1))
    assert argmax(x)[:5].tolist() == [5000, ARGMAX_CHUNK + 1, V - 1, 0, 0]


def test_greedy_verification_on_logits_matches_argmax_of_p():
    """Verifier.greedy reads the logits; the tokens and acceptances equal the argmax of
    softmax(logits) that `kernels.verify`'s GREEDY rule reads."""
    g = torch.Generator().manual_seed(2)
    B, Tq = 3, 5
    logits = torch.randn(B, Tq, V, generator=g) * 4
    y = torch.softmax(logits, -1).argmax(-1)  # [B, Tq]
    drafts = y[:, : Tq - 1].clone()
    drafts[1, 2] = (drafts[1, 2] + 1) % V  # row 1 rejects at position 2
    k = torch.tensor([4, 4, 2])
    out = Verifier.greedy(logits, drafts, k)
    assert out.num_accepted.tolist() == [4, 2, 2]
    assert out.tokens[0].tolist() == y[0].tolist()
    assert out.tokens[1, :3].tolist() == y[1, :3].tolist() and out.tokens[1, 3:].tolist() == [-1, -1]
    assert out.tokens[2, :3].tolist() == y[2, :3].tolist()
