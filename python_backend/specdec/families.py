"""The model families the runtimes serve, and the ONE place that says what each changes in the decoder.

Every supported family is a Llama-style decoder (RMSNorm, rotary positions, SiLU-gated MLP, grouped-query
attention). What differs is read here from the checkpoint's config.json into `DecoderTraits`; the runtimes
(torch, the ONNX step graph, the TensorRT engine built from it) read only those traits, never the family's
name:

| family (model_type) | differences |
| --- | --- |
| llama (Llama 2 / 3.x, SmolLM2) | `attention_bias` (q/k/v/o biases), `mlp_bias`; any HF rope type below |
| qwen2 (Qwen2 / Qwen2.5)        | q/k/v projection biases (always), o without |
| qwen3                          | per-head RMSNorm on q and k; `head_dim` apart from hidden / heads; `attention_bias` |
| mistral                        | `sliding_window` attention on every layer (null: full attention) |

Rotary tables come from transformers' own rope functions (`rope_tables`), computed once per process
(torch runtime) or at export time (ONNX / TensorRT graphs hold them as constants). Anything outside this
table raises `UnsupportedCheckpoint` naming the config.json field and its value, when the spec is read
(import, export, engine build, model load: before the server serves).

This module imports neither torch nor transformers at import time: an onnxruntime serving process reads
specs without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class UnsupportedCheckpoint(ValueError):
    """A config.json field has a value the runtimes cannot serve exactly."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"config.json {field} = {value!r}: {why}")
        self.field = field
        self.value = value


@dataclass(frozen=True)
class DecoderTraits:
    """What a family changes in the shared decoder."""

    qkv_bias: bool  # q/k/v projections have biases
    o_bias: bool  # the attention output projection has a bias
    mlp_bias: bool  # gate/up/down projections have biases
    qk_norm: bool  # RMSNorm over head_dim on every query and key head, before the rotation
    sliding_window: int | None  # each token attends to the last `sliding_window` positions (itself included)


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class that is the reference for this family
    describe: str
    traits: Callable[[dict], DecoderTraits]


# rope_type -> the longest context a static cos/sin table serves exactly (None: the model's whole context).
# `dynamic` and `longrope` change their frequencies with the current sequence length in transformers; below
# the length where they switch, they are plain tables (`dynamic` switches past max_position_embeddings, which
# the runtimes never exceed; `longrope` at original_max_position_embeddings).
ROPE_TYPES: dict[str, str | None] = {
    "default": None,
    "linear": None,
    "dynamic": None,
    "yarn": None,
    "llama3": None,
    "longrope": "original_max_position_embeddings",
}
SUPPORTED_ACTIVATIONS = ("silu",)


