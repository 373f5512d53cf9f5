"""Read a Hugging Face checkpoint of a supported family (config.json + safetensors) without transformers.

The families and what each changes in the decoder: specdec.families."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.families import (
    UnsupportedCheckpoint,
    check_common,
    exact_context,
    family_of,
    rope_parameters,
    rope_tables,
)

__all__ = ["LlamaSpec", "ModelSpec", "UnsupportedCheckpoint", "load_state_dict", "read_end_ids", "read_proposal_vocab",
           "read_spec"]

if TYPE_CHECKING:  # torch is imported only by what loads weights: an onnxruntime process runs without it
    import torch


# config.json key of an EAGLE draft head: {"feature_size": N, "feature": "final_norm"}. Such a checkpoint is one
# Llama-family decoder layer whose input row is `eagle.fc` applied to [embedding of the token, feature]; the
# feature is the target's final-normed hidden state at the previous position (what its output layer reads),
# and the head's own final-normed output is the feature of its next row when it drafts autoregressively.
EAGLE_CONFIG_KEY = "specdec_eagle"
EAGLE_FC_WEIGHT = "eagle.fc.weight"
EAGLE_FC_BIAS = "eagle.fc.bias"
# EAGLE-3's multi-layer fusion. A head trained on fused features (build/train_eagle.py --aux) lists the target
# layers it reads under EAGLE_CONFIG_KEY's "aux_layers"; its feature is then [final-normed state, the output of
# each listed decoder layer RMS-normalized without a weight], (1 + layers) x hidden wide, and its fc reads
# [embedding, feature]. The target emits that feature when its config.json lists the same layers under
# FEATURE_LAYERS_KEY. A drafted row has no target layer outputs: the head's own output, zero-padded.
FEATURE_LAYERS_KEY = "specdec_feature_layers"
EAGLE_AUX_LAYERS = "aux_layers"


@dataclass(frozen=True)
class ModelSpec:
    """The architecture numbers and family traits the runtimes need, read from a Hugging Face config.json.

    What a family changes in the decoder is `specdec.families` (qkv/o/mlp biases, q/k norms, sliding window,
    rotary parameters); `from_config` raises `UnsupportedCheckpoint` naming the field of anything else."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eagle_feature_size: int = 0  # > 0: an EAGLE draft head reading the target's features (EAGLE_CONFIG_KEY)
    eagle_aux_layers: tuple[int, ...] = ()  # an EAGLE head: the target layers its feature fuses
    feature_layers: tuple[int, ...] = ()  # a target: decoder layers whose outputs its features add (fusion)

    @classmethod
    def from_config(cls, cfg: dict) -> ModelSpec:
        family = family_of(cfg)
        cfg = family.complete(cfg)
        check_common(cfg)
        traits = family.traits(cfg)
        rope = rope_parameters(cfg)
        heads = int(cfg["num_attention_heads"])
        return cls(
            family=family.model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=_token_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            rope_parameters=rope,
            eagle_feature_size=int((cfg.get(EAGLE_CONFIG_KEY) or {}).get("feature_size", 0)),
            eagle_aux_layers=tuple(int(i) for i in (cfg.get(EAGLE_CONFIG_KEY) or {}).get(EAGLE_AUX_LAYERS, ())),
            feature_layers=_feature_layers(cfg),
            **asdict(traits),
        )

    @property
    def feature_width(self) -> int:
        """Width of the features this model returns as a target: the final-normed state, then one block per
        fused layer."""
        return self.hidden_size * (1 + len(self.feature_layers))

    @property
    def is_eagle(self) -> bool:
        return self.eagle_feature_size > 0

    @property
    def context_limit(self) -> int:
        """The longest context the runtimes serve exactly: max_position_embeddings, or less for rope types whose
        frequencies switch with the sequence length (specdec.families.exact_context)."""
        return exact_context(self.rope_parameters, self.max_position_embeddings)

    def served_length(self, requested: int | None) -> int:
        """The cache length a runtime allocates for a deployment asking `requested` (None: the model's)."""
        return min(requested or self.context_limit, self.context_limit)

    def rope_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin [positions, head_dim] (specdec.families.rope_tables; needs torch)."""
        return rope_tables(self.head_dim, self.max_position_embeddings, self.rope_parameters, positions)


LlamaSpec = ModelSpec  # the name before families other than Llama were served


def read_spec(model_dir: str | Path) -> ModelSpec:
    """The spec of a checkpoint folder; raises UnsupportedCheckpoint (a ValueError) naming the config field of
    anything the runtimes cannot serve."""
    return ModelSpec.from_config(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))


def _feature_layers(cfg: dict) -> tuple[int, ...]:
    layers = tuple(int(i) for i in cfg.get(FEATURE_LAYERS_KEY) or ())
    last = int(cfg["num_hidden_layers"]) - 1
    if any(not 0 <= i < last for i in layers) or len(set(layers)) != len(layers):
        raise UnsupportedCheckpoint(FEATURE_LAYERS_KEY, list(layers), f"must be distinct decoder layers 0..{last - 1} "
                                    "(the last one's output is the final feature)")
    return layers


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def read_end_ids(model_dir: str | Path) -> frozenset[int]:
    """The ids that end a generation, as Hugging Face `generate` takes them: generation_config.json's
    `eos_token_id` when it has one (Llama 3.x and Qwen2.5 instruct models list several there, e.g.
    <|eot_id|> beside <|end_of_text|>), else config.json's."""
    folder = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            ids = _token_ids(json.loads(path.read_text(encoding="utf-8")).get("eos_token_id"))
            if ids:
                return frozenset(ids)
    return frozenset()


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All safetensors shards of a checkpoint folder, merged into one state dict."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


PROPOSAL_VOCAB_FILE = "proposal_vocab.json"


def read_proposal_vocab(model_dir: str | Path, vocab_size: int) -> list[int] | None:
    """The token ids a draft's output layer is restricted to, or None when it keeps the whole vocabulary.

    A draft checkpoint folder may hold `proposal_vocab.json` (`{"token_ids": [...]}`, written by
    `build/draft_vocab.py`): its runtimes then compute logits only for those tokens (FR-Spec's
    frequency-ranked output layer, arXiv:2502.14856) and give every other token -inf. With a 1-layer draft
    the output layer is most of its step, so this is how the draft/target cost ratio c comes down. Lossless
    modes stay lossless: the draft's law q is simply zero outside the subset and the target verifies.
    """
    path = Path(model_dir) / PROPOSAL_VOCAB_FILE
    if not path.exists():
        return None
    token_ids = json.loads(path.read_text(encoding="utf-8")).get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or not all(isinstance(t, int) for t in token_ids):
        raise ValueError(f"{path}: 'token_ids' must be a non-empty list of integers")
    if len(set(token_ids)) != len(token_ids) or min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"{path}: token ids must be distinct and in [0, {vocab_size})")
    return token_ids

