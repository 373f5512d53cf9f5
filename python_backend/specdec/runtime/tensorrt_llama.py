"""The decoder step as a TensorRT engine, behind the DecoderRuntime interface; and what building one needs.

Engines are built by build/build_engines.py from the ONNX export of specdec.runtime.step_graph, one per
model, into `<engine_dir>/model.plan` with its metadata in `<engine_dir>/model.json` (ENGINE_FILE,
METADATA_FILE). This module holds everything about them that is plain Python, so a CPU machine can test it:
the optimization profiles (`compute_profiles`), the metadata (`EngineMetadata`) and its checks against a
checkpoint and a deployment, and the choice of a profile per call. `tensorrt` itself (an optional extra) is
imported only when an engine is built or loaded.

The runtime keeps the slotted KV cache as torch CUDA tensors and passes torch CUDA tensors to the engine:
tensorrt.Runtime -> deserialize_cuda_engine -> one execution context per optimization profile;
per call set_input_shape / set_tensor_address for every I/O tensor and execute_async_v3 on torch's current
stream.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.checkpoint import ModelSpec, read_proposal_vocab, read_spec
from specdec.runtime.graph_contract import (
    OUTPUTS,
    PAST_KEYS,
    PRECISIONS,
    checkpoint_fingerprint,
    graph_inputs,
    past_inputs,
)
from specdec.runtime.graph_runtime import SlottedGraphRuntime

ENGINE_FILE = "model.plan"
METADATA_FILE = "model.json"
METADATA_FORMAT = 2  # 2: profiles name key_rows (graph version 7)
GRAPH_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ProfileRange:
    """min / opt / max of the dynamic sizes of one TensorRT optimization profile."""

    name: str
    batch: tuple[int, int, int]
    new_tokens: tuple[int, int, int]
    key_rows: tuple[int, int, int]

    def __post_init__(self) -> None:
        for label, (low, opt, high) in (("batch", self.batch), ("new_tokens", self.new_tokens),
                                        ("key_rows", self.key_rows)):
            if not 1 <= low <= opt <= high:
                raise ValueError(f"profile {self.name}: {label} needs 1 <= min <= opt <= max, got {low, opt, high}")

    def shapes(self, spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """min / opt / max shape of every graph input (graph_contract.graph_inputs of the checkpoint)."""
        out: dict[str, list[tuple[int, ...]]] = {name: [] for name in graph_inputs(spec)}
        past = past_inputs(spec.num_layers)
        for b, w, p in zip(self.batch, self.new_tokens, self.key_rows, strict=True):
            out["input_ids"].append((b, w))
            out["position_ids"].append((b, w))
            out["attention_mask"].append((b, w, p))
            out["logit_rows"].append((b * w,))
            out["new_rows"].append((b, w))
            for name in past:
                out[name].append((spec.num_kv_heads, b, p, spec.head_dim))
            if spec.is_eagle:
                out["features"].append((b, w, spec.eagle_feature_size))
        out["logit_rows"][0] = (1,)  # a call may ask for a single row whatever its size
        return {name: (s[0], s[1], s[2]) for name, s in out.items()}

    def admits(self, batch: int, new_tokens: int, key_rows: int) -> bool:
        return (self.batch[0] <= batch <= self.batch[2] and self.new_tokens[0] <= new_tokens <= self.new_tokens[2]
                and self.key_rows[0] <= key_rows <= self.key_rows[2])


def step_tokens(max_draft_tokens: int, max_candidates: int) -> int:
    """The most new tokens of one decode-time call: the bonus token plus a full draft tree (k x candidates);
    a draft call's catch-up input (accepted + bonus) is shorter. Anything longer is a prefill."""
    return 1 + max_draft_tokens * max_candidates


