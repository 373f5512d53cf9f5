"""Serve a GGUF checkpoint from its own quantized blocks: its step graph's weights as onnxruntime MatMulNBits.

A GGUF file is converted into a Hugging Face folder (build/gguf_convert.py) because the tokenizer, the
drafters and the fp32 export need one; that folder holds the dequantized weights rounded to its dtype. This
module turns the fp32 step graph exported from that folder back into the file's own precision:

- every MatMul whose constant weight's columns are rows of the file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 /
  Q4_K / Q5_K / Q6_K tensors becomes a MatMulNBits over those very blocks (a block of 32 input rows with its
  own scale, a K-quant's sub-blocks of 32, or of 16 for Q6_K; 4-bit codes where every column is 4-bit, else
  8-bit codes, which hold 4, 5 and 6 bits exactly), computed on int8 activations quantized per block as
  llama.cpp does (`accuracy_level` 4: the VNNI kernels);
- a block's minimum (Q4_1, Q5_1, Q4_K, Q5_K: w = d*q + m) is not a MatMulNBits zero point (those are integers, and a
  float one takes onnxruntime's slow unpacked path, 20-70x slower here), so it is a second, small product:
  the activations' sum over each block times the block's minimum (x . (d*q + m) = d*(x . q) + m*sum(x));
- a Gather of table rows (the token embedding) whose rows are blocks without minimums becomes a
  GatherBlockQuantized over them (8-bit codes: exactly the dequantized rows);
- every other weight found in the file (1-D norm weights, unquantized matrices, a Q4_1 embedding) gets the
  file's exact values back in fp32, undoing the folder's rounding.

Which GGUF row a graph column is, is found by value: a column of the export equals the dequantized row
rounded to the folder's dtype, whatever the converter's names, fusions (q/k/v, gate/up) and row permutations
(llama.cpp's q/k rotary order). A column that matches nothing stays in fp32, and `quantize_from_gguf` says
how many did.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.runtime.graph_contract import save_atomically

log = logging.getLogger(__name__)

# Bump when the graphs made here change: a cached one is then made again. 2: embeddings as GatherBlockQuantized.
# 3: codes centered on their type's middle, minimums folded into the second product. 4: K-quants.
# 5: a minimum term keeps its input's leading dimensions (four nodes instead of seven).
REVISION = 5
REVISION_KEY = "gguf_revision"  # in a graph's specdec.* metadata
GGUF_SOURCE_FILE = "gguf_source.json"  # written by build/gguf_convert.py into the converted folder
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations (llama.cpp's Q8 activations for its quantized dot products)


@dataclass
class Blocks:
    """Rows of a quantized matrix as codes over blocks of `block` inputs: w = scale * (code - zero_point) + minimum.

    The zero point is the middle of the type's code range (8 for 4-bit codes, 16 for 5-bit, 128 for 8-bit) and a
    type's own minimum is folded into `minimums` (Q4_1: d*q + m = d*(q - 8) + (m + 8d)). Centered codes keep the
    int8 product small where the true weight is: with codes 0..15 and the minimum apart, the product is twice
    the result and the minimum's term cancels it, which left a Q4_1 layer's int8 product 2.8% off (rms) against
    1.0% centered (an ffn_up of the default model, activations quantized per block as llama.cpp does)."""

    bits: int  # the fewest bits that hold every code (4 or 8)
    codes: np.ndarray  # uint8 [rows, blocks, block]
    scales: np.ndarray  # float32 [rows, blocks]
    zero_points: np.ndarray  # uint8 [rows, blocks]
    minimums: np.ndarray | None  # float32 [rows, blocks], or None where the type has none

    def dequantize(self) -> np.ndarray:
        """The rows' values, float32 [rows, blocks * block]."""
        values = (self.codes.astype(np.float32) - self.zero_points[..., None]) * self.scales[..., None]
        if self.minimums is not None:
            values += self.minimums[..., None]
        return values.reshape(len(self.codes), -1)

    @property
    def block(self) -> int:
        return self.codes.shape[-1]

    def split(self, block: int) -> Blocks:
        """The same rows over blocks of `block` inputs (a divisor of this block), each half with its block's scale."""
        parts = self.block // block
        if parts == 1:
            return self
        repeat = lambda a: None if a is None else np.repeat(a, parts, axis=1)  # noqa: E731
        return Blocks(self.bits, self.codes.reshape(len(self.codes), -1, block), repeat(self.scales),
                      repeat(self.zero_points), repeat(self.minimums))

    def centered(self, bits: int) -> np.ndarray:
        """The codes as `bits`-bit codes around MatMulNBits' default zero point, 2 ** (bits - 1) (the same w)."""
        shift = (1 << (bits - 1)) - self.zero_points.astype(np.int16)
        codes = self.codes.astype(np.int16) + shift[..., None]
        if codes.min() < 0 or codes.max() >= 1 << bits:
            raise ValueError(f"codes do not fit {bits} bits around {1 << (bits - 1)}")
        return codes.astype(np.uint8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: block element j in the low nibble of byte j, element j + 16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5's fifth bits: element j is bit j of the block's little-endian 32-bit word."""
    word = qh.copy().view("<u4")[..., 0]
    return ((word[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def read_blocks(data: np.ndarray, type_name: str) -> Blocks | None:
    """The Blocks of a GGUF tensor's raw rows (uint8 [rows, bytes]); None for a type not served as blocks."""
    if type_name in K_QUANT_BYTES:
        return _read_k_quant(data, type_name)
    rows = data.shape[0]
    layout = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
    if type_name not in layout:
        return None
    b = data.reshape(rows, -1, layout[type_name])
    scales = _f16(b[..., 0:2])
    minimums = None
    if type_name == "Q4_0":
        codes, zero, bits = _nibbles(b[..., 2:18]), 8, 4
    elif type_name == "Q4_1":  # d*q + m = d*(q - 8) + (m + 8d)
        codes, zero, bits = _nibbles(b[..., 4:20]), 8, 4
        minimums = _f16(b[..., 2:4]) + 8 * scales
    elif type_name == "Q5_0":
        codes, zero, bits = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6]) << 4), 16, 8
    elif type_name == "Q5_1":  # d*q + m = d*(q - 16) + (m + 16d)
        codes, zero, bits = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8]) << 4), 16, 8
        minimums = _f16(b[..., 2:4]) + 16 * scales
    else:  # Q8_0: int8 codes, stored as uint8 around 128
        codes, zero, bits = (b[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), 128, 8
    zero_points = np.full(scales.shape, zero, dtype=np.uint8)
    return Blocks(bits, codes.astype(np.uint8), scales, zero_points, minimums)


K_QUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per super-block of 256 inputs


def _read_k_quant(data: np.ndarray, type_name: str) -> Blocks:
    """A K-quant's super-blocks of 256 as their sub-blocks (ggml's layouts, as the `gguf` package reads them):
    Q4_K / Q5_K: 8 sub-blocks of 32, scale d*sc and minimum -dmin*m from 6-bit sc, m; Q6_K: 16 sub-blocks of 16,
    scale d*sc from int8 sc, 6-bit codes around 32."""
    from gguf.quants import Q4_K

    rows = data.shape[0]
    b = data.reshape(rows, -1, K_QUANT_BYTES[type_name])
    supers = b.shape[1]
    if type_name == "Q6_K":
        ql, qh = b[..., 0:128].reshape(rows, supers, 2, 1, 64), b[..., 128:192].reshape(rows, supers, 2, 1, 32)
        low = ((ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(rows, supers, 8, 32)
        high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03).reshape(rows, supers, 8, 32)
        codes = (low | (high << 4)).reshape(rows, supers * 16, 16)
        scales = (_f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(np.float32))
        return Blocks(8, codes.astype(np.uint8), scales.reshape(rows, -1),
                      np.full((rows, supers * 16), 32, np.uint8), None)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    scales = d * sc.reshape(rows, supers, 8).astype(np.float32)
    nibbles = np.array([0, 4], np.uint8).reshape(2, 1)  # 32 bytes: sub-block 2g's low nibbles, 2g+1's high
    if type_name == "Q4_K":
        qs = b[..., 16:144].reshape(rows, supers, 4, 1, 32)
        codes, center, bits = ((qs >> nibbles) & 0x0F).reshape(rows, supers, 8, 32), 8, 4
    else:  # Q5_K: the fifth bit of sub-block i's element l is bit i of qh[l]
        qh, qs = b[..., 16:48].reshape(rows, supers, 1, 32), b[..., 48:176].reshape(rows, supers, 4, 1, 32)
        low = ((qs >> nibbles) & 0x0F).reshape(rows, supers, 8, 32)
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 0x01
        codes, center, bits = low | (high << 4), 16, 8
    minimums = center * scales - dmin * m.reshape(rows, supers, 8).astype(np.float32)
    return Blocks(bits, codes.reshape(rows, supers * 8, 32).astype(np.uint8), scales.reshape(rows, -1),
                  np.full((rows, supers * 8), center, np.uint8), minimums.reshape(rows, -1))


def rounding(dtype: str):
    """The rounding a folder of this dtype applied to the file's values (torch's: round to nearest even)."""
    if dtype == "float32":
        return lambda x: x
    if dtype == "float16":
        return lambda x: x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        def to_bf16(x: np.ndarray) -> np.ndarray:
            bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.astype(np.uint32).view(np.float32)
        return to_bf16
    raise ValueError(f"no rounding known for a {dtype!r} folder")


def _key(values: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(values, dtype=np.float32).tobytes(), digest_size=16).digest()


class GgufRows:
    """Every row of a GGUF file's tensors, found by its value as the converted folder holds it."""

    def __init__(self, gguf_path: str | Path, folder_dtype: str) -> None:
        from gguf import GGUFReader
        from gguf.quants import dequantize

        round_like_folder = rounding(folder_dtype)
        reader = GGUFReader(str(gguf_path))
        self.tensors: list[tuple[str, str, np.ndarray, Blocks | None]] = []  # name, type, exact values, blocks
        self.by_row: dict[bytes, tuple[int, int]] = {}  # a rounded row's key -> (tensor, row)
        self.by_vector: dict[bytes, int] = {}  # a rounded 1-D tensor's key -> tensor
        for tensor in reader.tensors:
            kind = tensor.tensor_type.name
            exact = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            index = len(self.tensors)
            blocks = read_blocks(np.asarray(tensor.data).reshape(exact.shape[0], -1), kind) if exact.ndim == 2 else None
            self.tensors.append((tensor.name, kind, exact, blocks))
            rounded = round_like_folder(exact)
            if exact.ndim == 1:
                self.by_vector.setdefault(_key(rounded), index)
                continue
            for row in range(exact.shape[0]):
                self.by_row.setdefault(_key(rounded[row]), (index, row))

    def rows_of(self, matrix: np.ndarray) -> list[tuple[int, int]] | None:
        """The (tensor, row) of every row of `matrix` (float32 [rows, K]), or None if one is not in the file."""
        found = []
        for row in matrix:
            hit = self.by_row.get(_key(row))
            if hit is None:
                return None
            found.append(hit)
        return found


def _pack(blocks: Blocks) -> np.ndarray:
    """MatMulNBits' B [N, blocks, block * bits / 8]: centered codes, two 4-bit codes a byte (low nibble first)."""
    codes = blocks.centered(blocks.bits)
    if blocks.bits == 8:
        return codes
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _gather(rows: GgufRows, found: list[tuple[int, int]]) -> Blocks | None:
    """The Blocks of a matrix whose rows are `found` (rows of one or more tensors), or None if one is not blocks."""
    of = {t: rows.tensors[t][3] for t, _ in found}
    if any(blocks is None for blocks in of.values()):
        return None
    block = min(blocks.block for blocks in of.values())  # Q6_K's 16 beside 32: every block split to 16
    of = {t: blocks.split(block) for t, blocks in of.items()}
    def stack(field: str) -> np.ndarray:
        return np.stack([getattr(of[t], field)[r] for t, r in found])
    minimums = None
    if any(blocks.minimums is not None for blocks in of.values()):
        minimums = np.stack([of[t].minimums[r] if of[t].minimums is not None else np.zeros_like(of[t].scales[r])
                             for t, r in found])
    return Blocks(max(blocks.bits for blocks in of.values()), stack("codes"), stack("scales"), stack("zero_points"),
                  minimums)


@dataclass
class GgufGraphReport:
    """What quantize_from_gguf did to a step graph."""

    quantized: dict[str, int]  # MatMul weights served as blocks, by bits ("4-bit": n, "8-bit": n)
    exact: int  # initializers given the file's exact fp32 values
    left: int  # constant MatMul weights not found in the file (served in fp32 as exported)

    def describe(self) -> str:
        blocks = ", ".join(f"{n} {bits}" for bits, n in sorted(self.quantized.items())) or "none"
        return (f"MatMul weights from the file's blocks: {blocks}; {self.exact} more tensors with the file's exact "
                f"values; {self.left} MatMul weights not in the file (fp32)")


def quantize_from_gguf(source: str | Path, gguf_path: str | Path, folder_dtype: str, out_path: str | Path,
                       metadata: dict[str, str] | None = None,
                       accuracy_level: int = ACCURACY_LEVEL) -> GgufGraphReport:
    """Write the fp32 step graph `source` with the GGUF file's own blocks and values (above) to `out_path`,
    with `metadata` added to the graph's own."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(source))
    graph = model.graph
    rows = GgufRows(gguf_path, folder_dtype)
    initializers = {init.name: init for init in graph.initializer}
    ranks = _ranks(model)
    report = GgufGraphReport({}, 0, 0)
    new_nodes, dropped = [], set()
    for node in graph.node:
        if node.op_type == "Gather" and _gathered_from_blocks(graph, node, initializers, rows, new_nodes):
            dropped.add(node.input[0])
            report.quantized["8-bit table"] = report.quantized.get("8-bit table", 0) + 1
            continue
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or len(weight.dims) != 2:
            new_nodes.append(node)
            continue
        columns = numpy_helper.to_array(weight).astype(np.float32).T  # [N, K]: a column per output
        found = rows.rows_of(columns)
        blocks = _gather(rows, found) if found else None
        if found is None:
            report.left += 1
            new_nodes.append(node)
            continue
        if blocks is None:  # in the file but not as blocks (F32/F16 tensors): their exact values
            exact = np.stack([rows.tensors[t][2][r] for t, r in found]).T
            weight.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(exact), weight.name))
            report.exact += 1
            new_nodes.append(node)
            continue
        n_out, k_in = columns.shape
        stem = node.name.strip("/").replace("/", "_") or weight.name
        names = {f: f"{stem}_gguf_{f}" for f in ("codes", "scales")}
        graph.initializer.extend([numpy_helper.from_array(_pack(blocks), names["codes"]),
                                  numpy_helper.from_array(blocks.scales.reshape(-1), names["scales"])])
        x, y = node.input[0], node.output[0]
        product = f"{stem}_gguf_product" if blocks.minimums is not None else y
        new_nodes.append(helper.make_node(  # no zero points: the default, 2 ** (bits - 1), is the codes' center
            "MatMulNBits", [x, names["codes"], names["scales"]], [product],
            name=f"{stem}_gguf", domain="com.microsoft", K=k_in, N=n_out, bits=blocks.bits, block_size=blocks.block,
            accuracy_level=accuracy_level))
        if blocks.minimums is not None:
            new_nodes.extend(_minimum_term(graph, stem, x, ranks.get(x), product, y, blocks.minimums, blocks.block))
        dropped.add(weight.name)
        report.quantized[f"{blocks.bits}-bit"] = report.quantized.get(f"{blocks.bits}-bit", 0) + 1
    used = {name for node in new_nodes for name in node.input}
    kept = [init for init in graph.initializer if init.name in used or init.name not in dropped]
    for init in kept:
        if init.name not in dropped and init.data_type == onnx.TensorProto.FLOAT:
            report.exact += _restore_exact(rows, init)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(new_nodes)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    for key, value in {**(metadata or {}), "specdec.gguf_blocks": report.describe(),
                       f"specdec.{REVISION_KEY}": str(REVISION)}.items():
        model.metadata_props.add(key=key, value=value)
    save_atomically(model, out_path)
    log.info("%s: %s", out_path, report.describe())
    return report


def _gathered_from_blocks(graph, node, initializers: dict, rows: GgufRows, new_nodes: list) -> bool:
    """Replace a Gather of table rows (an embedding) by a GatherBlockQuantized over the file's blocks, when every
    row is a block type without minimums (the op has none); its output is the exact dequantized rows."""
    from onnx import helper, numpy_helper

    table = initializers.get(node.input[0])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    if table is None or len(table.dims) != 2 or axis != 0:
        return False
    found = rows.rows_of(numpy_helper.to_array(table).astype(np.float32))
    blocks = _gather(rows, found) if found else None
    if blocks is None or blocks.minimums is not None:
        return False
    stem = f"{table.name}_gguf_"
    graph.initializer.extend([
        numpy_helper.from_array(np.ascontiguousarray(blocks.centered(8).reshape(len(found), -1)), stem + "codes"),
        numpy_helper.from_array(blocks.scales, stem + "scales"),
        numpy_helper.from_array(np.full(blocks.scales.shape, 128, np.uint8), stem + "zero_points")])
    new_nodes.append(helper.make_node(
        "GatherBlockQuantized", [stem + "codes", node.input[1], stem + "scales", stem + "zero_points"],
        list(node.output), name=stem + "gather", domain="com.microsoft", bits=8, block_size=blocks.block, gather_axis=0,
        quantize_axis=1))
    return True


def _restore_exact(rows: GgufRows, init) -> int:
    """Give an fp32 initializer the file's exact values if it is a file tensor rounded (1 if so, else 0)."""
    from onnx import numpy_helper

    values = numpy_helper.to_array(init).astype(np.float32)
    if values.ndim == 1:
        index = rows.by_vector.get(_key(values))
        exact = rows.tensors[index][2] if index is not None else None
    elif values.ndim == 2 and values.shape[0] >= 1:
        found = rows.rows_of(values)
        exact = np.stack([rows.tensors[t][2][r] for t, r in found]) if found else None
    else:
        exact = None
    if exact is None or exact.shape != values.shape:
        return 0
    init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(exact, dtype=np.float32), init.name))
    return 1


