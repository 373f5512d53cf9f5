"""Streaming detokenization that never emits a broken UTF-8 character.

The speculative loop decides where a streamed chunk may end (`IncrementalDetokenizer`, holding back tokens
while their text ends in an incomplete character); postprocessing turns a chunk into text with a few
tokens of left context (`decode_chunk`), which keeps tokenizers whose decoding depends on the previous
token (leading-space rules) correct.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
Decode = Callable[[Sequence[int]], str]


def decode_chunk(decode: Decode, prefix_ids: Sequence[int], chunk_ids: Sequence[int]) -> str:
    """Text that `chunk_ids` adds after `prefix_ids`."""
    if not prefix_ids:
        return decode(chunk_ids)
    prefix_text = decode(prefix_ids)
    return decode(list(prefix_ids) + list(chunk_ids))[len(prefix_text):]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """Add tokens; returns (prefix_ids, chunk_ids) when a complete piece of text is ready, else None."""
        self._ids.extend(int(t) for t in new_ids)
        if self._read_offset == len(self._ids):
            return None
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR):
            return self._take()
        return None

    def flush(self) -> tuple[list[int], list[int]] | None:
        """Whatever is held back (the stream ended inside a character)."""
        return self._take() if self._read_offset < len(self._ids) else None

    def _take(self) -> tuple[list[int], list[int]]:
        prefix = self._ids[self._prefix_offset : self._read_offset]
        chunk = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return prefix, chunk