def _uniform_window(cfg: dict) -> int | None:
    """Qwen2/Qwen3: `use_sliding_window` makes layers from `max_window_layers` on sliding; the step graph takes
    one attention mask for all layers, so the window must be the same everywhere (all or no layers)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= int(cfg.get("max_window_layers", layers)) else
        "full_attention" for i in range(layers)
    ]
    kinds = set(layer_types)
    if kinds - {"sliding_attention", "full_attention"}:
        raise UnsupportedCheckpoint("layer_types", sorted(kinds), "only full_attention and sliding_attention exist")
    if len(kinds) > 1:
        raise UnsupportedCheckpoint("layer_types", layer_types, "sliding-window attention on some layers only is "
                                    "not supported (all layers or none; see max_window_layers)")
    if kinds == {"sliding_attention"}:
        if not cfg.get("sliding_window"):
            raise UnsupportedCheckpoint("sliding_window", cfg.get("sliding_window"), "sliding layers need a window")
        return int(cfg["sliding_window"])
    return None


def _llama(cfg: dict) -> DecoderTraits:
    bias = bool(cfg.get("attention_bias", False))
    return DecoderTraits(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)), qk_norm=False,
                         sliding_window=None)


def _qwen2(cfg: dict) -> DecoderTraits:
    return DecoderTraits(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False,
                         sliding_window=_uniform_window(cfg))


def _qwen3(cfg: dict) -> DecoderTraits:
    bias = bool(cfg.get("attention_bias", False))
    return DecoderTraits(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                         sliding_window=_uniform_window(cfg))


def _mistral(cfg: dict) -> DecoderTraits:
    if cfg.get("layer_types"):
        raise UnsupportedCheckpoint("layer_types", cfg["layer_types"],
                                    "Mistral with per-layer attention types (Ministral) is not supported")
    window = cfg.get("sliding_window")
    return DecoderTraits(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                         sliding_window=int(window) if window else None)


FAMILIES: dict[str, Family] = {
    family.model_type: family for family in (
        Family("llama", "LlamaForCausalLM", "Llama 2 / 3.x and Llama-architecture models", _llama),
        Family("qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5", _qwen2),
        Family("qwen3", "Qwen3ForCausalLM", "Qwen3 (dense)", _qwen3),
        Family("mistral", "MistralForCausalLM", "Mistral", _mistral),
    )
}
_BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES.values()}


def family_of(cfg: dict) -> Family:
    """The family of a config.json (its `model_type`; `architectures` when model_type is absent)."""
    model_type = cfg.get("model_type")
    supported = ", ".join(f"{name} ({family.describe})" for name, family in FAMILIES.items())
    if model_type is None:
        for architecture in cfg.get("architectures") or ["LlamaForCausalLM"]:
            if architecture in _BY_ARCHITECTURE:
                return _BY_ARCHITECTURE[architecture]
        raise UnsupportedCheckpoint("architectures", cfg.get("architectures"), f"supported families: {supported}")
    if model_type not in FAMILIES:
        raise UnsupportedCheckpoint("model_type", model_type, f"supported families: {supported}")
    return FAMILIES[model_type]


def rope_parameters(cfg: dict) -> dict[str, Any]:
    """The config's rotary parameters in transformers 5's form (`rope_parameters`, or the older `rope_scaling`
    plus top-level `rope_theta`), with `rope_type` and `rope_theta` always set; raises on what no static table
    can serve."""
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if not isinstance(raw, dict) or any(isinstance(value, dict) for value in raw.values()):
        raise UnsupportedCheckpoint(field, raw, "per-layer rotary parameters are not supported")
    params = dict(raw)
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    if params["rope_type"] not in ROPE_TYPES:
        raise UnsupportedCheckpoint(f"{field}.rope_type", params["rope_type"],
                                    f"supported rope types: {', '.join(ROPE_TYPES)}")
    params.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UnsupportedCheckpoint("partial_rotary_factor", partial, "only full-width rotary embeddings (1.0)")
    params.pop("partial_rotary_factor", None)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):  # as transformers' standardize_rope_params
        if "original_max_position_embeddings" in cfg:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return params


def exact_context(params: dict[str, Any], max_position_embeddings: int) -> int:
    """The longest context static rotary tables serve exactly (see ROPE_TYPES)."""
    limit_key = ROPE_TYPES[params["rope_type"]]
    if limit_key is None:
        return max_position_embeddings
    return min(max_position_embeddings, int(params[limit_key]))


def check_common(cfg: dict) -> None:
    """What every family must have for the shared decoder."""
    activation = cfg.get("hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedCheckpoint("hidden_act", activation, f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}")
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    if heads % kv_heads:
        raise UnsupportedCheckpoint("num_key_value_heads", kv_heads, f"must divide num_attention_heads ({heads})")


def rope_tables(family: str, hidden_size: int, num_heads: int, head_dim: int, max_position_embeddings: int,
                params: dict[str, Any], positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin [positions, head_dim] of transformers' rotary embedding for these parameters (its
    ROPE_INIT_FUNCTIONS, attention scaling included), as its rotary module computes them per position."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.for_model(family, hidden_size=hidden_size, num_attention_heads=num_heads,
                                  head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                                  rope_parameters=dict(params))
    rope_type = config.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS[rope_type] if rope_type != "default" else (
        LlamaRotaryEmbedding.compute_default_rope_parameters)
    inv_freq, attention_scaling = init(config)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling
