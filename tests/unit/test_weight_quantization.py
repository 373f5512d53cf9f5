"""A drafter served with 8-bit weights (onnxruntime MatMulNBits): made once from the fp32 export, close to it,
and lossless where it matters (greedy speculation with it equals plain decoding); the target and the other
runtimes refuse it."""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx_ir")

from specdec.config import SpeculationSettings  # noqa: E402
from specdec.engines import DraftEngine, TargetEngine  # noqa: E402
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator  # noqa: E402
from specdec.inprocess import InProcessBackend  # noqa: E402
from specdec.runtime import build_runtime, check_weight_quantization, choose_weights  # noqa: E402
from specdec.runtime.base import ForwardItem  # noqa: E402
from specdec.runtime.graph_contract import ONNX_FILE, read_graph_metadata  # noqa: E402
from specdec.runtime.onnx_llama import OnnxLlamaRuntime, onnx_file, resolve_onnx  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "build"))

import render_configs  # noqa: E402

PROMPT = [5, 17, 42, 8, 66, 3, 91, 12, 7, 30, 44, 10, 20]
MAX_LENGTH = 96


def op_types(onnx_path: Path) -> set[str]:
    import onnx

    return {node.op_type for node in onnx.load(str(onnx_path), load_external_data=False).graph.node}


def test_the_quantized_graph_is_made_once_beside_the_fp32_export(tiny_eagle, tmp_path):
    path = resolve_onnx(tiny_eagle, tmp_path, weight_quantization="int8")
    assert path == tmp_path / onnx_file("int8") and (tmp_path / ONNX_FILE).is_file()
    assert read_graph_metadata(path)["weight_quantization"] == "int8"
    ops = op_types(path)
    assert "MatMulNBits" in ops
    made = path.stat().st_mtime_ns
    assert resolve_onnx(tiny_eagle, tmp_path, weight_quantization="int8") == path
    assert path.stat().st_mtime_ns == made  # current: reused, not quantized again
    assert resolve_onnx(tiny_eagle, tmp_path) == tmp_path / ONNX_FILE  # the fp32 graph is still served as it was
    assert "MatMulNBits" not in op_types(tmp_path / ONNX_FILE)


def test_int8_weights_stay_close_to_fp32(fused_eagle, tmp_path):
    """The fused head's fusion layer too: an embedding beside unit-RMS feature blocks of a larger scale."""
    target_dir, head_dir = fused_eagle
    target = OnnxLlamaRuntime(target_dir, num_slots=1, max_length=MAX_LENGTH, engine_dir=tmp_path / "target")
    features = target.forward_outputs([ForwardItem(0, 0, np.asarray(PROMPT), num_hidden=len(PROMPT))])[0].hidden
    item = [ForwardItem(0, 0, np.asarray(PROMPT[1:]), num_logits=len(PROMPT) - 1, features=features[:-1])]
    full, int8 = (OnnxLlamaRuntime(head_dir, num_slots=1, max_length=MAX_LENGTH, engine_dir=tmp_path / "head",
                                   weight_quantization=q).forward_outputs(item)[0].logits for q in (None, "int8"))
    finite = np.isfinite(full)
    assert np.array_equal(finite, np.isfinite(int8))  # the proposal vocabulary is kept
    error = np.abs(int8[finite] - full[finite]).max() / np.abs(full[finite]).max()
    agreement = np.mean(int8.argmax(-1) == full.argmax(-1))
    print(f"relative error {error:.3f}, top-1 agreement {agreement:.3f}")
    assert error < 0.1 and agreement >= 0.9, (error, agreement)


