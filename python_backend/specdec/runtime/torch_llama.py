"""A Llama-style decoder in plain torch over a paged KV cache (specdec.kv_memory).

Loads a Hugging Face checkpoint of any supported family (specdec.families: biases, q/k norms, sliding
window and rotary tables come from its spec), runs in fp32 on CPU by default (or any torch device/dtype), batches
several sequences with different cache lengths into one padded forward, and supports tree attention
masks. Rollback is free: the engine simply passes a shorter `past_length` next time. Each layer's cache is
one [kv_heads, pool rows, head_dim] tensor per K and V; a forward gathers its slots' rows through their
block tables.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specdec.checkpoint import (
    EAGLE_FC_BIAS,
    EAGLE_FC_WEIGHT,
    ModelSpec,
    load_state_dict,
    read_proposal_vocab,
    read_spec,
)
from specdec.runtime.base import DecoderRuntime, ForwardItem, ForwardOutput, make_pool
from specdec.runtime.layout import plan_batch


class LlamaWeights:
    """Checkpoint tensors regrouped for few, large matmuls (fused QKV and gate/up projections).

    Per layer: `qkv`, `o`, `gate_up`, `down` weights, their biases `qkv_bias`, `o_bias`, `gate_up_bias`,
    `down_bias` (None where the family has none), `attn_norm`, `mlp_norm`, and `q_norm` / `k_norm` (per-head
    RMSNorm weights, None where the family has none)."""

    def __init__(self, spec: ModelSpec, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                 proposal_ids: list[int] | None = None):
        def get(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(f"the {spec.family} checkpoint has no tensor {name!r} (its config.json promises it)")
            return state[name].to(device=device, dtype=dtype)

        def cat(names: list[str], present: bool) -> torch.Tensor | None:
            return torch.cat([get(name) for name in names]) if present else None

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if spec.tie_word_embeddings else get("lm_head.weight")
        # A draft restricted to a proposal vocabulary keeps only those rows of its output layer.
        if proposal_ids is not None:  # logits over those columns only (DecoderRuntime.logit_ids)
            self.lm_head = self.lm_head[torch.as_tensor(proposal_ids, device=device)].contiguous()
        self.final_norm = get("model.norm.weight")
        # An EAGLE head's input projection: [token embedding, feature] -> hidden (specdec.checkpoint).
        self.eagle_fc = get(EAGLE_FC_WEIGHT) if spec.is_eagle else None
        self.eagle_fc_bias = get(EAGLE_FC_BIAS) if spec.is_eagle and EAGLE_FC_BIAS in state else None
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(
                {
                    "attn_norm": get(p + "input_layernorm.weight"),
                    "qkv": cat([attn + f"{n}_proj.weight" for n in "qkv"], True),
                    "qkv_bias": cat([attn + f"{n}_proj.bias" for n in "qkv"], spec.qkv_bias),
                    "q_norm": get(attn + "q_norm.weight") if spec.qk_norm else None,
                    "k_norm": get(attn + "k_norm.weight") if spec.qk_norm else None,
                    "o": get(attn + "o_proj.weight"),
                    "o_bias": get(attn + "o_proj.bias") if spec.o_bias else None,
                    "mlp_norm": get(p + "post_attention_layernorm.weight"),
                    "gate_up": cat([mlp + "gate_proj.weight", mlp + "up_proj.weight"], True),
                    "gate_up_bias": cat([mlp + "gate_proj.bias", mlp + "up_proj.bias"], spec.mlp_bias),
                    "down": get(mlp + "down_proj.weight"),
                    "down_bias": get(mlp + "down_proj.bias") if spec.mlp_bias else None,
                }
            )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x scaled to RMS 1 over its last axis, in fp32 (a fused layer's block of an EAGLE feature)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchLlamaRuntime(DecoderRuntime):
    """DecoderRuntime over torch tensors."""

    def __init__(
        self,
        model_dir: str | Path,
        num_slots: int,
        max_length: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        num_threads: int | None = None,
        num_blocks: int | None = None,
        block_size: int | None = None,
    ) -> None:
        """`num_blocks` blocks of `block_size` rows make the KV pool (None: every slot at full length)."""
        if num_threads:
            torch.set_num_threads(num_threads)
        self.spec = read_spec(model_dir)
        self.vocab_size = self.spec.vocab_size
        self.num_slots = num_slots
        self.max_length = self.spec.served_length(max_length)
        self.dtype = dtype
        self.device = device
        proposal_ids = read_proposal_vocab(model_dir, self.spec.vocab_size)
        self.logit_ids = None if proposal_ids is None else np.asarray(proposal_ids, dtype=np.int64)
        self.weights = LlamaWeights(self.spec, load_state_dict(model_dir), dtype, device, proposal_ids)
        s = self.spec
        self.kv = make_pool(num_slots, self.max_length, num_blocks, block_size)
        cache_shape = (s.num_kv_heads, self.kv.num_rows, s.head_dim)
        self.k_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(s.num_layers)]
        self.v_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(s.num_layers)]
        cos, sin = s.rope_tables(self.max_length)
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    def _layout(self, items: list[ForwardItem]):
        """Padded token ids, RoPE positions, cache rows to write and the attention mask of a batch."""
        plan = plan_batch(items, self.max_length, self.spec.sliding_window, self.spec.eagle_feature_size)
        as_long = lambda a: torch.as_tensor(a, dtype=torch.long, device=self.device)  # noqa: E731
        return (
            as_long(plan.ids),
            as_long(plan.positions),
            as_long(self._write_rows(plan.write_slot, plan.write_row)),
            as_long(plan.write_src),
            torch.as_tensor(plan.cache_mask()[:, None], device=self.device),
            plan,
        )

    @torch.inference_mode()
    def forward_outputs(self, items: list[ForwardItem]) -> list[ForwardOutput]:
        if not items:
            return []
        s, w = self.spec, self.weights
        self._grow_for(items)
        ids, positions, write_rows, write_src, mask, plan = self._layout(items)
        total = plan.total
        batch, width = ids.shape
        # [B, 1, total] physical rows of each slot's first `total` rows, against [1, H, 1] heads: one gather
        # of every layer's keys straight into the [B, H, total, D] layout attention wants.
        gather_rows = torch.as_tensor(self.kv.gather_rows([item.slot for item in items], total),
                                      device=self.device)[:, None, :]
        heads = torch.arange(s.num_kv_heads, device=self.device)[None, :, None]
        cos = self.rope_cos[positions][:, None]  # [B, 1, W, D]
        sin = self.rope_sin[positions][:, None]
        q_size = s.num_heads * s.head_dim
        kv_size = s.num_kv_heads * s.head_dim
        hidden = F.embedding(ids, w.embed)
        if w.eagle_fc is not None:
            features = torch.as_tensor(plan.features, device=self.device).to(self.dtype)
            hidden = F.linear(torch.cat([hidden, features], dim=-1), w.eagle_fc, w.eagle_fc_bias)
        fused = s.feature_layers if len(plan.hidden_rows) else ()
        layer_outputs = {}  # the fused layers' outputs (specdec.checkpoint.FEATURE_LAYERS_KEY)
        for index, (lw, k_cache, v_cache) in enumerate(zip(w.layers, self.k_cache, self.v_cache, strict=True)):
            x = rms_norm(hidden, lw["attn_norm"], s.rms_norm_eps)
            q, k, v = F.linear(x, lw["qkv"], lw["qkv_bias"]).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(batch, width, s.num_heads, s.head_dim)
            k = k.view(batch, width, s.num_kv_heads, s.head_dim)
            if s.qk_norm:
                q = rms_norm(q, lw["q_norm"], s.rms_norm_eps)
                k = rms_norm(k, lw["k_norm"], s.rms_norm_eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(batch, width, s.num_kv_heads, s.head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            # Scatter the valid new rows into the cache, then attend over each slot's first `total` rows.
            k_new = k.transpose(1, 2).reshape(batch * width, s.num_kv_heads, s.head_dim)[write_src]
            v_new = v.transpose(1, 2).reshape(batch * width, s.num_kv_heads, s.head_dim)[write_src]
            k_cache[:, write_rows] = k_new.transpose(0, 1)
            v_cache[:, write_rows] = v_new.transpose(0, 1)
            keys = k_cache[heads, gather_rows]
            values = v_cache[heads, gather_rows]
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(s.head_dim),
                enable_gqa=s.num_heads != s.num_kv_heads,
            )
            attn = attn.transpose(1, 2).reshape(batch, width, q_size)
            hidden = hidden + F.linear(attn, lw["o"], lw["o_bias"])
            x = rms_norm(hidden, lw["mlp_norm"], s.rms_norm_eps)
            gate, up = F.linear(x, lw["gate_up"], lw["gate_up_bias"]).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, lw["down"], lw["down_bias"])
            if index in fused:
                layer_outputs[index] = hidden
        # Logits only where asked: the last num_logits valid positions of each item.
        flat = hidden.reshape(batch * width, -1)
        rows = torch.as_tensor(plan.logit_rows, dtype=torch.long, device=self.device)
        last = rms_norm(flat[rows], w.final_norm, s.rms_norm_eps)
        logits = F.linear(last, w.lm_head).float()
        hidden_all = None
        if len(plan.hidden_rows):  # the features of the rows asked for, scattered back into [B * W] rows
            hidden_rows = torch.as_tensor(plan.hidden_rows, dtype=torch.long, device=self.device)
            blocks = [rms_norm(flat[hidden_rows], w.final_norm, s.rms_norm_eps).float()]
            blocks += [unit_rms(layer_outputs[i].reshape(batch * width, -1)[hidden_rows], s.rms_norm_eps)
                       for i in fused]
            normed = torch.cat(blocks, dim=-1).cpu().numpy()
            hidden_all = np.zeros((batch * width, normed.shape[1]), dtype=np.float32)
            hidden_all[plan.hidden_rows] = normed
        return plan.outputs(logits.cpu().numpy(), hidden_all)

    @torch.inference_mode()
    def move_rows(self, slot: int, src_rows: np.ndarray, dst_start: int) -> None:
        src_rows = np.asarray(src_rows, dtype=np.int64)
        dst_rows = np.arange(dst_start, dst_start + len(src_rows))
        if np.array_equal(src_rows, dst_rows):
            return
        src = torch.as_tensor(self.kv.physical_rows(slot, src_rows), device=self.device)
        dst = torch.as_tensor(self.kv.physical_rows(slot, dst_rows), device=self.device)
        for cache in self.k_cache + self.v_cache:
            cache[:, dst] = cache[:, src]