def _ranks(model) -> dict[str, int]:
    """The rank of every tensor of `model`'s graph that shape inference can tell (weights' values not needed:
    large initializers go in as empty tensors of their shape)."""
    import onnx
    from onnx import helper

    g = model.graph
    small = [init for init in g.initializer if len(init.raw_data) <= 4096]  # shapes and other constants
    weights = [helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
               for init in g.initializer if len(init.raw_data) > 4096]
    shell = helper.make_model(helper.make_graph(list(g.node), g.name, [*g.input, *weights], list(g.output), small),
                              opset_imports=list(model.opset_import))
    inferred = onnx.shape_inference.infer_shapes(shell)
    return {info.name: len(info.type.tensor_type.shape.dim)
            for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
            if info.type.tensor_type.HasField("shape")}


def _minimum_term(graph, stem: str, x: str, rank: int | None, product: str, y: str, minimums: np.ndarray,
                  block: int) -> list:
    """Nodes adding sum(x over each block) @ minimums to `product` as `y` (x [..., K] -> y [..., N]).

    With x's rank known, x is viewed as [..., blocks, block] (Reshape's 0 keeps a dimension), so the sums and
    their product keep x's leading dimensions: four nodes; otherwise the sums go through rows and back."""
    from onnx import helper, numpy_helper

    n_out, n_blocks = minimums.shape
    t = f"{stem}_gguf_"
    graph.initializer.append(
        numpy_helper.from_array(np.ascontiguousarray(minimums.T, dtype=np.float32), t + "minimums"))
    graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), t + "sum_axes"))
    if rank:
        graph.initializer.append(
            numpy_helper.from_array(np.array([0] * (rank - 1) + [n_blocks, block], np.int64), t + "block_shape"))
        return [
            helper.make_node("Reshape", [x, t + "block_shape"], [t + "blocked"], name=t + "block"),
            helper.make_node("ReduceSum", [t + "blocked", t + "sum_axes"], [t + "sums"], keepdims=0, name=t + "sum"),
            helper.make_node("MatMul", [t + "sums", t + "minimums"], [t + "minimum_term"], name=t + "minimum"),
            helper.make_node("Add", [product, t + "minimum_term"], [y], name=t + "add"),
        ]
    graph.initializer.extend([numpy_helper.from_array(np.array([-1, block], np.int64), t + "block_shape"),
                              numpy_helper.from_array(np.array([-1, n_blocks], np.int64), t + "sums_shape")])
    return [
        helper.make_node("Reshape", [x, t + "block_shape"], [t + "blocked"], name=t + "block"),
        helper.make_node("ReduceSum", [t + "blocked", t + "sum_axes"], [t + "block_sums"], keepdims=0,
                         name=t + "sum"),
        helper.make_node("Reshape", [t + "block_sums", t + "sums_shape"], [t + "sums"], name=t + "rows"),
        helper.make_node("MatMul", [t + "sums", t + "minimums"], [t + "minimum_term"], name=t + "minimum"),
        helper.make_node("Shape", [product], [t + "shape"], name=t + "shape"),
        helper.make_node("Reshape", [t + "minimum_term", t + "shape"], [t + "minimum_shaped"], name=t + "shaped"),
        helper.make_node("Add", [product, t + "minimum_shaped"], [y], name=t + "add"),
    ]


def source_record(gguf_path: Path) -> dict:
    """What identifies a GGUF file cheaply (its path, size and mtime): a converted folder records it, and a
    changed or moved file is converted again and no longer served from its blocks."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    return {"gguf_file": path.name, "gguf_path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def gguf_source(model_dir: str | Path) -> tuple[Path, str] | None:
    """The GGUF file a converted folder came from and the folder's dtype, when that very file is still there."""
    mark = Path(model_dir) / GGUF_SOURCE_FILE
    try:
        recorded = json.loads(mark.read_text(encoding="utf-8"))
        path = Path(recorded["gguf_path"])
        if {**source_record(path), "dtype": recorded["dtype"]} != recorded:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path, recorded["dtype"]
