"""The decoder step as an exportable graph (ONNX, then TensorRT), and its export.

One call runs one padded forward of a batch over its KV context:

inputs
    input_ids       int64 [batch, new_tokens]
    position_ids    int64 [batch, new_tokens]                      RoPE positions (tree depth for trees)
    attention_mask  bool  [batch, new_tokens, key_rows]            over key rows 0..key_rows-1 (below)
    logit_rows      int64 [num_logits]                             rows of the flattened [batch*new_tokens]
    new_rows        int64 [batch, new_tokens]                      the key row each new token is written to
    past_keys_i     dtype [kv_heads, batch, key_rows, head_dim]    layer i's cache rows 0..key_rows-1, one
    past_values_i   dtype [kv_heads, batch, key_rows, head_dim]    input per layer (keys of every layer first)
    features        fp32  [batch, new_tokens, feature_size]       EAGLE heads only: each token's feature
outputs
    logits          fp32  [num_logits, vocab]  (a drafter with a proposal vocabulary: [num_logits, its size],
                                                  the columns DecoderRuntime.logit_ids names)
    new_keys        dtype [layers, kv_heads, batch, new_tokens, head_dim]  KV of the new tokens only
    new_values      dtype [layers, kv_heads, batch, new_tokens, head_dim]
    hidden_states   fp32  [batch*new_tokens, feature_width]        final-normed hidden state of every row
                                                                  (an EAGLE head's features), then the
                                                                  RMS-normalized outputs of the config's
                                                                  feature layers (EAGLE-3 fusion)

Why "past in, new KV out" and not an in-place cache: the slotted cache stays with the runtime (numpy /
torch CPU for onnxruntime, torch CUDA for TensorRT), so the graph is stateless and any slot, rollback by
length and tree-path commit (`move_rows`) stay plain tensor indexing outside it; the graph returns only the
W new rows (a full `present` output would copy the whole context back every step), and the runtime
scatters them into the slots. Causal, padded-batch and tree attention are all one boolean mask input.

Why the new tokens are written into the key rows (`new_rows`, the rows they will have in the cache) rather
than appended after the past: every key then sits at its own cache row whatever the batch, so a sequence's
logits are the same bit for bit alone, in a batch beside longer sequences, or with its context gathered
wider than it needs (rows past every valid key are masked, and masked keys at the end change no sum);
appended after a padded past, a sequence's new keys moved with the padding, and onnxruntime's vectorized
sums round differently unless the shift is a multiple of 16. `key_rows` is at least every item's first new
row plus the batch's new-token width (padding tokens are written to rows no valid query sees).

Why one past input per layer in the cache's layout: onnxruntime copies every tensor an op slices, so a
stacked [layers, ...] input cost a Split of the whole context per step, and a [batch, heads, ...] layout a
transpose; per-layer inputs in the cache's own [kv_heads, rows, head_dim] order are read where the runtime's
one gather put them. Grouped-query attention multiplies each KV head's group of query heads with it in one
product instead of repeating the keys per query head.

`key_rows` is at least 1 (a fresh sequence gets one masked dummy row): TensorRT profiles and some
kernels dislike empty dimensions.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.checkpoint import ModelSpec, load_state_dict, read_proposal_vocab, read_spec
from specdec.runtime.graph_contract import (
    META_PREFIX,
    OUTPUTS,
    dynamic_axes,
    graph_inputs,
    graph_metadata,
    past_inputs,
)
from specdec.runtime.torch_llama import LlamaWeights

OPSET = 17
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` that records no node when nothing changes (onnxruntime 1.31's basic optimizer breaks
    graphs with identity Casts that have several consumers)."""
    return x if x.dtype == dtype else x.to(dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch_llama.rms_norm (fp32 statistics) without identity casts."""
    xf = _cast(x, torch.float32)
    return weight * _cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), x.dtype)


class LlamaStepGraph(torch.nn.Module):
    """The decoder step of a checkpoint of any supported family, written with export-friendly ops (explicit
    attention with a boolean mask, fp32 norms and softmax), the same math as TorchLlamaRuntime. The family's
    traits (specdec.families) decide which biases and norms the graph holds; its rotary tables are constants
    computed here, at export time (the runtimes that run the graph have no torch); a sliding window is part of
    the attention mask input (specdec.runtime.layout)."""

    def __init__(self, spec: ModelSpec, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, proposal_ids: list[int] | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        w = LlamaWeights(spec, state, dtype, "cpu", proposal_ids)
        self.register_buffer("embed", w.embed)
        self.register_buffer("lm_head", w.lm_head)
        self.register_buffer("final_norm", w.final_norm)
        self.register_buffer("eagle_fc", w.eagle_fc)
        self.register_buffer("eagle_fc_bias", w.eagle_fc_bias)
        self.num_layers = spec.num_layers
        for i, layer in enumerate(w.layers):
            for key, tensor in layer.items():
                self.register_buffer(f"l{i}_{key}", tensor)  # None (no node) where the family has none
        # The softmax's sums (forward): 16 columns, the width of a product kernel's vector, not a GEMV's single one.
        self.register_buffer("ones", torch.ones(max_positions, 16, dtype=dtype))
        cos, sin = spec.rope_tables(max_positions)
        self.register_buffer("rope_cos", cos.to(dtype))
        self.register_buffer("rope_sin", sin.to(dtype))
        # rotate_half as a product with a constant signed permutation: exactly the same values (one +-1 term
        # per column, the rest exact zeros), one node where the slicing took eight (a Shape chain, two Slices,
        # Neg, Concat) per use.
        half = spec.head_dim // 2
        rotation = torch.zeros(spec.head_dim, spec.head_dim, dtype=dtype)
        rotation[torch.arange(half) + half, torch.arange(half)] = -1
        rotation[torch.arange(half), torch.arange(half) + half] = 1
        self.register_buffer("rotation", rotation)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                logit_rows: torch.Tensor, *past_and_features: torch.Tensor):
        s = self.spec
        new_rows, past_and_features = past_and_features[0], past_and_features[1:]
        past_keys = past_and_features[:s.num_layers]
        past_values = past_and_features[s.num_layers:2 * s.num_layers]
        features = past_and_features[2 * s.num_layers] if s.is_eagle else None
        batch, width = input_ids.shape[0], input_ids.shape[1]
        kv_heads, group = s.num_kv_heads, s.num_heads // s.num_kv_heads
        q_size, kv_size = s.num_heads * s.head_dim, kv_heads * s.head_dim
        scale = 1.0 / math.sqrt(s.head_dim)
        cos = F.embedding(position_ids, self.rope_cos)  # [B, W, D]
        sin = F.embedding(position_ids, self.rope_sin)
        # One more query row (a copy of the first, dropped after): every attention product then has two or
        # more rows. onnxruntime multiplies a single row with another kernel whose sums round differently, and
        # a decode step must give the logits a verification pass gives, bit for bit (docs/SPECULATION.md,
        # "Bit-identical greedy output"); past one row, every row's result is the same whatever the count.
        mask = torch.cat([attention_mask, attention_mask[:, :1]], dim=1)  # [B, W+1, T]
        mask = mask.unsqueeze(0).unsqueeze(2)  # [1, B, 1, W+1, T]
        # Where each new token's keys go: (kv head, item, row) index triples, one ScatterND a layer (onnxruntime's
        # ScatterElements with per-element indices costs 1.7x as much).
        heads = torch.arange(kv_heads, dtype=torch.long)[:, None, None].expand(kv_heads, batch, width)
        items = torch.arange(batch, dtype=torch.long)[None, :, None].expand(kv_heads, batch, width)
        at = (heads, items, new_rows[None].expand(kv_heads, batch, width))
        # The softmax's sum multiplies by this many rows of `ones`: the key rows of every layer's past.
        ones = self.ones[:past_keys[0].shape[2]]
        hidden = F.embedding(input_ids, self.embed)
        if self.eagle_fc is not None:
            hidden = F.linear(torch.cat([hidden, _cast(features, self.dtype)], dim=-1), self.eagle_fc,
                              self.eagle_fc_bias)
        new_keys, new_values, layer_outputs = [], [], {}
        for i in range(self.num_layers):
            layer = lambda key, i=i: getattr(self, f"l{i}_{key}")  # noqa: E731
            x = _rms_norm(hidden, layer("attn_norm"), s.rms_norm_eps)
            q, k, v = F.linear(x, layer("qkv"), layer("qkv_bias")).split([q_size, kv_size, kv_size], dim=-1)
            # Query head h reads KV head h // group: queries [B, W, kv_heads, group, D].
            q = q.reshape(batch, width, kv_heads, group, s.head_dim)
            k = k.reshape(batch, width, kv_heads, s.head_dim)
            if s.qk_norm:
                q = _rms_norm(q, layer("q_norm"), s.rms_norm_eps)
                k = _rms_norm(k, layer("k_norm"), s.rms_norm_eps)
            q = q * cos[:, :, None, None] + torch.matmul(q, self.rotation) * sin[:, :, None, None]
            k = k * cos[:, :, None] + torch.matmul(k, self.rotation) * sin[:, :, None]
            # The cache's own layout, [kv_heads, batch, tokens, D]: the context is read as it comes in, and
            # each KV head's group of query heads is one product with it (no repeated keys).
            k = k.permute(2, 0, 1, 3)
            v = v.reshape(batch, width, kv_heads, s.head_dim).permute(2, 0, 1, 3)
            new_keys.append(k)
            new_values.append(v)
            keys = past_keys[i].index_put(at, k)  # [Hkv, B, T, D], the new keys at their rows
            values = past_values[i].index_put(at, v)
            q = q.permute(2, 0, 3, 1, 4)  # [Hkv, B, group, W, D]
            q = torch.cat([q, q[:, :, :, :1]], dim=3)  # the extra query row (above)
            q = q.reshape(kv_heads, batch, group * (width + 1), s.head_dim)
            scores = _cast(torch.matmul(q * scale, keys.transpose(2, 3)), torch.float32)
            scores = scores.reshape(kv_heads, batch, group, width + 1, -1)
            scores = torch.where(mask, scores, torch.finfo(torch.float32).min)
            # Softmax with its sum taken by a matrix product: a tree node's ancestors sit at other cache rows
            # than the same tokens in a chain, and a vectorized sum over key rows (onnxruntime's Softmax) rounds
            # by where each term falls; a product accumulates over the key rows in order, so masked rows (exactly
            # 0) between the visible ones change nothing and a tree node gets a chain's logits bit for bit.
            weights = torch.exp(scores - scores.amax(-1, keepdim=True))
            weights = _cast(weights, self.dtype).reshape(kv_heads, batch, group * (width + 1), -1)
            total = torch.matmul(weights, ones)[..., :1]  # [.., rows, 1]
            attn = (torch.matmul(weights, values) / total).reshape(kv_heads, batch, group, width + 1, s.head_dim)
            attn = attn[:, :, :, :width].permute(1, 3, 0, 2, 4).reshape(batch, width, q_size)
            hidden = hidden + F.linear(attn, layer("o"), layer("o_bias"))
            x = _rms_norm(hidden, layer("mlp_norm"), s.rms_norm_eps)
            gate, up = F.linear(x, layer("gate_up"), layer("gate_up_bias")).split(s.intermediate_size, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, layer("down"), layer("down_bias"))
            if i in s.feature_layers:
                layer_outputs[i] = hidden
        normed = _rms_norm(hidden.reshape(batch * width, s.hidden_size), self.final_norm, s.rms_norm_eps)
        features = _cast(normed, torch.float32)
        if s.feature_layers:  # EAGLE-3 fusion: the fused layers' outputs at unit RMS (specdec.checkpoint)
            blocks = [_cast(layer_outputs[i].reshape(batch * width, s.hidden_size), torch.float32)
                      for i in s.feature_layers]
            features = torch.cat([features, *[b * torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + s.rms_norm_eps)
                                              for b in blocks]], dim=-1)
        # One more logit row (the first again, dropped after), for the reason of the extra query row.
        logit_index = torch.cat([logit_rows, logit_rows[:1]])
        logits = _cast(F.linear(normed.index_select(0, logit_index), self.lm_head)[:-1], torch.float32)
        return logits, torch.stack(new_keys), torch.stack(new_values), features


def example_inputs(spec: ModelSpec, dtype: torch.dtype, batch: int = 2, width: int = 3,
                   past: int = 5) -> tuple[torch.Tensor, ...]:
    """Inputs of the given sizes in the graph's order (graph_contract.graph_inputs; distinct sizes, so the
    tracer keeps every dynamic axis symbolic)."""
    cache = (spec.num_kv_heads, batch, past + width, spec.head_dim)
    ids = torch.arange(batch * width, dtype=torch.long).reshape(batch, width) % spec.vocab_size
    positions = past + torch.arange(width, dtype=torch.long).expand(batch, width)
    mask = torch.ones(batch, width, past + width, dtype=torch.bool).tril(diagonal=past)
    logit_rows = torch.arange(batch * width - 1, dtype=torch.long)
    new_rows = positions.clone()
    inputs = (ids, positions, mask, logit_rows, new_rows,
              *(torch.zeros(cache, dtype=dtype) for _ in range(2 * spec.num_layers)))
    if spec.is_eagle:
        inputs += (torch.randn(batch, width, spec.eagle_feature_size),)
    return inputs


def _share_past_shapes(model, spec: ModelSpec) -> None:
    """Point every Shape of a past input at the first one: all have the same shape (graph_contract), so the
    shape arithmetic the exporter wrote per layer (the new keys' ScatterND updates) becomes one chain that
    onnxruntime computes once instead of once a layer."""
    pasts = set(past_inputs(spec.num_layers))
    first = past_inputs(spec.num_layers)[0]
    for node in model.graph.node:
        if node.op_type == "Shape" and node.input[0] in pasts:
            node.input[0] = first


def export_decoder(model_dir: str | Path, out_path: str | Path, dtype: str = "float32",
                   max_positions: int | None = None) -> Path:
    """Export the decoder step of a Hugging Face checkpoint (any supported family) to ONNX (atomically: a
    reader never sees a half-written file). `max_positions` sizes the RoPE table (default: the context the
    checkpoint serves exactly, ModelSpec.context_limit)."""
    import onnx

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    spec = read_spec(model_dir)
    max_positions = spec.served_length(max_positions)
    module = LlamaStepGraph(spec, load_state_dict(model_dir), DTYPES[dtype], max_positions,
                            read_proposal_vocab(model_dir, spec.vocab_size)).eval()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    names = [*graph_inputs(spec), *OUTPUTS]
    axes = {name: dynamic_axes(name) for name in names}
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".export-") as tmp:
        traced = Path(tmp) / "traced.onnx"
        with torch.inference_mode():
            torch.onnx.export(
                module, example_inputs(spec, DTYPES[dtype]), str(traced), dynamo=False,
                input_names=list(graph_inputs(spec)),
                output_names=list(OUTPUTS), dynamic_axes=axes, opset_version=OPSET,
                do_constant_folding=True,
            )
        model = onnx.load(str(traced))
        _share_past_shapes(model, spec)
        for key, value in graph_metadata(model_dir, dtype, max_positions).items():
            model.metadata_props.add(key=META_PREFIX + key, value=value)
        model.producer_name = "specdec-triton"
        staged = Path(tmp) / out_path.name
        large = model.ByteSize() > 1_800_000_000  # protobuf's 2 GiB limit: weights go to a side file
        onnx.save_model(model, str(staged), save_as_external_data=large, location=out_path.name + ".data")
        if large:
            os.replace(Path(tmp) / (out_path.name + ".data"), out_path.parent / (out_path.name + ".data"))
        os.replace(staged, out_path)
    return out_path


