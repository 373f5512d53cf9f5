"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the context's last
n-gram. Needs no draft model and no extra process, so it works when `draft_model` is absent.

On its own (`drafter: ngram`) it proposes k tokens per iteration. In front of a model drafter
(`model+ngram`, `eagle+ngram`) it proposes first, up to `PromptLookup.length` tokens, and the model drafter
only runs when the context's suffix has no earlier match: a 135M model's greedy answers repeat themselves
(lists, loops, the code and JSON keys of the prompt), and a match there is accepted in long runs at no
model cost (docs/SPECULATION.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.drafting.base import Proposal

MAX_NGRAM, MIN_NGRAM = 3, 1


@dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup in front of a model drafter: up to `length` tokens after a match of a suffix of
    `min_ngram` .. `max_ngram` tokens (shorter matches are too often wrong to pay for a long proposal).

    `adaptive`: each sequence proposes the length, at most `length`, with the most expected tokens per second
    from its own lookup acceptance so far and the measured cost of verification rows (specdec.adaptive);
    otherwise always `length`. The defaults are the shipped profile's (specdec.config)."""

    length: int = 12
    min_ngram: int = 2
    max_ngram: int = MAX_NGRAM
    adaptive: bool = True

    def __post_init__(self) -> None:
        if not (self.length >= 1 and 1 <= self.min_ngram <= self.max_ngram):
            raise ValueError(f"prompt_lookup needs length >= 1 and 1 <= min_ngram <= max_ngram, got {self}")


def lookup(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest matching suffix n-gram.

    The reference definition (a scan of the whole context); `NgramIndex` answers the same in O(1)."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(tokens[length - n:])
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


class NgramIndex:
    """The latest start of every n-gram (n in [min_ngram, max_ngram]) that has a token after it, kept
    incrementally as a sequence grows, so a lookup costs the same at 8k tokens as at 8 (the scan of
    `lookup` is O(context) per iteration)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._latest: dict[tuple[int, ...], int] = {}
        self._tokens: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        """Index `tokens[len(seen):]`; `tokens` must extend what was indexed before (sequences only grow)."""
        seen = self._tokens
        for token in tokens[len(seen):]:
            seen.append(int(token))
            end = len(seen) - 1  # n-grams ending just before the new token now have a continuation
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self._latest[tuple(seen[end - n:end])] = end - n

    def propose(self, tokens: Sequence[int], k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to k tokens after the latest earlier match of the longest suffix n-gram (as `lookup`) of `tokens`
        + `after` (tokens not yet committed, e.g. a grammar's forced ones: matched, never indexed)."""
        self.extend(tokens)
        seen = [*self._tokens, *after] if after else self._tokens
        length = len(seen)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(seen[length - n:]))
            if start is not None:
                return seen[start + n:start + n + k]
        return []


class NgramDrafter:
    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        self.index = NgramIndex(max_ngram, min_ngram)

    async def propose(self, tokens: list[int], k: int, after: Sequence[int] = ()) -> Proposal | None:
        """A chain of up to k tokens after `tokens` + `after` (`after` not part of it)."""
        proposal = self.index.propose(tokens, k, after) if k > 0 else []
        if not proposal:
            return None
        return Proposal(proposal, list(range(-1, len(proposal) - 1)), len(proposal))
