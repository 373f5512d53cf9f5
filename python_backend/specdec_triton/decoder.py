"""The Triton adapter of `target_model`, `draft_model` and `eagle_draft`: tensors in, engine step, tensors out.

Both are sequence-batched Python models: Triton delivers START/END/CORRID controls and groups steps of
different sequences into one execute(), which the engine serves with one padded forward. target_model also
takes a packed request carrying a wave of steps of several sequences (specdec.packing). The KV pool's size comes
from the deployment's budget for the pair (`kv_pool`, specdec.kv_memory.KVPoolConfig).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.engines import DraftEngine, StepRequest, StepResult, TargetEngine
from specdec.errors import InvalidRequestError
from specdec.kv_memory import KVPoolConfig
from specdec.metrics import KV_BLOCKS_IN_USE, KV_BYTES_IN_USE, KV_SLOTS_IN_USE, BatchCounter, ProcessMetrics
from specdec.packing import PackedSteps, pack_results, unpack_steps
from specdec.runtime import build_served_runtime
from specdec.runtime.heap import keep_freed_memory
from specdec.sampling import SamplingParams

from specdec_triton import contract as c
from specdec_triton.contract import PACKED_SAMPLING, PACKED_STEPS
from specdec_triton.metrics import TritonMetricSink
from specdec_triton.tensors import (
    check_token_ids,
    error_response,
    ids_tensor,
    model_dir,
    model_parameters,
    scalar,
)


def read_step(request: Any) -> StepRequest:
    def ids(name: str) -> np.ndarray | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy().reshape(-1).astype(np.int64)

    input_ids = ids("input_ids")
    if input_ids is None:
        raise InvalidRequestError("input_ids", "is required")
    features = pb_utils.get_input_tensor_by_name(request, "features")
    if features is not None:
        flat = features.as_numpy().reshape(-1).astype(np.float32)
        if len(input_ids) == 0 or flat.size % len(input_ids):
            raise InvalidRequestError("features", f"{flat.size} values do not split over {len(input_ids)} tokens")
        features = flat.reshape(len(input_ids), -1)
    return StepRequest(
        sequence_id=int(scalar(request, c.CONTROL_CORRID)),
        past_length=int(scalar(request, "past_length", 0)),
        input_ids=input_ids,
        start=bool(scalar(request, c.CONTROL_START, 0)),
        end=bool(scalar(request, c.CONTROL_END, 0)),
        num_logits=int(scalar(request, "num_logits", 1)),
        tree_parents=ids("tree_parents"),
        commit_base=int(scalar(request, "commit_base", 0)),
        commit_rows=ids("commit_rows"),
        num_draft_tokens=int(scalar(request, "num_draft_tokens", 0)),
        num_candidates=int(scalar(request, "num_candidates", 1)),
        min_confidence=float(scalar(request, "min_confidence", 0.0)),
        tree_nodes=int(scalar(request, "tree_nodes", 0)),
        sampling=SamplingParams(float(scalar(request, "temperature", 0.0)), int(scalar(request, "top_k", 0)),
                                float(scalar(request, "top_p", 1.0)), scalar(request, "seed", None)),
        want_logits="logits" in request.requested_output_names(),
        num_hidden=int(scalar(request, "num_hidden", 0)),
        features=features,
        num_steps=int(scalar(request, "num_steps", 1)),
    )


def read_packed_steps(request: Any, table: np.ndarray) -> list[StepRequest]:
    """The steps of a packed wave (specdec.packing): the step table and the steps' values concatenated."""
    def values(name: str) -> np.ndarray:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return np.zeros(0, np.int64) if tensor is None else tensor.as_numpy().reshape(-1).astype(np.int64)

    sampling = pb_utils.get_input_tensor_by_name(request, PACKED_SAMPLING.name)
    if sampling is None:
        raise InvalidRequestError(PACKED_SAMPLING.name, "is required with steps")
    sampling = sampling.as_numpy()
    return unpack_steps(PackedSteps(
        table.reshape(-1, table.shape[-1]) if table.ndim >= 2 else table, values("input_ids"),
        values("tree_parents"), values("commit_rows"),
        sampling.reshape(-1, sampling.shape[-1]) if sampling.ndim >= 2 else sampling))


