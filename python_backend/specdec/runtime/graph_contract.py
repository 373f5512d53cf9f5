"""The step graph's interface and provenance, without torch: names, dynamic axes, dtypes and metadata.

`specdec.runtime.step_graph` builds and exports the graph (needs torch); runtimes that only run an export
(onnxruntime on the CPU) import this module instead, so a serving process does not pay for torch
(~135 MiB of private memory per process, measured).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from specdec.checkpoint import PROPOSAL_VOCAB_FILE, ModelSpec, read_proposal_vocab, read_spec

# Bump when inputs, outputs or semantics change: cached exports are then rebuilt. 2: model families (biases,
# q/k norms, rotary types from transformers). 3: the hidden_states output; EAGLE heads' features input.
# 4: attention and output-layer products of at least two rows (bit-identical decode and verification).
# 5: a drafter's logits over its proposal vocabulary only (the runtime knows the columns' token ids).
# 6: the past KV as one input per layer in the cache's own layout [kv_heads, batch, past, head_dim], and
# grouped-query attention without repeating keys: no per-step Split, Tile or transposes of the context
# (the default target, 16 decode steps at context 200 in one forward: 168 -> 75 ms on the 2-core CPU).
# 7: the new tokens' keys written at their own cache rows (input new_rows) instead of appended after the
# past: a sequence's logits are the same bit for bit in any batch and any gathered width.
# 8: the softmax's sum as a matrix product (a tree node's logits equal a chain's bit for bit).
# 9: rotate_half as a constant product, the gate/up split by constant sizes, one Shape chain for every
# layer's past: the GGUF target's graph 3,321 -> 2,067 nodes, logits bit-identical, one step of 1-4 sequences
# ~9% faster on the 2-core CPU (per-node overhead), 16-64 within noise.
GRAPH_VERSION = 9
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # TensorRT build flag -> graph dtype
DEFAULT_PRECISION = "fp16"
STEP_INPUTS = ("input_ids", "position_ids", "attention_mask", "logit_rows", "new_rows")
PAST_KEYS, PAST_VALUES = "past_keys", "past_values"  # one input a layer: past_keys_0, past_keys_1, ...
FEATURES = "features"  # an EAGLE head's graph (ModelSpec.is_eagle) also takes the feature of every input token
OUTPUTS = ("logits", "new_keys", "new_values", "hidden_states")
_AXES = {
    FEATURES: {0: "batch", 1: "new_tokens"},
    "hidden_states": {0: "rows"},
    "input_ids": {0: "batch", 1: "new_tokens"},
    "position_ids": {0: "batch", 1: "new_tokens"},
    "attention_mask": {0: "batch", 1: "new_tokens", 2: "key_rows"},
    "logit_rows": {0: "num_logits"},
    "new_rows": {0: "batch", 1: "new_tokens"},
    "logits": {0: "num_logits"},
    "new_keys": {2: "batch", 3: "new_tokens"},
    "new_values": {2: "batch", 3: "new_tokens"},
}
PAST_AXES = {1: "batch", 2: "key_rows"}  # of every past_keys_i / past_values_i [kv_heads, batch, rows, head_dim]
ONNX_FILE = "decoder.onnx"
META_PREFIX = "specdec."


def past_inputs(num_layers: int) -> tuple[str, ...]:
    """The past-KV input names: every layer's keys, then every layer's values."""
    return (*(f"{PAST_KEYS}_{i}" for i in range(num_layers)), *(f"{PAST_VALUES}_{i}" for i in range(num_layers)))


def graph_inputs(spec: ModelSpec) -> tuple[str, ...]:
    """The input names of a checkpoint's step graph, in the graph's order."""
    return (*STEP_INPUTS, *past_inputs(spec.num_layers), *((FEATURES,) if spec.is_eagle else ()))


def dynamic_axes(name: str) -> dict[int, str]:
    """The named dynamic axes of a graph input or output."""
    return PAST_AXES if name.startswith((PAST_KEYS, PAST_VALUES)) else _AXES[name]


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """sha256 of config.json, every safetensors file and the proposal vocabulary if any: an export or engine
    is stale when one changes."""
    digest = hashlib.sha256()
    folder = Path(model_dir)
    extra = [folder / PROPOSAL_VOCAB_FILE] if (folder / PROPOSAL_VOCAB_FILE).exists() else []
    for path in [folder / "config.json", *sorted(folder.glob("*.safetensors")), *extra]:
        digest.update(path.name.encode())
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def graph_metadata(model_dir: str | Path, dtype: str, max_positions: int) -> dict[str, str]:
    """What an export was made from; a cached export is reused only when all of it matches."""
    spec = read_spec(model_dir)
    proposal_ids = read_proposal_vocab(model_dir, spec.vocab_size)
    return {
        "graph_version": str(GRAPH_VERSION),
        "checkpoint_fingerprint": checkpoint_fingerprint(model_dir),
        "dtype": dtype,
        "max_positions": str(max_positions),
        "spec": json.dumps(asdict(spec), sort_keys=True),
        "proposal_vocab_size": str(spec.vocab_size if proposal_ids is None else len(proposal_ids)),
    }


def save_atomically(model, out_path: str | Path) -> Path:
    """onnx.save_model to a staged file, then renamed: a reader (another Triton instance) never sees half a graph."""
    import os

    import onnx

    out_path = Path(out_path)
    staged = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    try:
        onnx.save_model(model, str(staged))
        os.replace(staged, out_path)
    finally:
        staged.unlink(missing_ok=True)
    return out_path


def read_graph_metadata(onnx_path: str | Path) -> dict[str, str]:
    """The specdec.* metadata of an exported graph (without loading its weights)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