@pytest.mark.parametrize("drafter_kind", ["draft", "eagle"])
def test_greedy_speculation_with_an_int8_drafter_equals_plain(tiny_pair, tiny_eagle, tmp_path, drafter_kind):
    def runtime(folder: Path, name: str, quantization: str | None = None):
        return build_runtime("onnxruntime", folder, num_slots=2, max_length=MAX_LENGTH, num_threads=1,
                             engine_dir=tmp_path / name, weight_quantization=quantization)

    target = TargetEngine(runtime(tiny_pair[0], "target"), idle_timeout_s=60)
    drafter = DraftEngine(runtime(tiny_eagle if drafter_kind == "eagle" else tiny_pair[1], drafter_kind, "int8"),
                          idle_timeout_s=60)
    backend = (InProcessBackend(target, None, drafter) if drafter_kind == "eagle"
               else InProcessBackend(target, drafter))
    name = "eagle" if drafter_kind == "eagle" else "model"

    def generate(k: int, stats: GenerationStats) -> list[int]:
        settings = SpeculationSettings("text", name, k, k, 1, "greedy", 0.7, explicit_length=True)

        async def run() -> list[int]:
            out: list[int] = []
            request = GenerationRequest(PROMPT, 40, settings=settings)
            async for update in SpeculativeGenerator(backend, MAX_LENGTH).generate(request, 1, stats):
                out.extend(update.token_ids)
            return out

        return asyncio.run(run())

    plain = generate(0, GenerationStats())
    stats = GenerationStats()
    assert generate(3, stats) == plain and len(plain) == 40
    assert stats.draft_failures == 0 and stats.draft_calls > 0


def test_only_a_drafter_on_onnxruntime_can_be_quantized(tiny_pair):
    check_weight_quantization("eagle", "onnxruntime", "int8")
    check_weight_quantization("target", "onnxruntime", None)
    with pytest.raises(ValueError, match="drafters only"):
        check_weight_quantization("target", "onnxruntime", "int8")
    with pytest.raises(ValueError, match="onnxruntime option"):
        check_weight_quantization("draft", "tensorrt", "int8")
    check_weight_quantization("target", "onnxruntime", "gguf")  # its own precision
    with pytest.raises(ValueError, match="one of int8"):
        check_weight_quantization("draft", "onnxruntime", "int4")
    with pytest.raises(ValueError, match="onnxruntime option"):
        build_runtime("torch", tiny_pair[1], num_slots=1, max_length=16, weight_quantization="int8")


def test_auto_serves_a_checkpoint_at_its_own_precision(tiny_pair):
    """auto (the default): a folder converted from a GGUF file that is still there is served from its blocks;
    any other checkpoint as exported. `none` keeps the export; `gguf` without a file behind it is an error."""
    target = tiny_pair[0]
    assert choose_weights("target", "onnxruntime", None, target)[0] is None
    assert choose_weights("target", "onnxruntime", "none", target)[0] is None
    assert choose_weights("eagle", "onnxruntime", "int8", target)[0] == "int8"
    with pytest.raises(ValueError, match="not converted from a GGUF file"):
        choose_weights("target", "onnxruntime", "gguf", target)


def test_auto_serves_the_export_when_the_gguf_blocks_cannot_be_made(tiny_pair, tmp_path):
    """A folder that names a GGUF file the graph cannot be made from (here: not a GGUF file at all) is served from its
    export under `auto`, and says why; asking for `gguf` explicitly is an error."""
    import json
    import shutil

    from specdec.runtime import build_served_runtime
    from specdec.runtime.gguf_blocks import GGUF_SOURCE_FILE, source_record

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"not a gguf file")
    (target / GGUF_SOURCE_FILE).write_text(json.dumps({**source_record(damaged), "dtype": "float32"}))
    options = {"num_slots": 1, "max_length": 32, "engine_dir": tmp_path / "onnx"}
    runtime, quantization, why = build_served_runtime("onnxruntime", target, "target", None, **options)
    assert quantization is None and "failed" in why and runtime.onnx_path.name == ONNX_FILE
    with pytest.raises(ValueError, match="GGUF magic"):
        build_served_runtime("onnxruntime", target, "target", "gguf", **options)


def test_a_deployment_quantizing_its_target_does_not_render():
    deployment = yaml.safe_load((REPO / "build/deployments/cpu.yaml").read_text())
    rendered = render_configs.render(deployment)
    assert rendered["eagle_draft"].parameters["weight_quantization"].string_value == "int8"
    assert rendered["target_model"].parameters["weight_quantization"].string_value == "auto"
    bad = copy.deepcopy(deployment)
    bad["models"]["target_model"]["weight_quantization"] = "int8"
    with pytest.raises(ValueError, match="drafters only"):
        render_configs.render(bad)
