"""The Hugging Face fast tokenizer of a checkpoint folder, through the light `tokenizers` library."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from specdec.checkpoint import read_end_ids


class TextTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.end_ids: frozenset[int] = read_end_ids(model_dir)
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """`special_tokens`: with those the model was trained with around a text (a prompt), or none (a word)."""
        return self._tokenizer.encode(text, add_special_tokens=special_tokens).ids

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what a grammar engine builds its token trie from)."""
        return self._tokenizer.to_str()

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)
