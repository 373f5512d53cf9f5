"""A GGUF checkpoint served from its own blocks (specdec.runtime.gguf_blocks): each block type read exactly,
and a graph exported from a bf16 conversion turned back into the file's blocks and exact values."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from onnx import TensorProto, helper, numpy_helper
from specdec.runtime.gguf_blocks import (
    GGUF_SOURCE_FILE,
    gguf_source,
    quantize_from_gguf,
    read_blocks,
    rounding,
    source_record,
)

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _raw_k_quant(kind: GGMLQuantizationType, rows: int, supers: int) -> np.ndarray:
    """Random K-quant super-blocks (the gguf package dequantizes them but does not make them): random bytes,
    with sane f16 scales where the layout keeps them."""
    block_bytes = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind.name]
    raw = np.random.default_rng(7).integers(0, 256, (rows, supers, block_bytes), dtype=np.uint8)
    halves = np.random.default_rng(8).uniform(0.001, 0.05, (rows, supers, 2)).astype(np.float16).view(np.uint8)
    where = slice(208, 210) if kind.name == "Q6_K" else slice(0, 4)
    raw[..., where] = halves.reshape(rows, supers, -1)[..., :where.stop - where.start]
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", TYPES)
def test_each_block_type_reads_to_the_values_gguf_dequantizes(type_name: str) -> None:
    kind = GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):
        raw = _raw_k_quant(kind, 5, 2)
    else:
        raw = quants.quantize(np.random.default_rng(0).standard_normal((5, 96)).astype(np.float32), kind)
    blocks = read_blocks(raw.reshape(5, -1), type_name)
    assert blocks.bits == (4 if type_name.startswith("Q4") else 8)
    assert blocks.block == (16 if type_name == "Q6_K" else 32)
    expected = quants.dequantize(raw, kind)
    if blocks.minimums is None:
        np.testing.assert_array_equal(blocks.dequantize(), expected)
    else:  # d*(q - center) + (m + center*d): the same value up to fp32 rounding
        np.testing.assert_allclose(blocks.dequantize(), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    centered = blocks.centered(blocks.bits).astype(np.float32) - (1 << (blocks.bits - 1))
    np.testing.assert_array_equal(centered, blocks.codes.astype(np.float32) - blocks.zero_points[..., None])


def test_types_without_a_block_reader_are_left_alone() -> None:
    assert read_blocks(np.zeros((2, 8), np.uint8), "IQ4_XS") is None


def test_blocks_of_different_sizes_split_to_the_smaller() -> None:
    q4k = read_blocks(_raw_k_quant(GGMLQuantizationType.Q4_K, 3, 1), "Q4_K")
    halves = q4k.split(16)
    assert halves.block == 16 and halves.scales.shape == (3, 16)
    np.testing.assert_array_equal(halves.dequantize(), q4k.dequantize())


def test_bf16_rounding_is_round_to_nearest_even() -> None:
    import torch

    values = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    expected = torch.from_numpy(values).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(rounding("bfloat16")(values), expected)


@pytest.fixture()
def gguf_file(tmp_path):
    """A small GGUF file: a Q4_1 and a Q4_0 matrix (64 inputs), a Q8_0 one (96 inputs), an F32 table and norm, a
    Q8_0 embedding."""
    rng = np.random.default_rng(2)
    tensors = {
        "a": (GGMLQuantizationType.Q4_1, rng.standard_normal((48, 64))),
        "b": (GGMLQuantizationType.Q4_0, rng.standard_normal((48, 64))),
        "c": (GGMLQuantizationType.Q8_0, rng.standard_normal((40, 96))),
        "table": (GGMLQuantizationType.F32, rng.standard_normal((10, 64))),
        "embed": (GGMLQuantizationType.Q8_0, rng.standard_normal((10, 64))),
        "norm": (GGMLQuantizationType.F32, rng.standard_normal(64)),
    }
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    exact = {}
    for name, (kind, values) in tensors.items():
        values = values.astype(np.float32)
        raw = values if kind == GGMLQuantizationType.F32 else quants.quantize(values, kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        exact[name] = values if kind == GGMLQuantizationType.F32 else quants.dequantize(raw, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, exact


def _graph(path, exact: dict[str, np.ndarray], stray: np.ndarray) -> None:
    """x [2, 3, 64] -> MatMul with a and b's rows as columns (a's permuted: a fused, reordered weight) -> MatMul
    with c's -> y; x also through a weight the file does not have, the table gathered and scaled by the norm, and
    the embedding gathered.
    Every file value is stored rounded to bf16, as an export of a bf16 conversion holds it."""
    bf16 = rounding("bfloat16")
    order = np.random.default_rng(3).permutation(48)
    fused = np.concatenate([exact["a"][order], exact["b"]])  # [96, 64]
    stored = {"w1": bf16(fused.T.copy()), "w2": bf16(exact["c"].T.copy()), "w3": stray, "table": bf16(exact["table"]),
              "norm": bf16(exact["norm"]), "embed": bf16(exact["embed"])}
    inits = [numpy_helper.from_array(values, name) for name, values in stored.items()]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"]),
             helper.make_node("MatMul", ["x", "w3"], ["z"]), helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("Mul", ["rows", "norm"], ["e"]), helper.make_node("Gather", ["embed", "ids"], ["g"])]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 64]),
                                              helper.make_tensor_value_info("ids", TensorProto.INT64, [4])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z", "e", "g")],
                              inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return fused


def test_a_graph_is_served_from_the_files_blocks_and_exact_values(tmp_path, gguf_file) -> None:
    gguf_path, exact = gguf_file
    stray = np.random.default_rng(4).standard_normal((64, 8)).astype(np.float32)
    fused = _graph(tmp_path / "fp32.onnx", exact, stray)
    report = quantize_from_gguf(tmp_path / "fp32.onnx", gguf_path, "bfloat16", tmp_path / "gguf.onnx",
                                metadata={"specdec.weight_quantization": "gguf"})
    assert report.quantized == {"4-bit": 1, "8-bit": 1, "8-bit table": 1} and report.left == 1 and report.exact == 2

    model = onnx.load(str(tmp_path / "gguf.onnx"))
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("GatherBlockQuantized") == 1
    assert not {"w1", "w2", "embed"} & {i.name for i in model.graph.initializer}
    assert {p.key: p.value for p in model.metadata_props}["specdec.weight_quantization"] == "gguf"
    session = ort.InferenceSession(str(tmp_path / "gguf.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((2, 3, 64)).astype(np.float32)
    ids = np.array([0, 3, 9, 3])
    y, z, e, g = session.run(["y", "z", "e", "g"], {"x": x, "ids": ids})
    expected_y = (x @ fused.T) @ exact["c"].T  # the file's exact values, Q4_1 minimums included
    # int8 activations (per block of 32, as llama.cpp's Q8 products): close to the exact product, not equal
    assert np.abs(y - expected_y).max() < 0.02 * np.abs(expected_y).max()
    np.testing.assert_array_equal(z, session.run(["z"], {"x": x, "ids": ids})[0])
    np.testing.assert_allclose(z, x @ stray, rtol=1e-5, atol=1e-5)  # not in the file: untouched
    np.testing.assert_array_equal(e, exact["table"][ids] * exact["norm"])  # exact, not bf16-rounded
    np.testing.assert_array_equal(g, exact["embed"][ids])


def test_a_rows_result_does_not_depend_on_its_batch(tmp_path, gguf_file) -> None:
    """Decode steps, verification passes and batches must give a sequence the same logits bit for bit."""
    gguf_path, exact = gguf_file
    _graph(tmp_path / "fp32.onnx", exact, np.zeros((64, 8), np.float32))
    quantize_from_gguf(tmp_path / "fp32.onnx", gguf_path, "bfloat16", tmp_path / "gguf.onnx")
    model = onnx.load(str(tmp_path / "gguf.onnx"))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "width"
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(6).standard_normal((16, 5, 64)).astype(np.float32)
    ids = np.zeros(4, np.int64)
    whole = session.run(["y"], {"x": x, "ids": ids})[0]
    for b, w in ((0, 0), (3, 4), (15, 2)):
        alone = session.run(["y"], {"x": x[b:b + 1, w:w + 1], "ids": ids})[0]
        np.testing.assert_array_equal(alone[0, 0], whole[b, w])


def test_gguf_source_finds_the_file_only_while_it_is_unchanged(tmp_path, gguf_file) -> None:
    gguf_path, _ = gguf_file
    folder = tmp_path / "converted"
    folder.mkdir()
    assert gguf_source(folder) is None
    (folder / GGUF_SOURCE_FILE).write_text(json.dumps({**source_record(gguf_path), "dtype": "bfloat16"}))
    assert gguf_source(folder) == (gguf_path.resolve(), "bfloat16")
    gguf_path.write_bytes(gguf_path.read_bytes() + b"\0")
    assert gguf_source(folder) is None


def test_a_product_over_k_quants_of_two_block_sizes(tmp_path) -> None:
    """Q4_K (sub-blocks of 32, minimums) beside Q6_K (sub-blocks of 16) in one fused weight: one 8-bit
    MatMulNBits over blocks of 16, the minimums' product beside it."""
    kinds = {"kq4": GGMLQuantizationType.Q4_K, "kq6": GGMLQuantizationType.Q6_K}
    raws = {name: _raw_k_quant(kind, 24, 1) for name, kind in kinds.items()}
    path = tmp_path / "k.gguf"
    writer = GGUFWriter(str(path), "llama")
    exact = {}
    for name, raw in raws.items():
        kind = kinds[name]
        writer.add_tensor(name, raw, raw_dtype=kind)
        exact[name] = quants.dequantize(raw, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fused = np.concatenate([exact["kq4"], exact["kq6"]])  # [48, 256]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "k",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(rounding("bfloat16")(fused.T.copy()), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "k.onnx"))
    report = quantize_from_gguf(tmp_path / "k.onnx", path, "bfloat16", tmp_path / "k.gguf.onnx")
    assert report.quantized == {"8-bit": 1}
    node = next(n for n in onnx.load(str(tmp_path / "k.gguf.onnx")).graph.node if n.op_type == "MatMulNBits")
    assert {a.name: a.i for a in node.attribute}["block_size"] == 16
    x = np.random.default_rng(9).standard_normal((2, 256)).astype(np.float32)
    y = ort.InferenceSession(str(tmp_path / "k.gguf.onnx"), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    expected = x @ fused.T
    assert np.abs(y - expected).max() < 0.02 * np.abs(expected).max()
