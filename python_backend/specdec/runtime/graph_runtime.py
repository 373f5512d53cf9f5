"""The part shared by runtimes that run the exported decoder-step graph (onnxruntime, TensorRT).

The runtime keeps the paged KV cache (specdec.kv_memory) as two arrays [layers, kv_heads, pool rows,
head_dim]: numpy on the CPU for onnxruntime (so a serving process never imports torch), torch CUDA tensors
for TensorRT (which overrides the few array hooks below). A forward lays the batch out
(specdec.runtime.layout), gathers the context rows of its slots through their block tables in the cache's own
layout [layers, kv_heads, batch, past, head_dim] (one gather; each layer's part is a graph input), runs the graph
(specdec.runtime.graph_contract names its inputs and outputs) and scatters the returned new rows into the
slots. Subclasses only run the graph (`_run`) and may declare shape limits (`max_batch`,
`max_step_tokens`): larger batches are split and long causal inputs chunked to fit. Indexing is the same
in numpy and torch (advanced indices separated by a slice put their dimension first in both).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np

from specdec.checkpoint import ModelSpec
from specdec.runtime.base import DecoderRuntime, ForwardItem, ForwardOutput, make_pool
from specdec.runtime.context_buffer import ContextBuffer, buffer_width
from specdec.runtime.graph_contract import FEATURES, PAST_KEYS, PAST_VALUES
from specdec.runtime.layout import group_by_width, key_rows, plan_batch, split_for_limits

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
FILLER_SLOT = -1  # the slot of a filler item (specdec.runtime.context_buffer): it has no cache rows


class SlottedGraphRuntime(DecoderRuntime):
    """DecoderRuntime over a stateless step graph; subclasses implement `_run`.

    Arrays are numpy by default; a subclass keeping its cache elsewhere overrides `_zeros`, `_index`,
    `_mask`, `_features`, `_gather`, `_new_rows`, `_logits_to_numpy` and `kv_cache_bytes`."""

    max_batch: int | None = None  # items per graph call (None: unlimited)
    max_step_tokens: int | None = None  # new tokens per item per graph call (None: unlimited)
    keeps_context = True  # keep the last batch's gathered context (specdec.runtime.context_buffer); numpy only

    def __init__(self, spec: ModelSpec, num_slots: int, max_length: int, dtype: Any, device: Any = "cpu",
                 num_blocks: int | None = None, block_size: int | None = None,
                 proposal_ids: list[int] | None = None) -> None:
        self.spec = spec
        self.logit_ids = None if proposal_ids is None else np.asarray(proposal_ids, dtype=np.int64)
        self.vocab_size = spec.vocab_size
        self.num_slots = num_slots
        self.max_length = max_length
        self.dtype = dtype
        self.device = device
        self.kv = make_pool(num_slots, max_length, num_blocks, block_size)
        shape = (spec.num_layers, spec.num_kv_heads, self.kv.num_rows, spec.head_dim)
        self.k_cache = self._zeros(shape)
        self.v_cache = self._zeros(shape)
        self._context_buffer: ContextBuffer | None = None

    # ---- array hooks (numpy) ----
    def _zeros(self, shape: tuple[int, ...]) -> Any:
        # Written, not just calloc'ed: the pages are committed at load, so a model that loads keeps fitting
        # under load (no OOM at the first busy hour) and its memory metrics show the whole cache.
        cache = np.empty(shape, dtype=self.dtype)
        cache.fill(0)
        return cache

    def _index(self, values: Any) -> Any:
        return np.asarray(values, dtype=np.int64)

    def _mask(self, values: np.ndarray) -> Any:
        return values

    def _features(self, values: np.ndarray) -> Any:
        """fp32 [B, W, F] features of an EAGLE head's input tokens."""
        return values

    def _gather(self, cache: Any, rows: Any, batch: int) -> Any:
        """cache [L, H, R, D] at physical `rows` [B * past] -> [L, H, B, past, D] (one copy)."""
        layers, heads, _, dim = cache.shape
        return np.take(cache, rows, axis=2).reshape(layers, heads, batch, -1, dim)

    def _new_rows(self, new: Any) -> Any:
        """New KV [L, H, B, W, D] -> [L, H, B*W, D] in the cache's dtype."""
        layers, heads, batch, width, dim = new.shape
        return new.reshape(layers, heads, batch * width, dim).astype(self.dtype, copy=False)

    def _logits_to_numpy(self, logits: Any) -> np.ndarray:
        return np.asarray(logits, dtype=np.float32)

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.k_cache.nbytes + self.v_cache.nbytes)

    @abstractmethod
    def _run(self, feeds: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
        """Run the graph on `feeds` (arrays of this runtime's kind); returns (logits, new_keys, new_values,
        hidden_states)."""

    def forward_outputs(self, items: list[ForwardItem]) -> list[ForwardOutput]:
        if not items:
            return []
        groups = group_by_width(items)
        if len(groups) > 1:  # each group its own forward (logits do not depend on the batch: step_graph)
            outputs: list[ForwardOutput | None] = [None] * len(items)
            for group in groups:
                for i, output in zip(group, self.forward_outputs([items[i] for i in group]), strict=True):
                    outputs[i] = output
            return outputs  # type: ignore[return-value]
        self._grow_for(items)
        fits = (self.max_batch is None or len(items) <= self.max_batch) and (
            self.max_step_tokens is None or max(it.num_tokens for it in items) <= self.max_step_tokens
        )
        if fits:
            return self._forward_batch(items)
        logits: list[list[np.ndarray]] = [[] for _ in items]
        hidden: list[list[np.ndarray]] = [[] for _ in items]
        for pieces in split_for_limits(items, self.max_batch, self.max_step_tokens):
            outputs = self._forward_batch([piece.item for piece in pieces])
            for piece, output in zip(pieces, outputs, strict=True):
                if piece.keep:
                    logits[piece.item_index].append(output.logits[len(output.logits) - piece.keep :])
                if piece.keep_hidden and output.hidden is not None:
                    hidden[piece.item_index].append(output.hidden)
        return [ForwardOutput(np.concatenate(item_logits), np.concatenate(item_hidden) if item_hidden else None)
                for item_logits, item_hidden in zip(logits, hidden, strict=True)]

    def _forward_batch(self, items: list[ForwardItem]) -> list[ForwardOutput]:
        order, rows, keys, values, fillers = self._past_context(items, key_rows(items))
        laid_out = [items[i] if i < len(items) else fillers[i - len(items)] for i in order]
        plan = plan_batch(laid_out, self.max_length, self.spec.sliding_window, self.spec.eagle_feature_size)
        feeds = {
            "input_ids": self._index(plan.ids),
            "position_ids": self._index(plan.positions),
            "attention_mask": self._mask(plan.cache_mask(rows)),
            "logit_rows": self._index(plan.logit_rows),
            "new_rows": self._index(plan.new_rows()),
        }
        for prefix, context in ((PAST_KEYS, keys), (PAST_VALUES, values)):
            for layer, rows_of_layer in enumerate(context):
                feeds[f"{prefix}_{layer}"] = rows_of_layer
        if plan.features is not None:
            feeds[FEATURES] = self._features(plan.features)
        logits, new_keys, new_values, hidden = self._run(feeds)
        # new rows [L, H, B, W, D] -> [L, H, B*W, D], the valid ones into their physical rows (not the fillers').
        real = plan.write_slot != FILLER_SLOT
        write_slot, write_row = plan.write_slot[real], plan.write_row[real]
        src, dst = self._index(plan.write_src[real]), self._index(self._write_rows(write_slot, write_row))
        written = []
        for cache, new in ((self.k_cache, new_keys), (self.v_cache, new_values)):
            rows = self._new_rows(new)[:, :, src]
            cache[:, :, dst] = rows
            written.append(rows)
        if self._context_buffer is not None:
            self._context_buffer.write(write_slot, write_row, *written)
        hidden_all = self._logits_to_numpy(hidden) if len(plan.hidden_rows) else None
        outputs = plan.outputs(self._logits_to_numpy(logits), hidden_all)
        back = np.empty(len(order), dtype=np.int64)
        back[order] = np.arange(len(order))
        return [outputs[back[i]] for i in range(len(items))]

    def _gather_context(self, slots: list[int], rows: int) -> tuple[Any, Any]:
        """Rows 0..rows-1 of each slot, keys and values [L, H, len(slots), rows, D] (one copy each)."""
        physical = self._index(self.kv.gather_rows(slots, rows).reshape(-1))
        return self._gather(self.k_cache, physical, len(slots)), self._gather(self.v_cache, physical, len(slots))

    def _filler(self, row: int) -> ForwardItem:
        """A one-token item that keeps a buffer column in the batch: its key rows start at `row` (dead rows of
        its column), its outputs are dropped, nothing of it reaches the cache."""
        features = np.zeros((1, self.feature_size), dtype=np.float32) if self.feature_size else None
        return ForwardItem(FILLER_SLOT, row, np.zeros(1, dtype=np.int64), features=features)

    def _past_context(self, items: list[ForwardItem], rows: int
                      ) -> tuple[np.ndarray, int, Any, Any, list[ForwardItem]]:
        """(the order to lay the items out in, indices past `items` naming fillers; the key rows the graph
        reads; keys; values; the fillers): from the kept context buffer where it can serve the batch
        (specdec.runtime.context_buffer), else gathered now."""
        slots = [item.slot for item in items]
        buffer = self._context_buffer
        if self.keeps_context and len(items) >= 2:  # a lone sequence gathers little
            pad = max(item.num_tokens for item in items)
            # Fillers cost a row of compute each, a gathered column a copy of its context: up to half the batch;
            # none where a filler's rows would pass the positions the graph serves.
            max_fillers = len(items) // 2 if buffer is not None and buffer.width <= self.max_length else 0
            columns = (buffer.place(slots, rows, pad, self.kv.rows_held, max_fillers) if buffer is not None
                       else None)
            # A batch the buffer cannot place gathers a new one, unless it is part of the buffer's wave (a subset)
            # or a few sequences beside it (fewer than half its live columns: newcomers' first steps, stragglers),
            # which gather their own context and leave the wave's buffer in place.
            if columns is None and not (buffer is not None and (buffer.is_subset(slots)
                                                                or 2 * len(slots) < buffer.live_columns)):
                self._context_buffer = buffer = None  # freed before the new one is gathered
                self._context_buffer = buffer = ContextBuffer(list(slots), *self._gather_context(
                    slots, buffer_width(rows)))
                columns = list(range(len(slots)))
            if columns is not None:
                for column in sorted(buffer.stale):
                    slot = buffer.columns[column]
                    keys, values = self._gather_context([slot], buffer.width)
                    buffer.keys[:, :, column], buffer.values[:, :, column] = keys[:, :, 0], values[:, :, 0]
                buffer.stale.clear()
                filler_columns = buffer.fillers(columns)
                fillers = [self._filler(buffer.width - pad) for _ in filler_columns]
                order = np.argsort(columns + filler_columns)
                return order, buffer.width, buffer.keys, buffer.values, fillers
        keys, values = self._gather_context(slots, rows)
        return np.arange(len(items)), rows, keys, values, []

    def release(self, slot: int) -> None:
        super().release(slot)
        if self._context_buffer is not None:
            self._context_buffer.forget(slot)
            if not any(column is not None for column in self._context_buffer.columns):
                self._context_buffer = None  # its sequences have all ended: its memory goes back now

    def move_rows(self, slot: int, src_rows: np.ndarray, dst_start: int) -> None:
        src_rows = np.asarray(src_rows, dtype=np.int64)
        dst_rows = np.arange(dst_start, dst_start + len(src_rows))
        if np.array_equal(src_rows, dst_rows):
            return
        src = self._index(self.kv.physical_rows(slot, src_rows))
        dst = self._index(self.kv.physical_rows(slot, dst_rows))
        for cache in (self.k_cache, self.v_cache):
            cache[:, :, dst] = cache[:, :, src]
        if self._context_buffer is not None:
            self._context_buffer.invalidate(slot)
