"""The ONNX export of the decoder step matches torch, run by onnxruntime on the CPU.

On real prompts with the committed model pair and on the random tiny pair: max |logit difference| and
argmax agreement of every position, incremental steps, a tree-mask step, and 64 greedy tokens identical
to the torch runtime (and to Hugging Face for the tiny pair). Also: the graph's interface (names, dynamic
axes, metadata) and the fp16 / bf16 exports that TensorRT builds from.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from specdec.checkpoint import read_spec  # noqa: E402
from specdec.runtime.base import ForwardItem  # noqa: E402
from specdec.runtime.graph_contract import (  # noqa: E402
    OUTPUTS,
    checkpoint_fingerprint,
    dynamic_axes,
    graph_inputs,
    read_graph_metadata,
)
from specdec.runtime.onnx_llama import OnnxLlamaRuntime, export_is_current  # noqa: E402
from specdec.runtime.parity import logit_parity  # noqa: E402
from specdec.runtime.step_graph import example_inputs, export_decoder  # noqa: E402
from specdec.runtime.torch_llama import TorchLlamaRuntime  # noqa: E402
from specdec.tokenizer import TextTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAIR = {role: REPO / "tests" / "fixtures" / "pair_12m" / role for role in ("target", "draft")}
PROMPTS = json.loads((REPO / "client" / "specdec_client" / "prompts" / "smoke.json").read_text())
MAX_LENGTH = 160
LOGIT_ATOL = 2e-3  # fp32 graph vs fp32 torch: observed differences are ~1e-5


def real_prompts() -> list[list[int]]:
    tokenizer = TextTokenizer(PAIR["target"])
    return [tokenizer.encode(PROMPTS[task][0]) for task in ("json", "code", "text") if task in PROMPTS]


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> dict[str, tuple[TorchLlamaRuntime, OnnxLlamaRuntime]]:
    root = tmp_path_factory.mktemp("onnx_committed")
    return {
        role: (TorchLlamaRuntime(path, num_slots=2, max_length=MAX_LENGTH, num_threads=1),
               OnnxLlamaRuntime(path, num_slots=2, max_length=MAX_LENGTH, engine_dir=root / role))
        for role, path in PAIR.items()
    }


def compare(expected: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, float]:
    """(max |difference|, argmax agreement) over all returned rows."""
    return logit_parity(np.concatenate(expected), np.concatenate(got))


def both(pair: tuple, items: list[ForwardItem]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    return pair[0].forward(items), pair[1].forward(items)


def greedy(runtime, prompt: list[int], steps: int, slot: int = 0, tree_at: int | None = None) -> list[int]:
    """Greedy decoding step by step; at step `tree_at`, the step is a tree whose first branch is the greedy
    continuation (so the output is unchanged if the tree scores like a chain) and its path is committed."""
    logits = runtime.forward([ForwardItem(slot, 0, np.asarray(prompt))])[0]
    tokens = list(prompt) + [int(logits[-1].argmax())]
    while len(tokens) - len(prompt) < steps:
        past = len(tokens) - 1
        if tree_at is not None and len(tokens) - len(prompt) == tree_at:
            # root = last token; children: the greedy next token (unknown yet, so score the root first) ...
            nxt = int(runtime.forward([ForwardItem(slot, past, np.asarray(tokens[-1:]))])[0][-1].argmax())
            # tree: root r, its children (nxt, decoy), nxt's child decoy2: rows past.. hold r, nxt, decoy, decoy2
            decoy = (nxt + 1) % runtime.vocab_size
            tree = np.asarray([tokens[-1], nxt, decoy, decoy])
            parents = np.array([-1, 0, 0, 1])
            out = runtime.forward([ForwardItem(slot, past, tree, num_logits=4, tree_parents=parents)])[0]
            assert int(out[0].argmax()) == nxt
            tokens.append(nxt)
            runtime.move_rows(slot, np.array([past, past + 1]), past)  # keep the path r -> nxt
            tokens.append(int(out[1].argmax()))  # the token after nxt, scored inside the tree
            continue
        logits = runtime.forward([ForwardItem(slot, past, np.asarray(tokens[-1:]))])[0]
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt) : len(prompt) + steps]


def test_graph_interface_and_metadata(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    path = export_decoder(target_dir, tmp_path / "decoder.onnx")
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == list(graph_inputs(read_spec(target_dir)))
    assert [o.name for o in model.graph.output] == list(OUTPUTS)
    for value in list(model.graph.input) + list(model.graph.output):
        dims = value.type.tensor_type.shape.dim
        for axis, name in dynamic_axes(value.name).items():
            assert dims[axis].dim_param == name, (value.name, axis)
    meta = read_graph_metadata(path)
    assert meta["checkpoint_fingerprint"] == checkpoint_fingerprint(target_dir)
    assert meta["dtype"] == "float32"
    assert export_is_current(path, target_dir, "float32")
    assert not export_is_current(path, target_dir, "float16")


def test_dynamic_axes_accept_other_sizes(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    spec = read_spec(target_dir)
    path = export_decoder(target_dir, tmp_path / "d.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, width, past in ((1, 1, 1), (4, 9, 30), (3, 2, 7)):
        feeds = dict(zip(graph_inputs(spec), (t.numpy() for t in example_inputs(spec, torch.float32, batch, width,
                                                                                      past)), strict=True))
        logits, new_keys, new_values, hidden = session.run(None, feeds)
        assert logits.shape == (batch * width - 1, spec.vocab_size)
        assert new_keys.shape == new_values.shape == (spec.num_layers, spec.num_kv_heads, batch, width, spec.head_dim)
        assert hidden.shape == (batch * width, spec.hidden_size)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_real_prompts_prefill_and_steps_match_torch(committed, role):
    pair = committed[role]
    prompts = real_prompts()
    assert len(prompts) >= 2
    # All prompts in one padded prefill (every position's logits), in different slots.
    items = [ForwardItem(i % 2, 0, np.asarray(p), num_logits=len(p)) for i, p in enumerate(prompts[:2])]
    diff, agree = compare(*both(pair, items))
    assert diff < LOGIT_ATOL and agree == 1.0, (diff, agree)
    # Incremental steps of both sequences, batched together.
    lengths = [len(p) for p in prompts[:2]]
    for step in range(5):
        items = [ForwardItem(i, lengths[i] + step, np.array([10 + 7 * step + i])) for i in range(2)]
        diff, agree = compare(*both(pair, items))
        assert diff < LOGIT_ATOL and agree == 1.0, (step, diff, agree)


def test_tree_mask_step_matches_torch(committed):
    pair = committed["target"]
    prompt = real_prompts()[1]
    both(pair, [ForwardItem(0, 0, np.asarray(prompt))])
    tree = ForwardItem(0, len(prompt), np.array([101, 102, 103, 104, 105, 106]), num_logits=6,
                       tree_parents=np.array([-1, 0, 0, 1, 2, 4]))
    diff, agree = compare(*both(pair, [tree]))
    assert diff < LOGIT_ATOL and agree == 1.0, (diff, agree)
    # Commit the path 101 -> 103 -> 105 -> 106 and continue: still equal.
    for runtime in pair:
        runtime.move_rows(0, len(prompt) + np.array([0, 2, 4, 5]), len(prompt))
    diff, agree = compare(*both(pair, [ForwardItem(0, len(prompt) + 4, np.array([7]))]))
    assert diff < LOGIT_ATOL and agree == 1.0, (diff, agree)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_greedy_64_tokens_identical_with_a_tree_step(committed, role):
    torch_rt, onnx_rt = committed[role]
    for prompt in real_prompts():
        expected = greedy(torch_rt, prompt, 64, tree_at=20)
        assert greedy(onnx_rt, prompt, 64, tree_at=20) == expected
        assert greedy(onnx_rt, prompt, 64) == expected  # the tree step changed nothing


def test_tiny_pair_greedy_equals_hugging_face(tiny_pair, tmp_path):
    from transformers import LlamaForCausalLM

    target_dir, _ = tiny_pair
    prompt = [5, 17, 42, 8, 66, 3]
    runtime = OnnxLlamaRuntime(target_dir, num_slots=1, max_length=128, engine_dir=tmp_path)
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                            pad_token_id=2)[0, len(prompt):].tolist()
    assert greedy(runtime, prompt, 64, tree_at=10) == hf


def test_fp16_export_runs_close_and_bf16_export_is_valid(tiny_pair, tmp_path):
    """The low-precision graphs TensorRT builds from: fp16 runs on onnxruntime's CPU kernels, bf16 does not
    (no CPU kernels), so it is checked structurally."""
    target_dir, _ = tiny_pair
    spec = read_spec(target_dir)
    feeds32 = [t.numpy() for t in example_inputs(spec, torch.float32, 2, 5, 4)]
    ref = ort.InferenceSession(str(export_decoder(target_dir, tmp_path / "f32.onnx")), providers=[
        "CPUExecutionProvider"]).run(None, dict(zip(graph_inputs(spec), feeds32, strict=True)))
    half = ort.InferenceSession(str(export_decoder(target_dir, tmp_path / "f16.onnx", dtype="float16")),
                                providers=["CPUExecutionProvider"])
    feeds16 = [f.astype(np.float16) if f.dtype == np.float32 else f for f in feeds32]
    logits16, keys16, _, hidden16 = half.run(None, dict(zip(graph_inputs(spec), feeds16, strict=True)))
    assert logits16.dtype == hidden16.dtype == np.float32 and keys16.dtype == np.float16
    scale = np.abs(ref[0]).max()
    assert np.abs(logits16 - ref[0]).max() < 0.05 * scale
    assert (logits16.argmax(-1) == ref[0].argmax(-1)).mean() >= 0.9
    bf16 = onnx.load(str(export_decoder(target_dir, tmp_path / "bf16.onnx", dtype="bfloat16")))
    onnx.checker.check_model(bf16, full_check=True)
    types = {v.name: v.type.tensor_type.elem_type for v in list(bf16.graph.input) + list(bf16.graph.output)}
    assert types["past_keys_0"] == types["new_values"] == onnx.TensorProto.BFLOAT16
    assert types["logits"] == onnx.TensorProto.FLOAT
