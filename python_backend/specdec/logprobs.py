"""Log-probabilities of the tokens an answer emits, read from the rows the target scored them with.

A token's log-probability is the log-softmax of its row after the request's logits options and grammar (the
distribution it was chosen from, before temperature, top-k and top-p: vLLM's "processed" log-probabilities).
Speculation scores every emitted token with the same row plain decoding would (specdec.logits_processing), so
the figures are equal between plain and speculative decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most probable tokens of its row: (token id, log-probability)


def token_logprobs(rows: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """`rows[i]` scored `tokens[i]`; each token's log-probability and its row's `top` most probable tokens (in
    order of probability, then id; tokens a row forbids (-inf) are left out)."""
    rows = np.asarray(rows, dtype=np.float64).reshape(len(tokens), -1)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    out = []
    for row, token in zip(logp, tokens, strict=True):
        best: tuple[tuple[int, float], ...] = ()
        if top:
            ids = np.argpartition(-row, top - 1)[:top] if top < len(row) else np.arange(len(row))
            ids = ids[np.lexsort((ids, -row[ids]))]
            best = tuple((int(i), float(row[i])) for i in ids if np.isfinite(row[i]))
        out.append(TokenLogprob(float(row[token]), best))
    return out
