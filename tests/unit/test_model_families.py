"""Model families (specdec.families): Llama 3.x, Qwen2/2.5, Qwen3 and Mistral checkpoints in every runtime.

For each family, a tiny random checkpoint built from its transformers config (tests/family_checkpoints.py):
the torch runtime's greedy output equals Hugging Face `generate(do_sample=False)`, including verification-
style multi-token steps and a tree step; the ONNX export matches torch and HF (onnxruntime); Mistral's prompts
run past its sliding window. Each family's difference is shown to matter (the reference moves without it),
so a runtime ignoring it would fail. Rotary tables of every HF rope type equal transformers' own rotary
module; unsupported configs fail with an error naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/family_checkpoints.py

from family_checkpoints import (  # noqa: E402
    EXTRA_EOS,
    FAMILIES,
    LLAMA3_ROPE,
    SLIDING_WINDOW,
    VOCAB_SIZE,
    hf_greedy,
    hf_model,
    make_family_checkpoint,
)
from specdec.checkpoint import ModelSpec, UnsupportedCheckpoint, read_spec  # noqa: E402
from specdec.runtime.base import ForwardItem  # noqa: E402
from specdec.runtime.parity import logit_parity  # noqa: E402
from specdec.runtime.torch_llama import TorchLlamaRuntime  # noqa: E402

PROMPT = [int(t) for t in np.random.default_rng(7).integers(4, VOCAB_SIZE, 20)]  # 20 > SLIDING_WINDOW
NEW_TOKENS = 24
MAX_LENGTH = 64
LOGIT_ATOL = 2e-3
assert len(PROMPT) > 2 * SLIDING_WINDOW


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_checkpoint(root / family, family, num_layers=2, seed=11 + i)
            for i, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list[int]]:
    return {family: hf_greedy(path, PROMPT, NEW_TOKENS) for family, path in checkpoints.items()}


def hf_logits(path: Path, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0].numpy()


def greedy(runtime, prompt: list[int], steps: int, slot: int = 0) -> list[int]:
    """Greedy decoding: a prefill, then one token per step."""
    logits = runtime.forward([ForwardItem(slot, 0, np.asarray(prompt))])[0]
    tokens = list(prompt) + [int(logits[-1].argmax())]
    while len(tokens) - len(prompt) < steps:
        logits = runtime.forward([ForwardItem(slot, len(tokens) - 1, np.asarray(tokens[-1:]))])[0]
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) : len(prompt) + steps]


def verify_in_chunks(runtime, prompt: list[int], continuation: list[int], chunk: int) -> list[int]:
    """Score `continuation` the way a target verifies drafts: k+1 tokens per call, all their logits."""
    logits = runtime.forward([ForwardItem(0, 0, np.asarray(prompt))])[0]
    predicted = [int(logits[-1].argmax())]
    context = list(prompt)
    for start in range(0, len(continuation) - 1, chunk):
        block = continuation[start : start + chunk]
        out = runtime.forward([ForwardItem(0, len(context), np.asarray(block), num_logits=len(block))])[0]
        predicted += [int(row.argmax()) for row in out]
        context += block
    return predicted[: len(continuation)]


# ---- specs ----

def test_specs_read_each_familys_traits(checkpoints):
    specs = {family: read_spec(path) for family, path in checkpoints.items()}
    llama, qwen2, qwen3, mistral = (specs[f] for f in FAMILIES)
    assert llama.family == "llama" and llama.rope_parameters["rope_type"] == "llama3"
    assert llama.eos_token_ids == (1, EXTRA_EOS) and not llama.tie_word_embeddings
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False) and qwen2.tie_word_embeddings
    assert qwen3.qk_norm and qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_heads
    assert mistral.sliding_window == SLIDING_WINDOW and not mistral.qkv_bias
    assert all(spec.sliding_window is None for spec in (llama, qwen2, qwen3))


def test_end_ids_are_the_ones_hugging_face_generate_stops_at(tmp_path):
    from specdec.checkpoint import read_end_ids
    from specdec.tokenizer import TextTokenizer

    path = make_family_checkpoint(tmp_path / "llama3", "llama3", num_layers=1, seed=4, tokenizer=True)
    assert read_end_ids(path) == TextTokenizer(path).end_ids == {1, EXTRA_EOS}  # saved to generation_config
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [1, 5, 9]}))
    assert TextTokenizer(path).end_ids == {1, 5, 9}  # instruct models list more ids there than in config.json
    (path / "generation_config.json").unlink()
    assert read_end_ids(path) == {1, EXTRA_EOS}


def config_of(**changes) -> dict:
    base = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 32}
    return {**base, **changes}


@pytest.mark.parametrize(("changes", "field", "value"), [
    ({"model_type": "gemma2"}, "model_type", "gemma2"),
    ({"model_type": None, "architectures": ["PhiForCausalLM"]}, "architectures", ["PhiForCausalLM"]),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act", "gelu_pytorch_tanh"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_parameters.rope_type", "mrope"),
    ({"rope_scaling": {"type": "su"}}, "rope_scaling.rope_type", "su"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.low_freq_factor", None),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor", 0.5),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, "num_key_value_heads", 3),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     "layer_types", ["full_attention", "sliding_attention"]),
    ({"model_type": "mistral", "layer_types": ["sliding_attention", "full_attention"]},
     "layer_types", ["sliding_attention", "full_attention"]),
])
def test_unsupported_configs_name_the_field_and_value(changes, field, value):
    cfg = {key: val for key, val in config_of(**changes).items() if val is not None}
    with pytest.raises(UnsupportedCheckpoint) as error:
        ModelSpec.from_config(cfg)
    assert error.value.field == field and error.value.value == value
    assert f"config.json {field} = {value!r}" in str(error.value)


def test_supported_variants_are_accepted():
    whole_window = ModelSpec.from_config(config_of(model_type="qwen2", use_sliding_window=True, sliding_window=16,
                                                   max_window_layers=0))
    assert whole_window.sliding_window == 16 and whole_window.qkv_bias
    assert ModelSpec.from_config(config_of(model_type="mistral", sliding_window=None)).sliding_window is None
    legacy = ModelSpec.from_config(config_of(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    assert legacy.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    assert ModelSpec.from_config(config_of(model_type=None, architectures=["LlamaForCausalLM"])).family == "llama"
    biased = ModelSpec.from_config(config_of(attention_bias=True, mlp_bias=True))
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (True, True, True)


@pytest.mark.parametrize("family", FAMILIES)
def test_fields_a_config_leaves_out_get_its_config_classs_defaults(family):
    from transformers import AutoConfig

    essentials = {"vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 32}
    model_type = "llama" if family == "llama3" else family
    spec = ModelSpec.from_config({"model_type": model_type, **essentials})
    reference = AutoConfig.for_model(model_type, **essentials)
    assert spec.max_position_embeddings == reference.max_position_embeddings
    assert spec.head_dim == (getattr(reference, "head_dim", None) or 64 // 4)
    assert spec.sliding_window == (reference.sliding_window if model_type == "mistral" else None)
    assert spec.tie_word_embeddings == reference.tie_word_embeddings
    assert spec.rms_norm_eps == reference.rms_norm_eps
    assert spec.rope_theta == reference.rope_parameters["rope_theta"]


def test_the_onnx_export_refuses_an_unsupported_checkpoint_before_exporting(tmp_path):
    from specdec.runtime.step_graph import export_decoder

    (tmp_path / "config.json").write_text(json.dumps(config_of(model_type="gemma2")))
    with pytest.raises(UnsupportedCheckpoint, match="model_type"):
        export_decoder(tmp_path, tmp_path / "decoder.onnx")
    assert not (tmp_path / "decoder.onnx").exists()


# ---- rotary tables (specdec.families' port of transformers' rope functions) ----

ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]},
    "llama3": dict(LLAMA3_ROPE),
}


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_rope_tables_equal_transformers_rotary_embedding(rope_type):
    from specdec.families import ROPE_FUNCTIONS
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_theta": 10000.0, **ROPE_CASES[rope_type]}
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                         rope_parameters=dict(params))
    spec = ModelSpec.from_config({**config.to_dict(), "model_type": "llama"})
    assert spec.rope_parameters["rope_type"] == rope_type
    positions = spec.context_limit  # longrope: up to original_max_position_embeddings, where it switches
    assert positions == (64 if rope_type == "longrope" else 256)
    cos, sin = spec.rope_tables(positions)
    rotary = LlamaRotaryEmbedding(config)
    # The port's inverse frequencies and attention scaling are transformers' own, bit for bit.
    hf_init = ROPE_INIT_FUNCTIONS.get(rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters)
    hf_inv_freq, hf_scaling = hf_init(config)
    inv_freq, scaling = ROPE_FUNCTIONS[rope_type](spec.rope_parameters, spec.head_dim, spec.max_position_embeddings)
    assert torch.equal(inv_freq, hf_inv_freq) and scaling == hf_scaling
    expected_cos, expected_sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    torch.testing.assert_close(cos, expected_cos[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, expected_sin[0], atol=1e-6, rtol=1e-6)
    if rope_type not in ("default", "dynamic"):  # dynamic equals default below max_position_embeddings
        default_cos, _ = ModelSpec.from_config({**config.to_dict(), "rope_parameters": {"rope_theta": 1e4}}
                                               ).rope_tables(positions)
        assert not torch.allclose(cos, default_cos, atol=1e-3)


def test_runtimes_serve_longrope_only_up_to_where_it_switches():
    cfg = config_of(max_position_embeddings=512, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 128,
        "short_factor": [1.0] * 4, "long_factor": [4.0] * 4})
    spec = ModelSpec.from_config(cfg)
    assert spec.context_limit == 128
    assert spec.served_length(None) == spec.served_length(4096) == 128 and spec.served_length(64) == 64


# ---- each family's difference matters ----

def neutralized(path: Path, family: str, tmp_path: Path) -> Path:
    """The same checkpoint without its family's difference: biases zeroed, q/k norms set to one, default
    rope, no window. A runtime ignoring the difference would compute this model instead."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / f"{family}-neutral"
    out.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    if family == "llama3":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    elif family == "mistral":
        cfg["sliding_window"] = None
    for name in state:
        if name.endswith("_proj.bias"):
            state[name] = torch.zeros_like(state[name])
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            state[name] = torch.ones_like(state[name])
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_difference_changes_the_reference(checkpoints, family, tmp_path):
    path = checkpoints[family]
    neutral = neutralized(path, family, tmp_path)
    # The prompt is longer than Mistral's window and than llama3's original context's high-frequency band.
    diff = np.abs(hf_logits(path, PROMPT) - hf_logits(neutral, PROMPT))[-8:].max()
    assert diff > 0.5, (family, diff)
    runtime = TorchLlamaRuntime(neutral, num_slots=1, max_length=MAX_LENGTH)
    got = runtime.forward([ForwardItem(0, 0, np.asarray(PROMPT), num_logits=8)])[0]
    np.testing.assert_allclose(got, hf_logits(neutral, PROMPT)[-8:], atol=1e-4, rtol=1e-4)


