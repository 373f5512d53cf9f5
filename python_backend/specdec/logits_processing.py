"""Request options that reshape the target's logits before a token is chosen: penalties, a logit bias and bad
words.

They are applied to every row a target call scores, each with the context that row continues (the sequence's
tokens and, in a verification, the draft tokens on the path to the row's node), so a speculative answer chooses
every token from the same processed distribution as plain decoding: greedy output equal, sampled output the same
law. A model drafter (draft model, EAGLE head) proposes from its distribution under the request's penalties
(`penalties`, applied to its rows the same way with the context its proposal continues), so what it drafts is
what the penalized target would choose; prompt lookup proposes the context's own continuation, and a proposal
the options forbid is rejected by the target.
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

    @property
    def penalties(self) -> LogitsOptions:
        """The penalties alone: what a model drafter applies to its own rows (the bias and bad words cost a
        drafter next to nothing when it ignores them: the target rejects the few tokens they forbid)."""
        return LogitsOptions(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)

    def apply(self, rows: np.ndarray, tokens: Sequence[int], prompt_len: int,
              paths: Sequence[Sequence[int]], columns: np.ndarray | None = None) -> np.ndarray:
        """`rows[r]` scores the token after `tokens` + `paths[r]` (`tokens[:prompt_len]` is the prompt); returns
        the processed rows (float64). The penalties count the prompt (repetition) or the output (presence,
        frequency), the path's tokens included. `columns`: the token id of each column where the rows score
        only some tokens (a drafter's proposal vocabulary; None: column i is token i)."""
        out = np.array(rows, dtype=np.float64, ndmin=2)
        ids = np.arange(out.shape[-1]) if columns is None else np.asarray(columns, dtype=np.int64)
        vocab = int(ids.max(initial=-1)) + 1
        context = np.asarray(tokens, dtype=np.int64)
        output_counts = np.bincount(context[prompt_len:], minlength=vocab)[:vocab]
        seen = np.zeros(vocab, dtype=bool)
        seen[context[context < vocab]] = True
        column_of = None  # token id -> its column (-1: none), where the rows score some tokens only
        if columns is not None:
            column_of = np.full(vocab, -1, dtype=np.int64)
            column_of[ids] = np.arange(len(ids))

        def column(token: int) -> int:
            return token if column_of is None else (int(column_of[token]) if token < vocab else -1)

        bias = [(column(t), value) for t, value in self.logit_bias]
        bias_ids = np.asarray([c for c, _ in bias if c >= 0], dtype=np.int64)
        bias_values = np.asarray([value for c, value in bias if c >= 0], dtype=np.float64)
        if columns is not None:  # counted per column from here on: a drafter's rows stay small
            output_counts, seen = output_counts[ids], seen[ids]
        for r, path in enumerate(paths):
            row = out[r]
            counts, present = output_counts, seen
            if len(path):
                path_columns = np.asarray([c for c in map(column, path) if 0 <= c < len(counts)], dtype=np.int64)
                counts = counts.copy()
                np.add.at(counts, path_columns, 1)
                present = present.copy()
                present[path_columns] = True
            if self.repetition_penalty != 1.0:
                where = np.nonzero(present)[0]
                values = row[where]
                row[where] = np.where(values > 0, values / self.repetition_penalty, values * self.repetition_penalty)
            if self.presence_penalty or self.frequency_penalty:
                row -= self.frequency_penalty * counts + self.presence_penalty * (counts > 0)
            if len(bias_ids):
                row[bias_ids] += bias_values
            for word in self.bad_words:
                last = column(word[-1])
                if 0 <= last < row.shape[-1] and _ends_with(context, path, word[:-1]):
                    row[last] = -np.inf
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
