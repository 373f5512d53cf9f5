"""Moving tensors between pb_utils objects and plain numpy / core dataclasses."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.errors import CapacityError, InvalidRequestError, SpecDecError

from specdec_triton.contract import TensorSpec


def model_parameters(args: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as a flat dict of strings."""
    config = json.loads(args["model_config"])
    return {key: value["string_value"] for key, value in config.get("parameters", {}).items()}


def model_dir(args: dict) -> Path:
    """The model's version folder (holds model.py and, for decoders, the checkpoint)."""
    return Path(args["model_repository"]) / str(args["model_version"])


def read_inputs(request: Any, specs: Iterable[TensorSpec]) -> dict[str, np.ndarray]:
    """Every input of `specs` present in the request, as numpy arrays (absent optional inputs are left out)."""
    values = {}
    for spec in specs:
        tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
        if tensor is not None:
            values[spec.name] = tensor.as_numpy()
    return values


def scalar(request: Any, name: str, default: Any = None) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    return tensor.as_numpy().reshape(-1)[0].item()


def ids_tensor(name: str, ids: Iterable[int] | np.ndarray) -> Any:
    """A [1, n] INT32 tensor (batch dimension of 1, as max_batch_size > 0 models expect)."""
    return pb_utils.Tensor(name, np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids,
                                            dtype=np.int32).reshape(1, -1))


def value_tensor(name: str, value: Any, dtype: Any) -> Any:
    return pb_utils.Tensor(name, np.asarray([[value]], dtype=dtype))


def check_token_ids(ids: np.ndarray, vocab_size: int, name: str = "input_ids") -> None:
    """Token ids from a request must index the vocabulary (an out-of-range id would fail a whole batch)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InvalidRequestError(name, f"token ids must be in [0, {vocab_size})")


def error_response(exc: BaseException) -> Any:
    """An error response whose code tells the client whose fault it is."""
    if isinstance(exc, InvalidRequestError):
        code = pb_utils.TritonError.INVALID_ARG
    elif isinstance(exc, CapacityError):
        code = pb_utils.TritonError.UNAVAILABLE
    else:
        code = pb_utils.TritonError.INTERNAL
    message = str(exc) if isinstance(exc, SpecDecError) else f"internal error: {exc}"
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def tokenizer_dir(args: dict, params: dict[str, str]) -> Path:
    """The tokenizer folder named by the `tokenizer_dir` parameter, relative to this model's folder."""
    return (Path(args["model_repository"]) / params["tokenizer_dir"]).resolve()
