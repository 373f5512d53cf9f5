"""postprocessing: a chunk of output ids (with left context ids) -> text_output; statistics pass through.

It is also where a cancelled ensemble request becomes visible (Triton 2.51 creates every later step of a
cancelled ensemble request cancelled): the chunk's generation is marked abandoned so that speculative_decoding
stops it at its next iteration (specdec.liveness).
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.detokenize import decode_chunk
from specdec.liveness import AbandonedGenerations
from specdec.tokenizer import TextTokenizer
from specdec_triton.contract import INDEX_OUTPUTS, PASSED_THROUGH
from specdec_triton.tensors import error_response, model_parameters, tokenizer_dir


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.tokenizer = TextTokenizer(tokenizer_dir(args, model_parameters(args)))
        self.abandoned = AbandonedGenerations.for_this_server()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            if request.is_cancelled():
                generation_id = pb_utils.get_input_tensor_by_name(request, "generation_id")
                if generation_id is not None:
                    self.abandoned.mark(int(generation_id.as_numpy().reshape(-1)[0]))
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "the client cancelled the request", pb_utils.TritonError.CANCELLED)))
                continue
            try:
                def ids(name: str, req=request) -> list[int]:
                    tensor = pb_utils.get_input_tensor_by_name(req, name)
                    return [] if tensor is None else tensor.as_numpy().reshape(-1).tolist()

                text = decode_chunk(self.tokenizer.decode, ids("prefix_ids"), ids("output_ids"))
                # Flattened over batch x beam as TensorRT-LLM's postprocessing returns it: shape [1] (contract.py).
                outputs = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]
                for spec in PASSED_THROUGH:
                    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is not None:
                        outputs.append(pb_utils.Tensor(spec.name, tensor.as_numpy()))
                outputs += [pb_utils.Tensor(spec.name, np.zeros((1, 1), np.int32)) for spec in INDEX_OUTPUTS]
                responses.append(pb_utils.InferenceResponse(outputs))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses
