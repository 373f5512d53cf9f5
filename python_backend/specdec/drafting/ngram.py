"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the context's last
n-gram. Needs no draft model and no extra process, so it works when `draft_model` is absent."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.drafting.base import Proposal

MAX_NGRAM, MIN_NGRAM = 3, 1


def lookup(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest matching suffix n-gram."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(tokens[length - n:])
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


class NgramDrafter:
    async def propose(self, tokens: list[int], k: int) -> Proposal | None:
        proposal = lookup(tokens, k)
        if not proposal:
            return None
        return Proposal(proposal, list(range(-1, len(proposal) - 1)), len(proposal))
