"""Incremental detokenization for streamed outputs: each chunk decodes only its new tokens.

`StreamDetokenizer.add(ids, final)` returns the text that `ids` complete. It never re-decodes
the whole output: with a fast tokenizer it feeds the Rust `tokenizers.decoders.DecodeStream`
(which keeps a window of a few tokens), otherwise it decodes a sliding window between two offsets
(the prefix/read-offset scheme of Hugging Face's ``TextStreamer`` and vLLM). Either way a
character whose UTF-8 bytes are split across tokens (byte-level BPE splits most non-ASCII
characters) is held back until its last byte arrives, so no chunk carries a half character
(U+FFFD); at the end, bytes that never completed a character are flushed as U+FFFD, which is what
decoding the whole output at once shows. The concatenated chunks equal
``tokenizer.decode(all_ids, skip_special_tokens=True)`` for byte-level tokenizers.

`find_stop(text, stops, start)` looks for stop strings only in the tail that a chunk can have
completed, so a long output is not re-scanned every chunk.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StreamDetokenizer", "find_stop"]

_REPLACEMENT = "\ufffd"


class StreamDetokenizer:
    """See the module docstring. tokenizer: a transformers tokenizer; use_stream: None = use
    `DecodeStream` when the tokenizer has a fast backend and the installed ``tokenizers`` has it."""

    def __init__(self, tokenizer: Any, use_stream: bool | None = None):
        self.tokenizer = tokenizer
        self.text = ""  # everything emitted so far
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if use_stream is not False and backend is not None:
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:  # tokenizers < 0.21
                DecodeStream = None  # noqa: N806
            if DecodeStream is not None:
                self._backend = backend
                self._stream = DecodeStream(skip_special_tokens=True)
        if use_stream and self._stream is None:
            raise ValueError("use_stream: this tokenizer (or tokenizers version) has no DecodeStream")
        self._pending: list[int] = []  # DecodeStream: ids fed since its last piece of text
        self._ids: list[int] = []  # window scheme: the last emitted chunk's ids, then those not emitted yet
        self._read = 0  # window scheme: how many of `_ids` were emitted (the left context)

    def add(self, ids: list[int], final: bool = False) -> str:
        """The text completed by `ids` (the next tokens of the output); ``final``: the output ends here."""
        delta = self._add_stream(ids, final) if self._stream is not None else self._add_window(ids, final)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _add_stream(self, ids: list[int], final: bool) -> str:
        pieces = []
        for tok in ids:
            piece = self._stream.step(self._backend, int(tok))
            if piece is None:
                self._pending.append(int(tok))
            else:
                self._pending.clear()
                pieces.append(piece)
        if final and self._pending:  # an incomplete character at the very end
            pieces.append(self._decode(self._pending))
            self._pending.clear()
        return "".join(pieces)

    def _add_window(self, ids: list[int], final: bool) -> str:
        self._ids.extend(int(t) for t in ids)
        done = self._decode(self._ids[:self._read])
        now = self._decode(self._ids)
        if len(now) <= len(done) or (now.endswith(_REPLACEMENT) and not final):
            return ""  # nothing new, or a character still incomplete
        delta = now[len(done):]
        # the tokens of this chunk stay as left context of the next window (a word's leading space
        # may depend on them); everything before them is forgotten
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return delta


def find_stop(text: str, stops: list[str], start: int = 0) -> int | None:
    """Index of the first stop string in `text` that ends after `start` (None: no stop)."""
    if not stops:
        return None
    lo = max(0, start - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, lo) for s in stops) if i >= 0]
    return min(hits) if hits else None
