"""postprocessing: a chunk of output ids (with left context ids) -> text_output; statistics pass through."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.detokenize import decode_chunk
from specdec.tokenizer import TextTokenizer
from specdec_triton.contract import STATS_OUTPUTS
from specdec_triton.tensors import error_response, model_parameters, tokenizer_dir


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.tokenizer = TextTokenizer(tokenizer_dir(args, model_parameters(args)))

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                def ids(name: str, req=request) -> list[int]:
                    tensor = pb_utils.get_input_tensor_by_name(req, name)
                    return [] if tensor is None else tensor.as_numpy().reshape(-1).tolist()

                text = decode_chunk(self.tokenizer.decode, ids("prefix_ids"), ids("output_ids"))
                outputs = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object))]
                for spec in STATS_OUTPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is not None:
                        outputs.append(pb_utils.Tensor(spec.name, tensor.as_numpy()))
                responses.append(pb_utils.InferenceResponse(outputs))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses
