"""The decoder step on ONNX Runtime (CPU), behind the DecoderRuntime interface.

The graph is the export of specdec.runtime.step_graph. `resolve_onnx` finds an export that matches the
checkpoint (same weights, graph version and dtype) or makes one, so a deployment needs nothing but the
Hugging Face checkpoint: the first load exports (about a second for the default pair) into
`<model_dir>/onnx/` if that folder is writable, else into `$SPECDEC_ONNX_CACHE` (default
`~/.cache/specdec/onnx/<fingerprint>`). `build/export_onnx.py` does the same ahead of time.

Weight quantizations (`weight_quantization`, each graph made from the fp32 export beside it on first load):
- "gguf": a checkpoint converted from a GGUF file is served from that file's own quantized blocks
  (`decoder.gguf.onnx`, specdec.runtime.gguf_blocks): the checkpoint's own precision, target included;
- "int8": a drafter's 8-bit weights (`decoder.int8.onnx`): its proposals are checked by the target, so
  outputs do not change, only how often a proposal is accepted (docs/SPECULATION.md, "An int8 EAGLE head").
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from specdec.checkpoint import read_proposal_vocab, read_spec
from specdec.runtime.gguf_blocks import GGUF_SOURCE_FILE, REVISION, REVISION_KEY, gguf_source, quantize_from_gguf
from specdec.runtime.graph_contract import (
    META_PREFIX,
    ONNX_FILE,
    OUTPUTS,
    checkpoint_fingerprint,
    graph_inputs,
    graph_metadata,
    past_inputs,
    read_graph_metadata,
    save_atomically,
)
from specdec.runtime.graph_runtime import NUMPY_DTYPES, SlottedGraphRuntime

log = logging.getLogger(__name__)

# Weight quantizations of a step graph made here: name -> (bits, block size along a weight's input dimension).
WEIGHT_QUANTIZATIONS = {"int8": (8, 32)}
GGUF = "gguf"
# Batches from this size have their context written in place (graph_writing_in_place); a lone sequence's
# context copy costs less than binding every input and output by name (~0.4 ms a forward here).
IN_PLACE_FROM_BATCH = 2  # the checkpoint's own GGUF blocks (specdec.runtime.gguf_blocks)
QUANTIZATION_KEY = "weight_quantization"  # in a quantized graph's specdec.* metadata


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialise exports into `folder` across processes (Triton instances load in parallel)."""
    with (folder / ".export.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def export_is_current(onnx_path: Path, model_dir: str | Path, dtype: str,
                      weight_quantization: str | None = None) -> bool:
    """True when `onnx_path` was exported from this checkpoint, at this dtype, by this graph version (and
    quantized so, when `weight_quantization` is given)."""
    if not onnx_path.is_file():
        return False
    try:
        found = read_graph_metadata(onnx_path)
    except Exception:  # unreadable or truncated: rebuild
        return False
    wanted = graph_metadata(model_dir, dtype, int(found.get("max_positions", 0)))
    wanted[QUANTIZATION_KEY] = weight_quantization or ""
    if weight_quantization == GGUF:
        wanted[REVISION_KEY] = str(REVISION)
    return all(found.get(key, "") == value for key, value in wanted.items())


def require_known(weight_quantization: str) -> None:
    """Refuse a weight quantization this runtime does not make."""
    if weight_quantization not in (*WEIGHT_QUANTIZATIONS, GGUF):
        raise ValueError(f"weight_quantization must be one of {', '.join((*WEIGHT_QUANTIZATIONS, GGUF))}, "
                         f"not {weight_quantization!r}")


def onnx_file(weight_quantization: str | None) -> str:
    """The file name of a step graph with these weights."""
    return f"decoder.{weight_quantization}.onnx" if weight_quantization else ONNX_FILE