def write_packed_results(steps: list[StepRequest], results: list[StepResult]) -> Any:
    packed = pack_results(steps, results)
    outputs = [ids_tensor("token_ids", packed.token_ids),
               pb_utils.Tensor("step_errors", np.array([[error.encode() for error in packed.errors]], dtype=object))]
    if packed.logits is not None:
        outputs.append(pb_utils.Tensor("logits", packed.logits.astype(np.float32)[None]))
    if packed.hidden is not None:
        outputs.append(pb_utils.Tensor("hidden_states", packed.hidden.astype(np.float32)[None]))
    return pb_utils.InferenceResponse(output_tensors=outputs)


def write_result(result: StepResult) -> Any:
    if result.error is not None:
        return error_response(result.error)
    outputs = [ids_tensor("token_ids", result.token_ids)]
    if result.logits is not None:
        outputs.append(pb_utils.Tensor("logits", result.logits.astype(np.float32)[None]))
    if result.hidden is not None:
        outputs.append(pb_utils.Tensor("hidden_states", result.hidden.astype(np.float32)[None]))
    if result.parents is not None:
        outputs.append(ids_tensor("draft_parents", result.parents))
    return pb_utils.InferenceResponse(output_tensors=outputs)


class DecoderModel:
    """TritonPythonModel for every decoder; the `role` parameter picks target, or draft (draft and eagle:
    the EAGLE head is a draft whose runtime reads features)."""

    def initialize(self, args: dict) -> None:
        if not keep_freed_memory():
            pb_utils.Logger.log_warn(f"{args['model_name']}: not glibc; freed memory goes back to the kernel")
        params = model_parameters(args)
        device = params.get("device", "cpu")
        if device == "cuda" and args.get("model_instance_kind") == "GPU":  # the GPU of this instance (`gpus`)
            device = f"cuda:{args['model_instance_device_id']}"
        pool = KVPoolConfig.from_json(params["kv_pool"], args["model_repository"]) if "kv_pool" in params else None
        runtime, quantization, why = build_served_runtime(
            params.get("runtime", "torch"), model_dir(args), params["role"], params.get("weight_quantization"),
            num_slots=int(params["num_slots"]), max_length=int(params["max_length"]), device=device,
            num_threads=int(params.get("num_threads", 1)), engine_dir=params.get("engine_dir"),
            num_blocks=pool.num_blocks() if pool else None, block_size=pool.block_size if pool else None,
        )
        pb_utils.Logger.log_info(f"{args['model_name']}: weights {quantization or 'as exported'} ({why})")
        engine_class = DraftEngine if params["role"] in ("draft", "eagle") else TargetEngine
        self.engine = engine_class(runtime, idle_timeout_s=float(params["idle_timeout_s"]))
        self.metric_sink = TritonMetricSink()
        engine = self.engine
        self.batches = BatchCounter()
        self.metrics = ProcessMetrics(self.metric_sink, args["model_name"], args["model_instance_name"],
                                      gauges={KV_SLOTS_IN_USE: lambda: engine.slots_in_use,
                                              KV_BLOCKS_IN_USE: lambda: engine.kv_blocks_in_use,
                                              KV_BYTES_IN_USE: lambda: engine.kv_bytes_in_use},
                                      num_slots=runtime.num_slots, kv_cache_bytes=runtime.kv_cache_bytes,
                                      kv_blocks=runtime.kv.num_blocks, batches=self.batches)

    def execute(self, requests: list) -> list:
        """Every step of every request (a packed request carries a wave of them) in one engine step."""
        responses: list[Any] = [None] * len(requests)
        steps: list[StepRequest] = []
        served: list[tuple[int, slice, bool]] = []  # (request, its steps, packed)
        for i, request in enumerate(requests):
            try:
                table = pb_utils.get_input_tensor_by_name(request, PACKED_STEPS.name)
                own = [read_step(request)] if table is None else read_packed_steps(request, table.as_numpy())
                for step in own:
                    check_token_ids(step.input_ids, self.engine.runtime.vocab_size)
                served.append((i, slice(len(steps), len(steps) + len(own)), table is not None))
                steps += own
            except Exception as exc:  # malformed call: answer it, serve the others
                responses[i] = error_response(exc)
        self.batches.count(sum(1 for step in steps if len(step.input_ids)))  # forwards, not bare END calls
        try:
            results = self.engine.step(steps)
        except Exception as exc:
            pb_utils.Logger.log_error(f"forward failed: {exc}")
            for i, _, _ in served:
                responses[i] = error_response(exc)
            return responses
        for i, own, packed in served:
            responses[i] = write_packed_results(steps[own], results[own]) if packed else write_result(results[own][0])
        return responses

    def finalize(self) -> None:
        self.metrics.close()
        self.engine = None
        self.metric_sink.close()