# ---- torch runtime ----

@pytest.mark.parametrize("family", FAMILIES)
def test_torch_greedy_equals_hugging_face_generate(checkpoints, references, family):
    runtime = TorchLlamaRuntime(checkpoints[family], num_slots=2, max_length=MAX_LENGTH)
    assert greedy(runtime, PROMPT, NEW_TOKENS, slot=1) == references[family]
    # Verification passes of 4 and 7 tokens predict the same continuation.
    for chunk in (4, 7):
        assert verify_in_chunks(runtime, PROMPT, references[family], chunk) == references[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_logits_match_hf_after_a_committed_tree_path(checkpoints, family):
    """Tree nodes sit at cache rows past their positions: the rotation and (Mistral) the window must follow
    positions. After committing a path the next step equals HF on the path's tokens."""
    runtime = TorchLlamaRuntime(checkpoints[family], num_slots=1, max_length=MAX_LENGTH)
    runtime.forward([ForwardItem(0, 0, np.asarray(PROMPT))])
    past = len(PROMPT)
    tree = np.asarray([40, 41, 42, 43, 44])
    parents = np.array([-1, 0, 0, 2, 3])  # 40 -> {41, 42}, 42 -> 43 -> 44
    out = runtime.forward([ForwardItem(0, past, tree, num_logits=5, tree_parents=parents)])[0]
    np.testing.assert_allclose(out[4], hf_logits(checkpoints[family], PROMPT + [40, 42, 43, 44])[-1], atol=1e-4,
                               rtol=1e-4)
    np.testing.assert_allclose(out[1], hf_logits(checkpoints[family], PROMPT + [40, 41])[-1], atol=1e-4, rtol=1e-4)
    runtime.move_rows(0, past + np.array([0, 2, 3, 4]), past)
    nxt = runtime.forward([ForwardItem(0, past + 4, np.asarray([45]))])[0]
    np.testing.assert_allclose(nxt[0], hf_logits(checkpoints[family], PROMPT + [40, 42, 43, 44, 45])[-1],
                               atol=1e-4, rtol=1e-4)


def test_mistral_window_follows_positions_in_a_batch_of_different_lengths(checkpoints):
    path = checkpoints["mistral"]
    runtime = TorchLlamaRuntime(path, num_slots=2, max_length=MAX_LENGTH)
    short = PROMPT[:5]
    out = runtime.forward([ForwardItem(0, 0, np.asarray(PROMPT), num_logits=len(PROMPT)),
                           ForwardItem(1, 0, np.asarray(short), num_logits=len(short))])
    np.testing.assert_allclose(out[0], hf_logits(path, PROMPT), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out[1], hf_logits(path, short), atol=1e-4, rtol=1e-4)


# ---- ONNX export (onnxruntime) ----

@pytest.fixture(scope="module")
def onnx_runtimes(checkpoints, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    from specdec.runtime.onnx_llama import OnnxLlamaRuntime

    root = tmp_path_factory.mktemp("family_onnx")
    return {family: OnnxLlamaRuntime(path, num_slots=2, max_length=MAX_LENGTH, engine_dir=root / family)
            for family, path in checkpoints.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_matches_torch_and_hugging_face(checkpoints, references, onnx_runtimes, family):
    onnx_runtime = onnx_runtimes[family]
    torch_runtime = TorchLlamaRuntime(checkpoints[family], num_slots=2, max_length=MAX_LENGTH)
    items = [ForwardItem(0, 0, np.asarray(PROMPT), num_logits=len(PROMPT)),
             ForwardItem(1, 0, np.asarray(PROMPT[:9]), num_logits=9)]
    for expected, got in zip(torch_runtime.forward(items), onnx_runtime.forward(items), strict=True):
        diff, agreement = logit_parity(expected, got)
        assert diff < LOGIT_ATOL and agreement == 1.0, (family, diff, agreement)
    tree = ForwardItem(0, len(PROMPT), np.asarray([40, 41, 42, 43, 44]), num_logits=5,
                       tree_parents=np.array([-1, 0, 0, 2, 3]))
    diff, agreement = logit_parity(torch_runtime.forward([tree])[0], onnx_runtime.forward([tree])[0])
    assert diff < LOGIT_ATOL and agreement == 1.0, (family, diff, agreement)
    assert greedy(onnx_runtime, PROMPT, NEW_TOKENS, slot=1) == references[family]
    assert verify_in_chunks(onnx_runtime, PROMPT, references[family], 5) == references[family]


def test_onnx_graph_records_the_family_in_its_metadata(checkpoints, onnx_runtimes):
    from specdec.runtime.graph_contract import read_graph_metadata

    spec = json.loads(read_graph_metadata(onnx_runtimes["qwen3"].onnx_path)["spec"])
    assert spec == json.loads(json.dumps(dataclasses.asdict(read_spec(checkpoints["qwen3"]))))
    assert spec["family"] == "qwen3" and spec["qk_norm"]


# ---- TensorRT (build/build_engines.py), where tensorrt and a CUDA GPU are present ----

def test_engine_build_refuses_an_unsupported_checkpoint_before_building(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))
    import build_engines

    repo = tmp_path / "repo"
    for name in ("target_model", "draft_model"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "config.json").write_text(json.dumps(config_of(hidden_act="relu")))
    deployment = Path(__file__).resolve().parents[2] / "build" / "deployments" / "gpu.yaml"
    with pytest.raises(SystemExit, match=r"target_model: .*config.json hidden_act = 'relu'"):
        build_engines.main(["--deployment", str(deployment), "--model-repository", str(repo), "--output-dir",
                            str(tmp_path / "engines"), "--dry-run"])
    assert not (tmp_path / "engines").exists()


def tensorrt_missing() -> str | None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the `tensorrt` package is not installed"
    return None if torch.cuda.is_available() else "no CUDA GPU visible to torch"


@pytest.mark.skipif(tensorrt_missing() is not None, reason=str(tensorrt_missing()))
@pytest.mark.parametrize("family", FAMILIES)
def test_tensorrt_engine_matches_torch_and_hugging_face(checkpoints, references, family, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))
    import build_engines
    from specdec.runtime import build_runtime
    from specdec.runtime.tensorrt_llama import compute_profiles

    plan = build_engines.EnginePlan(
        model="target_model", role="target", checkpoint=checkpoints[family], output=tmp_path, precision="fp32",
        num_slots=2, max_length=MAX_LENGTH, profiles=compute_profiles("target", 2, MAX_LENGTH, 4, 2, 3, 32),
        workspace_gib=1.0, optimization_level=2,
    )
    build_engines.build_one(plan)
    engine = build_runtime("tensorrt", checkpoints[family], num_slots=2, max_length=MAX_LENGTH, device="cuda",
                           engine_dir=tmp_path)
    reference = TorchLlamaRuntime(checkpoints[family], num_slots=2, max_length=MAX_LENGTH, device="cuda")
    tree = ForwardItem(0, len(PROMPT), np.asarray([40, 41, 42, 43, 44]), num_logits=5,
                       tree_parents=np.array([-1, 0, 0, 2, 3]))
    for items in ([ForwardItem(0, 0, np.asarray(PROMPT), num_logits=len(PROMPT))], [tree]):
        diff, agreement = logit_parity(np.concatenate(reference.forward(items)), np.concatenate(engine.forward(items)))
        assert diff < 1e-2 and agreement == 1.0, (family, diff, agreement)
    assert greedy(engine, PROMPT, NEW_TOKENS, slot=1) == references[family]


def test_export_script_names_the_unsupported_field_and_writes_nothing(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))
    import export_onnx

    bad = tmp_path / "gemma"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config_of(model_type="gemma2")))
    assert export_onnx.main(["--checkpoint", str(bad), "--out", str(tmp_path / "out.onnx")]) == 2
    assert "config.json model_type = 'gemma2'" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()
    qwen3 = make_family_checkpoint(tmp_path / "qwen3", "qwen3", num_layers=1, seed=3, tokenizer=True)
    assert export_onnx.main(["--checkpoint", str(qwen3), "--out", str(tmp_path / "q.onnx"), "--check"]) == 0
    printed = capsys.readouterr().out
    assert "(qwen3, float32" in printed and "argmax agreement 1.000" in printed
