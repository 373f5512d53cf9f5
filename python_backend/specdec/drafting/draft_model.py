"""Drafting with the draft model (a BLS call to `draft_model` per iteration, all k tokens in one call)."""

from __future__ import annotations

import numpy as np

from specdec.drafting.base import Proposal
from specdec.engines import StepRequest, tree_draft_parents
from specdec.sampling import SamplingParams, probabilities


def slot_lost(message: str) -> bool:
    """Errors meaning the sequence's draft state is gone: our slot table's, or Triton's sequence batcher's."""
    return "has no KV slot" in message or "START flag" in message


class DraftModelDrafter:
    """Per-sequence state of the draft model's KV slot: `valid` leading tokens have valid rows (a ModelDrafter)."""

    name = "model"
    reads_target_features = False
    drafts_trees = False  # a tree of chains (`candidates`), not a dynamic tree

    def __init__(self, backend, sequence_id: int) -> None:
        self.backend = backend
        self.sequence_id = sequence_id
        self.valid = 0
        self.started = False
        self._base = 0
        self._chain_depth = 0

    async def propose(self, tokens: list[int], k: int, candidates: int, sampling: SamplingParams,
                      want_probs: bool, min_confidence: float = 0.0, tree_nodes: int = 0) -> Proposal:
        if tree_nodes or min_confidence:  # both describe a dynamic tree (the EAGLE head's)
            raise ValueError("the draft model drafts chains, not dynamic trees")
        start = not self.started
        self.started = True  # END at release even if this call fails: a failed START can still hold a KV slot
        result = await self._draft(tokens, start, k, candidates, sampling, want_probs)
        if result.error is not None and not start and slot_lost(str(result.error)):
            # The draft slot expired while this sequence decoded plainly (fallback longer than the idle
            # timeout): start it again with the whole context instead of giving up on speculation.
            self.valid = 0
            result = await self._draft(tokens, True, k, candidates, sampling, want_probs)
        if result.error is not None:
            raise RuntimeError(f"draft_model: {result.error}")
        depth = len(result.token_ids) // candidates
        self._base = len(tokens)
        self._chain_depth = depth if candidates == 1 else 0
        probs = probabilities(result.logits, sampling) if want_probs and result.logits is not None else None
        return Proposal([int(t) for t in result.token_ids], tree_draft_parents(candidates, depth), depth, probs)

    async def _draft(self, tokens: list[int], start: bool, k: int, candidates: int, sampling: SamplingParams,
                     want_probs: bool):
        return await self.backend.drafter_step(self.name, StepRequest(
            self.sequence_id, past_length=self.valid, input_ids=np.asarray(tokens[self.valid:]),
            start=start, num_draft_tokens=k, num_candidates=candidates, sampling=sampling,
            want_logits=want_probs,
        ))

    async def prefill(self, tokens: list[int]) -> None:
        """Write the rows of `tokens` past the valid ones without proposing (a chunk of a long prompt)."""
        start = not self.started
        self.started = True
        result = await self.backend.drafter_step(self.name, StepRequest(
            self.sequence_id, past_length=self.valid, input_ids=np.asarray(tokens[self.valid:]), start=start))
        if result.error is not None:
            raise RuntimeError(f"draft_model: {result.error}")
        self.valid = len(tokens)

    def add_features(self, first_position: int, rows: np.ndarray) -> None:
        """The draft model reads no target features."""

    def verified(self, accepted: int) -> None:
        """After verification: a chain's rows up to the first rejected token stay valid (its last token
        was never fed); a tree's rows are scratch and the accepted tokens come back as catch-up input."""
        self.valid = self._base + min(accepted, self._chain_depth - 1) if self._chain_depth else self._base

    def reset(self) -> None:
        """Forget the cache (after fallback or a failure: the next proposal re-sends the context)."""
        self.valid = 0

    async def release(self) -> None:
        if self.started:
            await self.backend.drafter_step(self.name, StepRequest(self.sequence_id, end=True))
            self.started = False
