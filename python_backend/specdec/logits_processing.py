"""Request options that reshape the target's logits before a token is chosen: penalties, a logit bias and bad
words.

They are applied to every row a target call scores, each with the context that row continues (the sequence's
tokens and, in a verification, the draft tokens on the path to the row's node), so a speculative answer chooses
every token from the same processed distribution as plain decoding: greedy output equal, sampled output the same
law. The drafters propose from their own distributions; a proposal the options forbid is rejected by the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogitsOptions:
    """What a request asks of the target's logits; the defaults change nothing."""

    # Hugging Face's and TensorRT-LLM's: the logit of every token in the prompt or the output so far is divided by
    # this where positive and multiplied where negative (> 1 discourages repeats).
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted once from the logit of every token the output contains so far.
    presence_penalty: float = 0.0
    # OpenAI's: subtracted from a token's logit once per time the output contains it so far.
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, value added to its logit); -100 in practice forbids, 100 forces.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # TensorRT-LLM's bad_words: token sequences never completed (the last token of each is masked wherever the
    # context ends with the ones before it; a one-token sequence is never produced).
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def active(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias) or bool(self.bad_words))

    def apply(self, rows: np.ndarray, tokens: Sequence[int], prompt_len: int,
              paths: Sequence[Sequence[int]]) -> np.ndarray:
        """`rows[r]` scores the token after `tokens` + `paths[r]` (`tokens[:prompt_len]` is the prompt); returns
        the processed rows (float64). The penalties count the prompt (repetition) or the output (presence,
        frequency), the path's tokens included."""
        out = np.array(rows, dtype=np.float64, ndmin=2)
        vocab = out.shape[-1]
        context = np.asarray(tokens, dtype=np.int64)
        output_counts = np.bincount(context[prompt_len:], minlength=vocab)[:vocab]
        seen = np.zeros(vocab, dtype=bool)
        seen[context[context < vocab]] = True
        bias_ids = np.asarray([token for token, _ in self.logit_bias], dtype=np.int64)
        bias_values = np.asarray([value for _, value in self.logit_bias], dtype=np.float64)
        for r, path in enumerate(paths):
            row = out[r]
            counts, present = output_counts, seen
            if len(path):
                path_ids = np.asarray(path, dtype=np.int64)
                counts = counts.copy()
                np.add.at(counts, path_ids, 1)
                present = seen.copy()
                present[path_ids] = True
            if self.repetition_penalty != 1.0:
                ids = np.nonzero(present)[0]
                values = row[ids]
                row[ids] = np.where(values > 0, values / self.repetition_penalty, values * self.repetition_penalty)
            if self.presence_penalty or self.frequency_penalty:
                row -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
            if len(bias_ids):
                row[bias_ids] += bias_values
            for word in self.bad_words:
                if _ends_with(context, path, word[:-1]):
                    row[word[-1]] = -np.inf
        return out


def _ends_with(context: np.ndarray, path: Sequence[int], suffix: Sequence[int]) -> bool:
    """Whether `context` + `path` ends with `suffix` (without building the concatenation)."""
    if not suffix:
        return True
    tail = list(path[-len(suffix):])
    missing = len(suffix) - len(tail)
    if missing > len(context):
        return False
    if missing:
        tail = context[len(context) - missing:].tolist() + tail
    return tail == list(suffix)
