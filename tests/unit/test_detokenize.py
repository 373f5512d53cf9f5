"""Streamed chunks never split a UTF-8 character and always add up to the whole text."""

from __future__ import annotations

import random

from specdec.detokenize import IncrementalDetokenizer, decode_chunk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TEXT = "naïve café — 日本語のテキスト 🙂🚀 done. Ünïcödé ≠ ascii; emoji 👩‍💻 end"


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokens only (256 symbols), so multi-byte characters always span several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def test_chunks_end_on_character_boundaries_for_any_split():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(TEXT).ids
    decode = tokenizer.decode
    rng = random.Random(0)
    for _ in range(50):
        detok = IncrementalDetokenizer(decode)
        pieces, i = [], 0
        while i < len(ids):
            step = rng.randint(1, 5)
            out = detok.push(ids[i : i + step])
            i += step
            if out is not None:
                pieces.append(decode_chunk(decode, *out))
        tail = detok.flush()
        if tail is not None:
            pieces.append(decode_chunk(decode, *tail))
        assert "".join(pieces) == TEXT
        assert all("\ufffd" not in piece for piece in pieces)


def test_incomplete_character_is_held_then_flushed():
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("a🙂").ids  # 'a' + 4 bytes
    detok = IncrementalDetokenizer(tokenizer.decode)
    assert decode_chunk(tokenizer.decode, *detok.push(ids[:1])) == "a"
    assert detok.push(ids[1:3]) is None  # 2 of 4 bytes: held back
    assert detok.push(ids[3:4]) is None  # 3 of 4 bytes: still held
    assert detok.flush() is not None  # a stream that ends mid-character still returns its tokens
