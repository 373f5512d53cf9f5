"""ModelBackend over Triton BLS: each step is one async inference request to target_model / draft_model, or
with `pack_waves` a wave of target steps is one request (specdec.packing).

The sequence id travels as the request's correlation id and START/END as sequence flags, so Triton's
sequence batcher routes every step of a sequence to the instance that holds its KV slot.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.drafting.spec import DRAFTER_MODELS, ModelDrafterName
from specdec.engines import StepRequest, StepResult
from specdec.errors import SpecDecError
from specdec.packing import PackedResults, pack_steps, packable, unpack_results

from specdec_triton.contract import MODEL_NAMES, PACKED_SAMPLING, PACKED_STEPS
from specdec_triton.tensors import ids_tensor, value_tensor


class BlsModelBackend:
    """`pack_waves`: a wave's target steps that can (specdec.packing.packable) go as one request."""

    def __init__(self, target_model: str = MODEL_NAMES["target"], pack_waves: bool = False) -> None:
        self.target_model = target_model
        self.pack_waves = pack_waves

    async def target_step(self, request: StepRequest) -> StepResult:
        return await self._call(self.target_model, request)

    async def target_steps(self, requests: list[StepRequest]) -> list[StepResult]:
        packed = [i for i, step in enumerate(requests) if packable(step)] if self.pack_waves else []
        if len(packed) < 2:
            packed = []
        alone = sorted(set(range(len(requests))) - set(packed))
        outcomes = await asyncio.gather(self._call_packed([requests[i] for i in packed]),
                                        *(self._call(self.target_model, requests[i]) for i in alone))
        results: list[StepResult] = [StepResult()] * len(requests)
        for i, result in zip(packed + alone, outcomes[0] + list(outcomes[1:]), strict=True):
            results[i] = result
        return results

    async def _call_packed(self, steps: list[StepRequest]) -> list[StepResult]:
        """One request for the steps of several sequences, sent under the first one's sequence id."""
        if not steps:
            return []
        packed = pack_steps(steps)
        inputs = [pb_utils.Tensor(PACKED_STEPS.name, packed.table[None]),
                  pb_utils.Tensor(PACKED_SAMPLING.name, packed.sampling[None]),
                  ids_tensor("input_ids", packed.input_ids)]
        if len(packed.tree_parents):
            inputs.append(ids_tensor("tree_parents", packed.tree_parents))
        if len(packed.commit_rows):
            inputs.append(ids_tensor("commit_rows", packed.commit_rows))
        outputs = ["token_ids", "step_errors"]
        if any(step.want_logits for step in steps):
            outputs.append("logits")
        if any(step.num_hidden for step in steps):
            outputs.append("hidden_states")
        request = pb_utils.InferenceRequest(model_name=self.target_model, inputs=inputs,
                                            requested_output_names=outputs, correlation_id=steps[0].sequence_id)
        response: Any = await request.async_exec()
        if response.has_error():
            error = SpecDecError(response.error().message())
            return [StepResult(error=error) for _ in steps]

        def output(name: str) -> np.ndarray | None:
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            return None if tensor is None else tensor.as_numpy()[0]

        errors = output("step_errors")
        logits, hidden = output("logits"), output("hidden_states")
        return unpack_results(steps, PackedResults(
            output("token_ids").astype(np.int64), logits, hidden,
            [error.decode() if isinstance(error, bytes) else str(error) for error in errors],
        ))

    async def drafter_step(self, drafter: ModelDrafterName, request: StepRequest) -> StepResult:
        return await self._call(DRAFTER_MODELS[drafter], request)

    async def _call(self, model: str, step: StepRequest) -> StepResult:
        inputs = [ids_tensor("input_ids", step.input_ids), value_tensor("past_length", step.past_length, np.int32)]
        if step.num_logits != 1:
            inputs.append(value_tensor("num_logits", step.num_logits, np.int32))
        if step.num_hidden:
            inputs.append(value_tensor("num_hidden", step.num_hidden, np.int32))
        if step.num_steps != 1:
            inputs.append(value_tensor("num_steps", step.num_steps, np.int32))
        if step.features is not None:
            inputs.append(pb_utils.Tensor("features", np.asarray(step.features, np.float32).reshape(1, -1)))
        if step.num_draft_tokens:
            inputs.append(value_tensor("num_draft_tokens", step.num_draft_tokens, np.int32))
        if step.num_candidates != 1:
            inputs.append(value_tensor("num_candidates", step.num_candidates, np.int32))
        if step.min_confidence > 0:
            inputs.append(value_tensor("min_confidence", step.min_confidence, np.float32))
        if step.tree_nodes:
            inputs.append(value_tensor("tree_nodes", step.tree_nodes, np.int32))
        sampling = step.sampling
        if not sampling.greedy:
            inputs += [value_tensor("temperature", sampling.temperature, np.float32),
                       value_tensor("top_k", sampling.top_k, np.int32),
                       value_tensor("top_p", sampling.top_p, np.float32)]
            if sampling.seed is not None:
                inputs.append(value_tensor("seed", sampling.seed, np.uint64))
        if step.tree_parents is not None:
            inputs.append(ids_tensor("tree_parents", step.tree_parents))
        if step.commit_rows is not None:
            inputs.append(value_tensor("commit_base", step.commit_base, np.int32))
            inputs.append(ids_tensor("commit_rows", step.commit_rows))
        flags = 0
        if step.start:
            flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
        if step.end:
            flags |= pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END
        outputs = ["token_ids", "logits"] if step.want_logits else ["token_ids"]
        if step.num_hidden:
            outputs.append("hidden_states")
        if step.tree_nodes:
            outputs.append("draft_parents")
        request = pb_utils.InferenceRequest(
            model_name=model, inputs=inputs, requested_output_names=outputs,
            correlation_id=step.sequence_id, flags=flags,
        )
        response: Any = await request.async_exec()
        if response.has_error():
            return StepResult(error=SpecDecError(response.error().message()))
        token_ids = pb_utils.get_output_tensor_by_name(response, "token_ids")
        logits = pb_utils.get_output_tensor_by_name(response, "logits") if step.want_logits else None
        hidden = pb_utils.get_output_tensor_by_name(response, "hidden_states") if step.num_hidden else None
        parents = pb_utils.get_output_tensor_by_name(response, "draft_parents") if step.tree_nodes else None
        return StepResult(
            token_ids=token_ids.as_numpy().reshape(-1).astype(np.int64) if token_ids is not None else np.zeros(0),
            logits=logits.as_numpy()[0] if logits is not None else None,
            hidden=hidden.as_numpy()[0] if hidden is not None else None,
            parents=parents.as_numpy().reshape(-1).astype(np.int64) if parents is not None else None,
        )