def compute_profiles(role: str, num_slots: int, max_length: int, max_draft_tokens: int, max_candidates: int,
                     default_draft_tokens: int, max_prefill_tokens: int = 512) -> list[ProfileRange]:
    """Two profiles, tried in order by the runtime: `decode` (what every speculation step sends, tuned for
    the usual shape: the draft's one token, the target's k+1) and `prefill` (prompts, in chunks of at most
    `max_prefill_tokens`; longer causal inputs are chunked by the runtime). Both cover every batch size up
    to `num_slots` and every cache length up to `max_length` (key rows: the context plus the call's padded
    width of new tokens), so any call fits one of them."""
    if role not in ("target", "draft", "eagle"):
        raise ValueError(f"role must be target, draft or eagle, not {role!r}")
    step = min(step_tokens(max_draft_tokens, max_candidates), max_length)
    prefill = max(min(max_prefill_tokens, max_length), step)
    opt_width = min(default_draft_tokens + 1, step) if role == "target" else 1  # drafts grow one token a step
    opt_batch = max(1, num_slots // 2)
    opt_past = max(1, min(max_length // 4, max_length))
    return [
        ProfileRange("decode", (1, opt_batch, num_slots), (1, opt_width, step),
                     (1, opt_past + opt_width, max_length + step)),
        ProfileRange("prefill", (1, 1, num_slots), (1, min(128, prefill), prefill),
                     (1, min(128, prefill), max_length + prefill)),
    ]


@dataclass
class EngineMetadata:
    """What an engine was built from and for; saved as JSON beside the plan."""

    model: str
    role: str
    precision: str
    checkpoint_fingerprint: str
    spec: dict[str, Any]
    max_length: int
    num_slots: int
    profiles: list[dict[str, Any]]
    inputs: list[str] = field(default_factory=list)  # graph_contract.graph_inputs of the checkpoint
    outputs: list[str] = field(default_factory=lambda: list(OUTPUTS))
    tensorrt_version: str = ""
    device_name: str = ""
    compute_capability: str = ""
    onnx_sha256: str = ""
    build_seconds: float = 0.0
    builder: dict[str, Any] = field(default_factory=dict)
    format: int = METADATA_FORMAT

    @property
    def profile_ranges(self) -> list[ProfileRange]:
        return [ProfileRange(p["name"], tuple(p["batch"]), tuple(p["new_tokens"]), tuple(p["key_rows"]))
                for p in self.profiles]

    @property
    def dtype(self) -> torch.dtype:
        return GRAPH_TORCH_DTYPES[PRECISIONS[self.precision]]

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / METADATA_FILE
        path.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, folder: str | Path) -> EngineMetadata:
        path = Path(folder) / METADATA_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no engine metadata {path}: build the engine with build/build_engines.py")
        data = json.loads(path.read_text())
        if data.get("format") != METADATA_FORMAT:
            raise ValueError(f"{path}: metadata format {data.get('format')}, this code reads {METADATA_FORMAT}")
        return cls(**data)

    def check(self, model_dir: str | Path, max_length: int, tensorrt_version: str | None = None,
              compute_capability: str | None = None) -> None:
        """Raise ValueError naming the mismatch when this engine cannot serve `model_dir` at `max_length`
        (stale weights, a shorter context than the deployment's, another TensorRT or GPU generation)."""
        problems = []
        if self.checkpoint_fingerprint != checkpoint_fingerprint(model_dir):
            problems.append(f"built from other weights than {model_dir} (rebuild: build/build_engines.py)")
        if self.spec != spec_dict(read_spec(model_dir)):
            problems.append("built for another architecture")
        inputs = list(graph_inputs(read_spec(model_dir)))
        if self.inputs != inputs or self.outputs != list(OUTPUTS):
            problems.append(f"graph I/O {self.inputs} -> {self.outputs}, this code runs {inputs} -> {list(OUTPUTS)}")
        if max_length > self.max_length:
            problems.append(f"built for cache length {self.max_length}, the deployment asks {max_length}")
        if tensorrt_version is not None and tensorrt_version != self.tensorrt_version:
            problems.append(f"built with TensorRT {self.tensorrt_version}, this is {tensorrt_version}")
        if compute_capability is not None and compute_capability != self.compute_capability:
            problems.append(f"built for compute capability {self.compute_capability}, this GPU is {compute_capability}")
        if problems:
            raise ValueError(f"engine {self.model}: " + "; ".join(problems))

    def select_profile(self, batch: int, new_tokens: int, key_rows: int) -> int:
        """Index of the first profile admitting a call of this size."""
        for index, profile in enumerate(self.profile_ranges):
            if profile.admits(batch, new_tokens, key_rows):
                return index
        raise ValueError(f"engine {self.model}: no optimization profile admits batch {batch}, "
                         f"{new_tokens} new tokens, past length {key_rows}")

    @property
    def limits(self) -> tuple[int, int]:
        """(max batch, max new tokens) that some profile admits at every cache length."""
        ranges = self.profile_ranges
        return min(p.batch[2] for p in ranges), max(p.new_tokens[2] for p in ranges)


def spec_dict(spec: ModelSpec) -> dict[str, Any]:
    """The architecture as it reads back from the metadata JSON."""
    return json.loads(json.dumps(asdict(spec)))


def torch_dtype_of(trt_dtype: Any) -> torch.dtype:
    """The torch dtype of a tensorrt.DataType."""
    import tensorrt as trt

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool, trt.int8: torch.int8}
    return table[trt_dtype]


def device_capability(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


class TensorRTLlamaRuntime(SlottedGraphRuntime):
    """DecoderRuntime over a TensorRT engine of the step graph, with torch CUDA tensors as buffers."""

    keeps_context = False  # a gather on the GPU costs little; the context buffer is numpy's

    def __init__(self, model_dir: str | Path, engine_dir: str | Path, num_slots: int, max_length: int | None = None,
                 device: str = "cuda", num_blocks: int | None = None, block_size: int | None = None) -> None:
        engine_dir = Path(os.path.expandvars(str(engine_dir)))
        meta = EngineMetadata.load(engine_dir)  # before touching CUDA: a missing build fails clearly anywhere
        spec = read_spec(model_dir)
        max_length = spec.served_length(max_length or meta.max_length)
        if not torch.cuda.is_available():
            raise RuntimeError("the tensorrt runtime needs a CUDA GPU; torch sees none")
        import tensorrt as trt

        torch_device = torch.device(device if device != "cpu" else "cuda")
        if torch_device.index is None:
            torch_device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(torch_device)
        meta.check(model_dir, max_length, trt.__version__, device_capability(torch_device))
        super().__init__(spec, num_slots, max_length, meta.dtype, torch_device, num_blocks, block_size,
                         read_proposal_vocab(model_dir, spec.vocab_size))
        self.meta = meta
        self.max_batch, self.max_step_tokens = meta.limits
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine((engine_dir / ENGINE_FILE).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not deserialize {engine_dir / ENGINE_FILE}")
        if self.engine.num_optimization_profiles != len(meta.profiles):
            raise ValueError(f"{engine_dir}: the plan has {self.engine.num_optimization_profiles} profiles, "
                             f"its metadata {len(meta.profiles)}")
        self._inputs = graph_inputs(spec)
        self._dtypes = {name: torch_dtype_of(self.engine.get_tensor_dtype(name)) for name in self._inputs + OUTPUTS}
        stream = torch.cuda.current_stream(self.device)
        self._contexts = []
        for index in range(self.engine.num_optimization_profiles):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(index, stream.cuda_stream)
            self._contexts.append(context)
        stream.synchronize()

    # ---- array hooks: the cache and every feed are torch tensors on the GPU ----
    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _index(self, values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), dtype=torch.long).to(self.device)

    def _mask(self, values: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(values).to(self.device)

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor, batch: int) -> torch.Tensor:
        layers, heads, _, dim = cache.shape
        return cache.index_select(2, rows).view(layers, heads, batch, -1, dim)

    def _new_rows(self, new: torch.Tensor) -> torch.Tensor:
        layers, heads, batch, width, dim = new.shape
        return new.reshape(layers, heads, batch * width, dim).to(self.dtype)

    def _features(self, values: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(values).to(self.device)

    def _logits_to_numpy(self, logits: torch.Tensor) -> np.ndarray:
        return logits.float().cpu().numpy()

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def _run(self, feeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, width = feeds["input_ids"].shape
        context = self._contexts[self.meta.select_profile(batch, width, feeds[f"{PAST_KEYS}_0"].shape[2])]
        stream = torch.cuda.current_stream(self.device)
        keep = []  # tensors converted here must live until the engine has read them
        for name in self._inputs:
            tensor = feeds[name]
            if tensor.dtype != self._dtypes[name] or not tensor.is_contiguous():
                tensor = tensor.to(self._dtypes[name]).contiguous()
                keep.append(tensor)
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in OUTPUTS:
            shape = tuple(context.get_tensor_shape(name))
            if any(size < 0 for size in shape):
                raise RuntimeError(f"TensorRT left output {name} unshaped: {shape}")
            tensor = torch.empty(shape, dtype=self._dtypes[name], device=self.device)
            context.set_tensor_address(name, tensor.data_ptr())
            outputs.append(tensor)
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        # The caller reads logits with .cpu() (a sync) and scatters the new KV on this same stream.
        logits, new_keys, new_values, hidden = outputs
        return logits, new_keys, new_values, hidden

