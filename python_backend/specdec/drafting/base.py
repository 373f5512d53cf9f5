"""What a drafter returns, and what the generation loop asks of a drafter that runs a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

if TYPE_CHECKING:
    from specdec.sampling import SamplingParams


@dataclass
class Proposal:
    """Draft nodes listed parents-first; `parents[i]` = -1 for a child of the last committed token.

    `depth` is the longest root-to-leaf path (the most tokens one verification can accept).
    `draft_probs[i]` is the distribution node i was drawn from (None: deterministic proposal).
    """

    tokens: list[int]
    parents: list[int]
    depth: int
    draft_probs: np.ndarray | None = None

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def paths(self) -> list[list[int]]:
        """The draft tokens each row of its verification continues: [] for the first row (after the last
        committed token), then for node i the tokens from the root to i, inclusive."""
        paths: list[list[int]] = [[]]
        for token, parent in zip(self.tokens, self.parents, strict=True):
            paths.append(paths[parent + 1] + [token])
        return paths


def proposal_of_tree(tokens: Sequence[int] | np.ndarray, parents: Sequence[int] | np.ndarray) -> Proposal:
    """A deterministic proposal of tree nodes listed parents-first (depth: its longest path)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[int(parent)] + 1)
    return Proposal([int(t) for t in tokens], [int(p) for p in parents], max(depths, default=0))


def pruned(proposal: Proposal, keep: Sequence[bool]) -> Proposal | None:
    """`proposal` with only the nodes where `keep` holds and whose ancestors are kept (None: no node left).
    For a deterministic proposal only: its draft distributions are not carried over."""
    index: dict[int, int] = {-1: -1}
    tokens, parents = [], []
    for node, (token, parent) in enumerate(zip(proposal.tokens, proposal.parents, strict=True)):
        if keep[node] and parent in index:
            index[node] = len(tokens)
            tokens.append(token)
            parents.append(index[parent])
    if not tokens:
        return None
    if len(tokens) == len(proposal.tokens):
        return proposal
    return proposal_of_tree(tokens, parents)


def extended(chain: Proposal, tokens: Sequence[int]) -> Proposal:
    """A chain with deterministic `tokens` after its last node (their draft distributions one-hot)."""
    if not tokens:
        return chain
    probs = chain.draft_probs
    if probs is not None:
        one_hot = np.zeros((len(tokens), probs.shape[-1]), dtype=probs.dtype)
        one_hot[np.arange(len(tokens)), list(tokens)] = 1.0
        probs = np.concatenate([probs, one_hot])
    count = len(chain.tokens) + len(tokens)
    return Proposal([*chain.tokens, *map(int, tokens)], list(range(-1, count - 1)), count, probs)


class ModelDrafter(Protocol):
    """A drafter that runs a model on the server and keeps one KV slot per sequence (the draft model, the EAGLE
    head). The generation loop drives every one the same way; what differs is said by these class attributes.

    `name`: its key in specdec.drafting.spec.DRAFTER_MODELS (the Triton model it calls).
    `reads_target_features`: it needs the target's features of every committed token (`add_features`), so the
    target returns them, and a long prompt's chunk is written here only after the target's rows of it.
    `drafts_trees`: it can draft a profile's dynamic tree (`tree_nodes`)."""

    name: ClassVar[str]
    reads_target_features: ClassVar[bool]
    drafts_trees: ClassVar[bool]
    started: bool

    async def propose(self, tokens: list[int], k: int, candidates: int, sampling: SamplingParams,
                      want_probs: bool, min_confidence: float = 0.0, tree_nodes: int = 0) -> Proposal:
        """k tokens (or `candidates` chains of k, or a dynamic tree of `tree_nodes`) after `tokens`."""
        ...

    async def prefill(self, tokens: list[int]) -> None:
        """Write the rows of `tokens` without proposing (a chunk of a long prompt)."""
        ...

    def add_features(self, first_position: int, rows: np.ndarray) -> None:
        """The target's features of positions `first_position ..` (where `reads_target_features`)."""
        ...

    def verified(self, accepted: int) -> None:
        """After verification: `accepted` of the last proposal's tokens were kept."""
        ...

    async def release(self) -> None:
        """End the sequence's slot."""
        ...
