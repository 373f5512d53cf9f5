"""Acceptance rules: which drafted tokens the target keeps, and the token it adds after them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def greedy_accept(draft_tokens: Sequence[int], target_argmax: Sequence[int] | np.ndarray) -> tuple[int, int]:
    """Exact-match acceptance (lossless for greedy decoding).

    `target_argmax[i]` is the target's greedy token after the prefix and the first i draft tokens, so it
    has len(draft_tokens) + 1 entries. Returns (number of accepted draft tokens, bonus token): the bonus is
    the target's token at the first mismatch, or after the last draft token when all match.
    """
    accepted = 0
    for drafted, expected in zip(draft_tokens, target_argmax, strict=False):
        if int(drafted) != int(expected):
            break
        accepted += 1
    return accepted, int(target_argmax[accepted])