def quantize_graph(source: Path, out_path: Path, weight_quantization: str) -> Path:
    """Write `source` (an fp32 step graph) with block-wise quantized weights to `out_path` (atomically).

    Every MatMul with a constant weight becomes onnxruntime's MatMulNBits (symmetric, a scale per block of
    32 input rows) computed on int8 activations quantized per block too (`accuracy_level` 4: the VNNI / AMX
    kernels). Block-wise activation scales are what keep an EAGLE head's fusion layer: its input puts a
    token embedding beside unit-RMS feature blocks of far larger scale, and one activation scale per row
    (onnxruntime's `quantize_dynamic`) left 0.23 of the head's proposals equal to fp32's (docs/SPECULATION.md).
    Needs the `onnx_ir` package (at quantization only)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    require_known(weight_quantization)
    bits, block = WEIGHT_QUANTIZATIONS[weight_quantization]
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line a node
    model = onnx.load(str(source))
    provenance = [(prop.key, prop.value) for prop in model.metadata_props]  # the quantizer edits `model` in place
    config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=4, bits=bits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block, is_symmetric=True, accuracy_level=4,
                                     algo_config=config)
    quantizer.process()
    quantized = quantizer.model.model
    del quantized.metadata_props[:]
    for key, value in provenance:
        quantized.metadata_props.add(key=key, value=value)
    quantized.metadata_props.add(key=META_PREFIX + QUANTIZATION_KEY, value=weight_quantization)
    return save_atomically(quantized, out_path)


def gguf_graph(model_dir: str | Path, source: Path, out_path: Path) -> Path:
    """Write `source` (the fp32 export of a folder converted from a GGUF file) served from the file's blocks."""
    found = gguf_source(model_dir)
    if found is None:
        raise ValueError(f"{model_dir} was not converted from a GGUF file that is still there "
                         f"({GGUF_SOURCE_FILE} names none): weight_quantization {GGUF!r} needs one")
    gguf_path, folder_dtype = found
    quantize_from_gguf(source, gguf_path, folder_dtype, out_path, {META_PREFIX + QUANTIZATION_KEY: GGUF})
    return out_path


def default_onnx_dirs(model_dir: str | Path) -> list[Path]:
    """Where an export of `model_dir` is looked for and written, in order."""
    cache_root = os.environ.get("SPECDEC_ONNX_CACHE") or Path.home() / ".cache" / "specdec" / "onnx"
    return [Path(model_dir) / "onnx", Path(cache_root) / checkpoint_fingerprint(model_dir)[:16]]


def resolve_onnx(model_dir: str | Path, engine_dir: str | Path | None = None, dtype: str = "float32",
                 weight_quantization: str | None = None) -> Path:
    """The path of a current export of `model_dir` (with `weight_quantization`, of its quantized graph),
    exporting and quantizing it if needed.

    With `engine_dir` only that folder is used; otherwise the first writable of `default_onnx_dirs`."""
    folders = [Path(os.path.expandvars(str(engine_dir)))] if engine_dir else default_onnx_dirs(model_dir)
    errors = []
    for folder in folders:
        path = folder / onnx_file(weight_quantization)
        if export_is_current(path, model_dir, dtype, weight_quantization):
            return path
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with _locked(folder):
                source = folder / ONNX_FILE
                if not export_is_current(source, model_dir, dtype):  # another process may have just made it
                    log.info("exporting %s to %s (%s)", model_dir, source, dtype)
                    from specdec.runtime.step_graph import export_decoder  # torch, only when exporting

                    export_decoder(model_dir, source, dtype=dtype)
                if weight_quantization and not export_is_current(path, model_dir, dtype, weight_quantization):
                    log.info("quantizing %s to %s (%s weights)", source, path, weight_quantization)
                    if weight_quantization == GGUF:
                        gguf_graph(model_dir, source, path)
                    else:
                        quantize_graph(source, path, weight_quantization)
            return path
        except OSError as exc:  # read-only model folder: try the next place
            errors.append(f"{folder}: {exc}")
    raise OSError("cannot write an ONNX export anywhere: " + "; ".join(errors))


