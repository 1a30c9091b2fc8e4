"""Streaming detokenization (workers/detokenize.py): multi-byte characters split across tokens,
chunks of any size, both schemes (DecodeStream and the sliding window), without decoding the
whole output per chunk."""

from __future__ import annotations

import random

import pytest

TEXT = "héllo wörld — naïve café: 中文字符 and 🙂🚀 done\nΣ = ∑ ≠ ≈ ©\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.tiny_models import _save_tokenizer

    out = tmp_path_factory.mktemp("tok")
    _save_tokenizer(512, out)  # byte-level BPE trained on ASCII: every non-ASCII character is split into bytes
    return AutoTokenizer.from_pretrained(out)


class _Counting:
    """The tokenizer, counting how many ids each decode call is handed."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []
        self.backend_tokenizer = getattr(tok, "backend_tokenizer", None)

    def decode(self, ids, **kw):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kw)


def _split_chars(tok, ids) -> int:
    """How many tokens do not decode to whole characters on their own."""
    return sum("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "window"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunks_never_split_a_character_and_add_up_to_the_text(tokenizer, use_stream, seed):
    from workers.detokenize import StreamDetokenizer

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT and _split_chars(tokenizer, ids) >= 20
    rng = random.Random(seed)
    det = StreamDetokenizer(tokenizer, use_stream=use_stream)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 2, 3, 5, 17])  # one engine step emits 1..k+1 tokens
        deltas.append(det.add(ids[i:i + n], final=i + n >= len(ids)))
        i += n
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == TEXT == det.text
    assert sum(bool(d) for d in deltas) >= len(deltas) // 2  # text flows as it completes


@pytest.mark.parametrize("use_stream", [True, False], ids=["DecodeStream", "window"])
def test_an_output_cut_inside_a_character_ends_like_a_full_decode(tokenizer, use_stream):
    from workers.detokenize import StreamDetokenizer

    ids = tokenizer.encode("ok 🙂", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never comes (max_tokens reached)
    det = StreamDetokenizer(tokenizer, use_stream=use_stream)
    pieces = [det.add([t], final=False) for t in cut[:-1]] + [det.add(cut[-1:], final=True)]
    assert "".join(pieces) == tokenizer.decode(cut) and pieces[-1].endswith("\ufffd")
    assert "\ufffd" not in "".join(pieces[:-1])


def test_special_tokens_are_skipped(tokenizer):
    from workers.detokenize import StreamDetokenizer

    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("a é", add_special_tokens=False)
    for use_stream in (True, False):
        det = StreamDetokenizer(tokenizer, use_stream=use_stream)
        assert det.add(ids, False) + det.add([eos], True) == "a é"


def test_each_chunk_decodes_only_a_window(tokenizer):
    """The window scheme decodes the previous chunk and the new tokens, never the whole output."""
    from workers.detokenize import StreamDetokenizer

    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    counting = _Counting(tokenizer)
    det = StreamDetokenizer(counting, use_stream=False)
    for i in range(0, len(ids), 3):
        det.add(ids[i:i + 3], final=i + 3 >= len(ids))
    assert det.text == TEXT * 20
    assert len(ids) > 1000 and max(counting.sizes) <= 32, max(counting.sizes)  # a run of split characters at most


def test_find_stop_searches_only_the_new_tail():
    from workers.detokenize import find_stop

    text = "abc STOP def" + "x" * 5
    assert find_stop(text, ["STOP"], start=len("abc STO")) == 4  # a stop completed by the new text
    assert find_stop(text, ["STOP"], start=len("abc STOP def")) is None  # found earlier already
    assert find_stop(text, [], 0) is None and find_stop("ab", ["b", "a"], 0) == 0
