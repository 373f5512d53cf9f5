"""preprocessing: text_input (UTF-8 bytes) -> input_ids, input_lengths."""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.errors import InvalidRequestError
from specdec.tokenizer import TextTokenizer
from specdec_triton.tensors import error_response, ids_tensor, model_parameters, tokenizer_dir, value_tensor


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        self.tokenizer = TextTokenizer(tokenizer_dir(args, params))
        self.max_input_bytes = int(params["max_input_bytes"])

    def _encode(self, request) -> list[int]:
        tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
        values = tensor.as_numpy().reshape(-1)
        if values.size != 1:
            raise InvalidRequestError("text_input", f"expected one prompt, got {values.size}")
        raw = values[0]
        if not isinstance(raw, bytes):
            raw = str(raw).encode()
        if len(raw) > self.max_input_bytes:
            raise InvalidRequestError("text_input", f"{len(raw)} bytes exceeds the limit of {self.max_input_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError("text_input", f"is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
        ids = self.tokenizer.encode(text)
        if not text or not ids:
            raise InvalidRequestError("text_input", "the prompt is empty")
        return ids

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                ids = self._encode(request)
                responses.append(pb_utils.InferenceResponse(
                    [ids_tensor("input_ids", ids), value_tensor("input_lengths", len(ids), np.int32)]
                ))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses
