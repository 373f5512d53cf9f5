"""The runtime interface: one batched decoder forward over a paged KV cache.

A runtime owns the KV cache of `num_slots` sequences, each up to `max_length` tokens, as a pool of blocks
(specdec.kv_memory.BlockPool): a slot holds only the blocks of the rows it uses. It knows nothing of
sequences or requests: the engine (specdec.engines) maps sequences to slots and lengths and resizes their
blocks. Torch, ONNX Runtime and TensorRT runtimes implement this same interface so one model.py serves all
three.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from specdec.checkpoint import ModelSpec
from specdec.kv_memory import DEFAULT_BLOCK_SIZE, BlockPool, blocks_for


@dataclass
class ForwardItem:
    """One sequence's part of a batched forward.

    Rows `0 .. past_length-1` are the prefix every new token sees. Without `tree_parents` the new tokens
    form a chain after it (causal), written to rows `past_length ..`. With `tree_parents` they are nodes of
    a tree hanging from the prefix: `tree_parents` lists the parent of every tree node (-1: child of the
    prefix; parents before children); the first `num_cached_nodes` nodes were written by earlier calls at
    rows `past_length ..`, the new tokens are the remaining nodes, written after them. Each node attends to
    the prefix and its ancestors, at position `past_length + depth`.

    `num_hidden`: also return the final-normed hidden states (what the output layer reads) of the last
    `num_hidden` input positions: the features an EAGLE head drafts from. `features` [num_tokens,
    feature_size]: the feature of every input token, for a runtime over an EAGLE head (ModelSpec.eagle).
    """

    slot: int
    past_length: int
    input_ids: np.ndarray
    num_logits: int = 1
    tree_parents: np.ndarray | None = None
    num_cached_nodes: int = 0
    num_hidden: int = 0
    features: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def first_row(self) -> int:
        """Cache row of the first new token."""
        return self.past_length + self.num_cached_nodes

    @property
    def end_row(self) -> int:
        return self.first_row + self.num_tokens


@dataclass
class ForwardOutput:
    """One item's results: fp32 logits [num_logits, columns] (columns: the whole vocabulary, or a drafter's proposal
    vocabulary, `DecoderRuntime.logit_ids`); fp32 hidden states [num_hidden, hidden] (None when
    `num_hidden` is 0)."""

    logits: np.ndarray
    hidden: np.ndarray | None = None


def make_pool(num_slots: int, max_length: int, num_blocks: int | None, block_size: int | None) -> BlockPool:
    """The block pool of a runtime; `num_blocks` None: room for every slot at full length (the old static
    cache's capacity, what tools and tests that drive a runtime directly expect)."""
    block_size = block_size or DEFAULT_BLOCK_SIZE
    return BlockPool(num_blocks or num_slots * blocks_for(max_length, block_size), block_size, num_slots)


def expand_to_vocab(logits: np.ndarray, logit_ids: np.ndarray | None, vocab_size: int) -> np.ndarray:
    """Logits over `logit_ids` columns -> [..., vocab_size] with -inf for every other token (unchanged when
    `logit_ids` is None: the columns are already the vocabulary)."""
    if logit_ids is None:
        return logits
    full = np.full((*logits.shape[:-1], vocab_size), -np.inf, dtype=np.float32)
    full[..., logit_ids] = logits
    return full


class DecoderRuntime(ABC):
    """A decoder with a paged KV cache: `kv` holds the block tables, the subclass the arrays.

    `logit_ids`: the token id of every logits column where the checkpoint has a proposal vocabulary
    (specdec.checkpoint.read_proposal_vocab; a drafter's output layer keeps only those rows), None where the
    columns are the whole vocabulary. A drafter's logits stay over those columns through the engine (an argmax
    or top-k over 4,096 columns instead of 49,152, and no graph op spreading them over the vocabulary, which
    cost the EAGLE head a third of its graph time); `forward` expands them for callers that want the vocabulary.
    """

    spec: ModelSpec
    vocab_size: int
    logit_ids: np.ndarray | None = None
    num_slots: int
    max_length: int
    kv: BlockPool

    @property
    @abstractmethod
    def kv_cache_bytes(self) -> int:
        """Bytes of the whole pool (allocated at load)."""

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_cache_bytes // self.kv.num_blocks

    @property
    def kv_bytes_in_use(self) -> int:
        return self.kv.blocks_in_use * self.kv_bytes_per_block

    def resize_rows(self, slot: int, rows: int) -> None:
        """Hold exactly the blocks of `rows` rows in `slot` (rows past them are dead: rollback by length);
        raises CapacityError when the pool cannot grow."""
        self.kv.resize(slot, rows)

    def release(self, slot: int) -> None:
        self.kv.release(slot)

    def _grow_for(self, items: list[ForwardItem]) -> None:
        """Give every item's slot the rows the forward writes (never shrinks)."""
        for item in items:
            if self.kv.rows_held(item.slot) < item.end_row:
                self.kv.resize(item.slot, item.end_row)

    def _write_rows(self, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Physical rows of (slot, logical row) pairs."""
        out = np.empty(len(rows), dtype=np.int64)
        for slot in np.unique(slots):
            where = slots == slot
            out[where] = self.kv.physical_rows(int(slot), rows[where])
        return out

    def forward(self, items: list[ForwardItem]) -> list[np.ndarray]:
        """Run one padded forward for all items; returns, per item, fp32 logits [num_logits, vocab]
        for its last `num_logits` input positions (-inf outside a proposal vocabulary)."""
        return [expand_to_vocab(output.logits, self.logit_ids, self.vocab_size)
                for output in self.forward_outputs(items)]

    @abstractmethod
    def forward_outputs(self, items: list[ForwardItem]) -> list[ForwardOutput]:
        """`forward` with the hidden states each item asked for (`num_hidden`)."""

    @property
    def feature_size(self) -> int:
        """Width of the `features` an EAGLE head reads per input token (0: a plain decoder)."""
        return self.spec.eagle_feature_size

    @abstractmethod
    def move_rows(self, slot: int, src_rows: np.ndarray, dst_start: int) -> None:
        """Copy cache rows `src_rows` of `slot` to `dst_start, dst_start+1, ...` (ascending, src >= dst):
        keeps an accepted tree path contiguous after verification."""


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node of a tree given in topological order (-1 = child of the prefix)."""
    depths = np.zeros(len(parents), dtype=np.int64)
    for i, parent in enumerate(parents):
        if parent >= i:
            raise ValueError("tree_parents must list parents before children")
        depths[i] = 0 if parent < 0 else depths[parent] + 1
    return depths


def tree_ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[n, n] bool: entry (i, j) is true when node j is node i or one of its ancestors."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask
