"""Drafting with an EAGLE head: one decoder layer that reads the target's own features (a BLS call to
`eagle_draft` per iteration, all k tokens or the whole tree in one call).

Row j of the head's KV slot holds (feature f_j, token x_{j+1}): f_j is the target's final-normed hidden state
at position j (what its output layer reads, returned by the target's verification), and the row's output
predicts x_{j+2}. So with n committed tokens, rows 0 .. n-2 hold true features and the output of row n-2
proposes the first draft token; the head then feeds its own output feature and the drafted token back for
the next ones. Those rows are scratch: the target's features of the accepted tokens replace them on the next
call (rollback by length, as for the draft model: `valid` = n - 1 after every proposal).

The features a proposal needs come from the generation loop (`add_features`) after every target call: the
prompt's rows at prefill, then the rows of the pending token and the accepted path of each verification. Only
the rows not yet written into the head are kept.
"""

from __future__ import annotations

import numpy as np

from specdec.drafting.base import Proposal, proposal_of_tree
from specdec.drafting.draft_model import slot_lost
from specdec.engines import StepRequest, tree_draft_parents
from specdec.sampling import SamplingParams, probabilities


class EagleDrafter:
    """Per-sequence state of the EAGLE head's slot and of the target features it has not been sent yet (a
    ModelDrafter)."""

    name = "eagle"
    reads_target_features = True
    drafts_trees = True

    def __init__(self, backend, sequence_id: int) -> None:
        self.backend = backend
        self.sequence_id = sequence_id
        self.valid = 0  # head rows 0 .. valid-1 hold true features
        self.started = False
        self._features: list[np.ndarray] = []  # rows for positions valid, valid + 1, ...
        self._known = 0  # features are known for positions 0 .. _known-1

    @property
    def features_known(self) -> int:
        return self._known

    def add_features(self, first_position: int, rows: np.ndarray) -> None:
        """The target's features of positions `first_position ..` (rows [n, feature_size])."""
        if first_position != self._known:
            raise RuntimeError(f"features of position {first_position} arrive after {self._known} known ones")
        self._features.extend(np.asarray(rows, dtype=np.float32))
        self._known += len(rows)

    def _input(self, tokens: list[int], upto: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and features of rows valid .. upto-1: row j pairs f_j with x_{j+1}."""
        count = upto - self.valid
        if count < 1 or upto > self._known or upto > len(tokens) - 1:
            raise RuntimeError(f"the EAGLE head needs features of positions {self.valid} .. {upto - 1}; "
                               f"{self._known} known, {len(tokens)} tokens")
        return np.asarray(tokens[self.valid + 1:upto + 1]), np.stack(self._features[:count])

    def _written(self, upto: int) -> None:
        del self._features[:upto - self.valid]
        self.valid = upto

    async def propose(self, tokens: list[int], k: int, candidates: int, sampling: SamplingParams,
                      want_probs: bool, min_confidence: float = 0.0, tree_nodes: int = 0) -> Proposal:
        start = not self.started
        self.started = True  # END at release even if this call fails: a failed START can still hold a KV slot
        upto = len(tokens) - 1
        input_ids, features = self._input(tokens, upto)
        result = await self.backend.drafter_step(self.name, StepRequest(
            self.sequence_id, past_length=self.valid, input_ids=input_ids, start=start, num_draft_tokens=k,
            num_candidates=candidates, sampling=sampling, want_logits=want_probs, features=features,
            min_confidence=min_confidence, tree_nodes=tree_nodes,
        ))
        if result.error is not None:
            if slot_lost(str(result.error)):  # the features of the lost rows are gone with it
                raise RuntimeError(f"eagle_draft: the head's KV slot expired ({result.error})")
            raise RuntimeError(f"eagle_draft: {result.error}")
        self._written(upto)
        probs = probabilities(result.logits, sampling) if want_probs and result.logits is not None else None
        if result.parents is not None:  # a dynamic tree
            return proposal_of_tree(result.token_ids, result.parents)
        depth = len(result.token_ids) // candidates
        return Proposal([int(t) for t in result.token_ids], tree_draft_parents(candidates, depth), depth, probs)

    async def prefill(self, tokens: list[int]) -> None:
        """Write the rows that the known features and `tokens` allow, without proposing (long prompts)."""
        upto = min(self._known, len(tokens) - 1)
        if upto <= self.valid:
            return
        start = not self.started
        self.started = True
        input_ids, features = self._input(tokens, upto)
        result = await self.backend.drafter_step(self.name, StepRequest(
            self.sequence_id, past_length=self.valid, input_ids=input_ids, start=start, features=features))
        if result.error is not None:
            raise RuntimeError(f"eagle_draft: {result.error}")
        self._written(upto)

    def verified(self, accepted: int) -> None:
        """Nothing to roll back: the proposal's rows past `valid` are rewritten with the target's features."""

    async def release(self) -> None:
        if self.started:
            await self.backend.drafter_step(self.name, StepRequest(self.sequence_id, end=True))
            self.started = False
