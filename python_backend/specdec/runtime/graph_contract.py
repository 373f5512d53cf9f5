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

from specdec.checkpoint import PROPOSAL_VOCAB_FILE, read_proposal_vocab, read_spec

# Bump when inputs, outputs or semantics change: cached exports are then rebuilt. 2: model families (biases,
# q/k norms, rotary types from transformers). 3: the hidden_states output; EAGLE heads' features input.
# 4: attention and output-layer products of at least two rows (bit-identical decode and verification).
# 5: a drafter's logits over its proposal vocabulary only (the runtime knows the columns' token ids).
GRAPH_VERSION = 5
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # TensorRT build flag -> graph dtype
DEFAULT_PRECISION = "fp16"
INPUTS = ("input_ids", "position_ids", "attention_mask", "past_keys", "past_values", "logit_rows")
# An EAGLE head's graph (ModelSpec.is_eagle) also takes the feature of every input token.
EAGLE_INPUTS = (*INPUTS, "features")
OUTPUTS = ("logits", "new_keys", "new_values", "hidden_states")
DYNAMIC_AXES = {
    "features": {0: "batch", 1: "new_tokens"},
    "hidden_states": {0: "rows"},
    "input_ids": {0: "batch", 1: "new_tokens"},
    "position_ids": {0: "batch", 1: "new_tokens"},
    "attention_mask": {0: "batch", 1: "new_tokens", 2: "key_length"},
    "past_keys": {1: "batch", 3: "past_length"},
    "past_values": {1: "batch", 3: "past_length"},
    "logit_rows": {0: "num_logits"},
    "logits": {0: "num_logits"},
    "new_keys": {1: "batch", 3: "new_tokens"},
    "new_values": {1: "batch", 3: "new_tokens"},
}
ONNX_FILE = "decoder.onnx"
META_PREFIX = "specdec."


def graph_inputs(is_eagle: bool) -> tuple[str, ...]:
    """The input names of a checkpoint's step graph."""
    return EAGLE_INPUTS if is_eagle else INPUTS


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


def read_graph_metadata(onnx_path: str | Path) -> dict[str, str]:
    """The specdec.* metadata of an exported graph (without loading its weights)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}