def graph_writing_in_place(onnx_path: Path, num_layers: int) -> tuple[bytes | str, dict[str, str]]:
    """The step graph at `onnx_path` with each layer's updated context as an extra output (the serialized
    graph, or the path of a copy beside it where its weights are in an external file), and which output
    updates which past input (past name -> output name).

    The graph writes the new tokens' keys into each layer's past with a ScatterND, whose result attention
    reads. A graph input is the caller's memory, so onnxruntime's ScatterND first copies the whole context
    into a fresh tensor (at 64 sequences of 200 tokens, ~750 MB a forward, ~17% of it on the 2-core CPU).
    Made a graph output and bound (IOBinding) to the input's own buffer, the ScatterND's output is its input
    and onnxruntime skips the copy (it copies only when the two differ): the new rows are written where the
    context lies, which the runtime's context buffer then already holds. Only a past input that nothing but
    its ScatterND reads (and Shape, which reads no data) is bound so; others are left to the copy."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    model = onnx.load(str(onnx_path), load_external_data=False)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input if node.op_type != "Shape" else ():  # a Shape reads no data
            readers[name] = readers.get(name, 0) + 1
    pasts = set(past_inputs(num_layers))
    written = {}
    for node in model.graph.node:
        if node.op_type == "ScatterND" and node.input[0] in pasts and readers[node.input[0]] == 1:
            written[node.input[0]] = node.output[0]
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(node.output[0]))
    if not any(uses_external_data(tensor) for tensor in model.graph.initializer):
        return model.SerializeToString(), written
    beside = onnx_path.with_name(f".{onnx_path.stem}.in-place.onnx")  # the graph only: it reads the same weights
    try:
        save_atomically(model, beside)
    except OSError:
        return str(onnx_path), {}
    return str(beside), written


class OnnxLlamaRuntime(SlottedGraphRuntime):
    """DecoderRuntime over an onnxruntime InferenceSession (CPUExecutionProvider)."""

    def __init__(
        self,
        model_dir: str | Path,
        num_slots: int,
        max_length: int | None = None,
        num_threads: int | None = None,
        engine_dir: str | Path | None = None,
        dtype: str = "float32",
        onnx_path: str | Path | None = None,
        max_batch: int | None = None,
        max_step_tokens: int | None = None,
        num_blocks: int | None = None,
        block_size: int | None = None,
        weight_quantization: str | None = None,
    ) -> None:
        import onnxruntime as ort

        if dtype not in NUMPY_DTYPES:
            raise ValueError(f"the onnxruntime runtime runs {', '.join(NUMPY_DTYPES)} graphs, not {dtype!r}")
        spec = read_spec(model_dir)
        max_length = spec.served_length(max_length)
        super().__init__(spec, num_slots, max_length, NUMPY_DTYPES[dtype], "cpu", num_blocks, block_size,
                         read_proposal_vocab(model_dir, spec.vocab_size))
        if weight_quantization is not None:
            require_known(weight_quantization)
        self.onnx_path = (Path(onnx_path) if onnx_path
                          else resolve_onnx(model_dir, engine_dir, dtype, weight_quantization))
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads or 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # shared CPUs: never spin
        model, self.written_context = graph_writing_in_place(self.onnx_path, spec.num_layers)
        self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        del model
        names = ([i.name for i in self.session.get_inputs()],
                 [o.name for o in self.session.get_outputs()][:len(OUTPUTS)])
        if names != (list(graph_inputs(spec)), list(OUTPUTS)):
            raise ValueError(f"{self.onnx_path} is not a specdec step graph: inputs/outputs {names}")

    def _run(self, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if len(feeds["input_ids"]) < IN_PLACE_FROM_BATCH or not self.written_context:
            logits, new_keys, new_values, hidden = self.session.run(list(OUTPUTS), feeds)
            return logits, new_keys, new_values, hidden
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for name in OUTPUTS:
            binding.bind_output(name, "cpu")
        for past, written in self.written_context.items():  # each layer's context, updated where it lies
            array = feeds[past]
            if not (array.flags.c_contiguous and array.flags.writeable):
                raise ValueError(f"{past} must be a contiguous writable array (the graph writes its new rows there)")
            binding.bind_output(written, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        logits, new_keys, new_values, hidden = (outputs[i].numpy() for i in range(len(OUTPUTS)))
        return logits, new_keys, new_values, hidden
