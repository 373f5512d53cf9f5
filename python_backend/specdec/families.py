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

Rotary tables (`rope_tables`) are computed once per process (torch runtime) or at export time (the ONNX /
TensorRT graphs hold them as constants). They follow transformers 5's rope functions
(transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS), ported here because the model processes cannot
import transformers: the Python backend's stub links the system libpython, against which the venv's `ssl`
extension (imported by transformers through huggingface_hub) fails to load (`undefined symbol:
_PyModule_Add`). tests/unit/test_model_families.py checks every rope type against transformers' own rotary
module. Anything outside this
table raises `UnsupportedCheckpoint` naming the config.json field and its value, when the spec is read
(import, export, engine build, model load: before the server serves).

This module imports neither torch nor transformers: an onnxruntime serving process reads specs without them;
`rope_tables` imports torch when called.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
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
    defaults: dict[str, Any] = field(default_factory=dict)  # its transformers config class's, where they differ

    def complete(self, cfg: dict) -> dict:
        """`cfg` with this family's defaults for the fields it leaves out (as its config class fills them; an
        explicit null stays: Mistral v0.2+ writes `"sliding_window": null` for no window)."""
        return {**self.defaults, **cfg}


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
ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor",
                 "high_freq_factor"), "longrope": ("short_factor", "long_factor")}
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
        Family("llama", "LlamaForCausalLM", "Llama 2 / 3.x and Llama-architecture models", _llama,
               {"max_position_embeddings": 2048}),
        Family("qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5", _qwen2, {"max_position_embeddings": 32768}),
        Family("qwen3", "Qwen3ForCausalLM", "Qwen3 (dense)", _qwen3,
               {"max_position_embeddings": 32768, "head_dim": 128}),
        Family("mistral", "MistralForCausalLM", "Mistral", _mistral,
               {"max_position_embeddings": 131072, "sliding_window": 4096}),
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
    for key in ROPE_REQUIRED.get(params["rope_type"], ()):
        if params.get(key) is None:
            raise UnsupportedCheckpoint(f"{field}.{key}", None, f"rope_type {params['rope_type']} needs it")
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


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    import torch

    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _yarn(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    import torch

    base, factor = params["rope_theta"], params.get("factor")
    original = params["original_max_position_embeddings"]
    factor = factor if factor is not None else max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _longrope(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """The short factors: the static table serves positions up to original_max_position_embeddings, where
    transformers switches to the long ones for the whole sequence (exact_context)."""
    import torch

    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short = torch.tensor(params["short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (short * params["rope_theta"] ** shape), attention_factor


def _llama3(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    import torch

    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor, low_factor, high_factor = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low_factor, old_context / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _dynamic(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Dynamic NTK keeps the base up to max_position_embeddings (all the runtimes serve): its base multiplier
    `(factor * seq_len / max_position_embeddings - (factor - 1)) ** (dim / (dim - 2))` is 1 there."""
    return _base_inv_freq(params["rope_theta"], dim), 1.0


ROPE_FUNCTIONS: dict[str, Callable[[dict[str, Any], int, int], tuple[torch.Tensor, float]]] = {
    "default": lambda params, dim, _: (_base_inv_freq(params["rope_theta"], dim), 1.0),
    "linear": lambda params, dim, _: (_base_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0),
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
}
assert set(ROPE_FUNCTIONS) == set(ROPE_TYPES)


def rope_tables(head_dim: int, max_position_embeddings: int, params: dict[str, Any],
                positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin [positions, head_dim] of the rotary embedding, as transformers' rotary modules compute
    them per position (its inverse frequencies, attention scaling applied to cos and sin)."""
    import torch

    inv_freq, attention_scaling = ROPE_FUNCTIONS[params["rope_type"]](params, head_dim, max_position_embeddings)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling
