"""The part shared by runtimes that run the exported decoder-step graph (onnxruntime, TensorRT).

The runtime keeps the slotted KV cache as two torch tensors [layers, slots, kv_heads, max_length, head_dim]
(CPU for onnxruntime, CUDA for TensorRT). A forward lays the batch out (specdec.runtime.layout), gathers
the context rows of its slots as `past_keys` / `past_values`, runs the graph (specdec.runtime.step_graph
names its inputs and outputs) and scatters the returned new rows into the slots. Subclasses only run
the graph (`_run`) and may declare shape limits (`max_batch`, `max_step_tokens`): larger batches are
split and long causal inputs chunked to fit.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from specdec.checkpoint import LlamaSpec
from specdec.runtime.base import DecoderRuntime, ForwardItem
from specdec.runtime.layout import plan_batch, split_for_limits


class SlottedGraphRuntime(DecoderRuntime):
    """DecoderRuntime over a stateless step graph; subclasses implement `_run`."""

    max_batch: int | None = None  # items per graph call (None: unlimited)
    max_step_tokens: int | None = None  # new tokens per item per graph call (None: unlimited)

    def __init__(self, spec: LlamaSpec, num_slots: int, max_length: int, dtype: torch.dtype,
                 device: str | torch.device) -> None:
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.num_slots = num_slots
        self.max_length = max_length
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (spec.num_layers, num_slots, spec.num_kv_heads, max_length, spec.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @abstractmethod
    def _run(self, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the graph on `feeds` (tensors on self.device); returns (logits, new_keys, new_values)."""

    def forward(self, items: list[ForwardItem]) -> list[np.ndarray]:
        if not items:
            return []
        fits = (self.max_batch is None or len(items) <= self.max_batch) and (
            self.max_step_tokens is None or max(it.num_tokens for it in items) <= self.max_step_tokens
        )
        if fits:
            return self._forward_batch(items)
        parts: list[list[np.ndarray]] = [[] for _ in items]
        for pieces in split_for_limits(items, self.max_batch, self.max_step_tokens):
            outputs = self._forward_batch([piece.item for piece in pieces])
            for piece, logits in zip(pieces, outputs, strict=True):
                if piece.keep:
                    parts[piece.item_index].append(logits[len(logits) - piece.keep :])
        return [np.concatenate(chunks) for chunks in parts]

    @torch.inference_mode()
    def _forward_batch(self, items: list[ForwardItem]) -> list[np.ndarray]:
        plan = plan_batch(items, self.max_length)
        past = max(1, int(plan.first_row.max()))
        as_long = lambda a: torch.as_tensor(a, dtype=torch.long).to(self.device)  # noqa: E731
        slots = as_long([item.slot for item in items])
        feeds = {
            "input_ids": as_long(plan.ids),
            "position_ids": as_long(plan.positions),
            "attention_mask": torch.as_tensor(plan.concat_mask(past)).to(self.device),
            "past_keys": self.k_cache[:, slots, :, :past].contiguous(),  # gathered: a copy
            "past_values": self.v_cache[:, slots, :, :past].contiguous(),
            "logit_rows": as_long(plan.logit_rows),
        }
        logits, new_keys, new_values = self._run(feeds)
        # new rows [L, B, H, W, D] -> [B*W, L, H, D], then into (slot, row) of the cache.
        src, slot, row = as_long(plan.write_src), as_long(plan.write_slot), as_long(plan.write_row)
        for cache, new in ((self.k_cache, new_keys), (self.v_cache, new_values)):
            layers, batch, heads, width, dim = new.shape
            rows = new.permute(1, 3, 0, 2, 4).reshape(batch * width, layers, heads, dim)
            cache[:, slot, :, row] = rows[src].to(cache.dtype)  # indexed view: [R, L, H, D]
        return plan.split_logits(logits.float().cpu().numpy())

    @torch.inference_mode()
    def move_rows(self, slot: int, src_rows: np.ndarray, dst_start: int) -> None:
        src = torch.as_tensor(np.asarray(src_rows), dtype=torch.long)
        dst = torch.arange(dst_start, dst_start + len(src))
        if torch.equal(src, dst):
            return
        src, dst = src.to(self.device), dst.to(self.device)
        for cache in (self.k_cache, self.v_cache):
            view = cache[:, slot]  # [L, H, M, D], a view
            view[:, :, dst] = view[:, :, src]
