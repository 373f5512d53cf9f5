"""The ensemble driven exactly as the clients of Triton's LLM ecosystem drive a TensorRT-LLM ensemble.

- TensorRT-LLM's inflight_batcher_llm/client/end_to_end_grpc_client.py: `[1, 1]` inputs (text_input,
  max_tokens, stream, beam_width, temperature, exclude_input_in_output), one gRPC stream per request closed
  with stop_stream(), `as_numpy("text_output")[0].decode()`, `batch_index` / `sequence_index` read as `[0][0]`.
- Triton's OpenAI frontend (server repo python/openai, engine/utils/triton.py, TensorRT-LLM request format):
  also return_num_input_tokens / return_num_output_tokens; it needs exactly one text_output element per
  response, INT32 or UINT32 counts, one final response when not streaming, and sums num_output_tokens over
  a stream.
"""

from __future__ import annotations

import queue
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from specdec_client.api import generate_grpc
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

pytestmark = pytest.mark.integration
PROMPT = "def fibonacci(n):"
OUTPUT_LEN = 24


def prepare_tensor(name: str, value: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
    tensor.set_data_from_numpy(value)
    return tensor


def e2e_client_inputs(prompt: str, streaming: bool, temperature: float = 1.0) -> dict[str, np.ndarray]:
    """What end_to_end_grpc_client.prepare_inputs builds with its default flags."""
    input0 = [[prompt]]
    return {
        "text_input": np.array(input0).astype(object),
        "max_tokens": np.ones_like(input0).astype(np.int32) * OUTPUT_LEN,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
        "exclude_input_in_output": np.array([[False]], dtype=bool),
    }


def run_like_e2e_client(url: str, inputs: dict[str, np.ndarray], streaming: bool,
                        output_names: tuple[str, ...] = ("text_output",)) -> tuple[str, list]:
    """end_to_end_grpc_client.run_inference for one prompt: returns (text, errors)."""
    client = grpcclient.InferenceServerClient(url=url)
    completed: queue.Queue = queue.Queue()

    def callback(user_data, result, error):
        user_data.put(error if error else result)

    outputs = [grpcclient.InferRequestedOutput(name) for name in output_names]
    try:
        client.start_stream(callback=partial(callback, completed))
        client.async_stream_infer("ensemble", [prepare_tensor(k, v) for k, v in inputs.items()], outputs=outputs,
                                  request_id="")
        client.stop_stream()  # waits for the server to close the stream
    finally:
        client.close()
    texts = [[""]]
    errors = []
    while not completed.empty():
        result = completed.get()
        if isinstance(result, InferenceServerException):
            errors.append(result)
            continue
        output = result.as_numpy("text_output")
        batch_index = result.as_numpy("batch_index")
        batch_index = 0 if batch_index is None else batch_index[0][0]
        seq_index = result.as_numpy("sequence_index")
        seq_index = 0 if seq_index is None else seq_index[0][0]
        if streaming:
            texts[batch_index][seq_index] += output[0].decode("utf-8")
        else:
            texts[batch_index][seq_index] = output[0].decode("utf-8")
    return texts[0][0], errors


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("streaming", [False, True])
def test_end_to_end_grpc_client_gets_greedy_text(server, streaming, temperature):
    """Its default flags (temperature 1.0, no top_k / top_p, the prompt echoed when not streaming) mean greedy
    search in TensorRT-LLM, whatever the temperature: the text equals our greedy answer."""
    inputs = e2e_client_inputs(PROMPT, streaming, temperature=temperature)
    text, errors = run_like_e2e_client(server.grpc_url, inputs, streaming,
                                       output_names=("text_output", "batch_index", "sequence_index"))
    assert not errors
    ours = generate_grpc(server.grpc_url, {"text_input": PROMPT, "max_tokens": OUTPUT_LEN, "stream": streaming,
                                           "exclude_input_in_output": True}).text
    assert text == (ours if streaming else PROMPT + ours)


def test_runtime_top_k_and_top_p_sample_under_either_name(server):
    """top_k or top_p set (either spelling) samples at the temperature; a seed makes it reproducible."""
    def text(**extra: np.ndarray) -> str:
        inputs = {**e2e_client_inputs(PROMPT, False, temperature=1.0), "random_seed": np.uint64([[3]]), **extra}
        got, errors = run_like_e2e_client(server.grpc_url, inputs, False)
        assert not errors
        return got

    greedy = text()
    by_top_p = text(top_p=np.float32([[1.0]]))
    assert text(runtime_top_p=np.float32([[1.0]])) == by_top_p
    assert by_top_p != greedy  # sampled at temperature 1.0 (this prompt and seed: measured to differ)
    assert text(runtime_top_k=np.int32([[1]])) == greedy  # the single most probable token: greedy again
    _, errors = run_like_e2e_client(server.grpc_url, {**e2e_client_inputs(PROMPT, False), "top_p": np.float32([[0.5]]),
                                                      "runtime_top_p": np.float32([[0.9]])}, False)
    assert len(errors) == 1 and "runtime_top_p" in str(errors[0])


def test_text_output_is_flat_and_indices_are_declared(server):
    for stream in (False, True):
        for result in stream_responses(server.grpc_url, e2e_client_inputs(PROMPT, stream, temperature=0.0)):
            assert result.as_numpy("text_output").shape == (1,)
            assert result.as_numpy("batch_index").tolist() == [[0]]
            assert result.as_numpy("sequence_index").tolist() == [[0]]


def test_unsupported_client_options_fail_clearly(server):
    inputs = e2e_client_inputs(PROMPT, False)
    inputs["beam_width"] = np.array([[2]], dtype=np.int32)
    _, errors = run_like_e2e_client(server.grpc_url, inputs, False)
    assert len(errors) == 1 and "beam_width" in str(errors[0])
    two_prompts = {name: np.concatenate([value, value]) for name, value in e2e_client_inputs(PROMPT, False).items()}
    _, errors = run_like_e2e_client(server.grpc_url, two_prompts, False, ("text_output", "batch_index"))
    assert len(errors) == 1 and "one prompt" in str(errors[0])


def frontend_request(prompt: str, stream: bool, **extra: np.ndarray) -> dict[str, np.ndarray]:
    """_create_trtllm_generate_request of Triton's OpenAI frontend (completions, echo false)."""
    return {
        "text_input": np.array([[prompt]], dtype=object),
        "stream": np.bool_([[stream]]),
        "max_tokens": np.int32([[OUTPUT_LEN]]),
        "exclude_input_in_output": np.bool_([[True]]),
        **extra,
        "return_num_input_tokens": np.bool_([[True]]),
        "return_num_output_tokens": np.bool_([[True]]),
    }


def stream_responses(url: str, inputs: dict[str, np.ndarray]) -> list:
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    got = []
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("ensemble", [prepare_tensor(k, v) for k, v in inputs.items()],
                                  enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, str(error)
            got.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_openai_frontend_contract(server):
    tokenizer = AutoTokenizer.from_pretrained(Path(server.model_repository) / "target_model" / "1")
    sampling = {"temperature": np.float32([[0.0]]), "top_p": np.float32([[1.0]]), "seed": np.uint64([[7]])}
    whole = stream_responses(server.grpc_url, frontend_request(PROMPT, False, **sampling))
    assert len(whole) == 1  # one response, final (no empty final response follows)
    (response,) = whole
    assert response.as_numpy("text_output").size == 1
    assert response.as_numpy("num_input_tokens").dtype == np.int32
    assert int(response.as_numpy("num_input_tokens")[0][0]) == len(tokenizer(PROMPT).input_ids)
    total = int(response.as_numpy("num_output_tokens")[0][0])
    assert 0 < total <= OUTPUT_LEN

    chunks = stream_responses(server.grpc_url, frontend_request(PROMPT, True, **sampling))
    assert all(r.as_numpy("text_output").size == 1 for r in chunks)
    # The frontend adds up num_output_tokens over a stream (usage.completion_tokens).
    assert sum(int(r.as_numpy("num_output_tokens")[0][0]) for r in chunks) == total
    streamed = "".join(r.as_numpy("text_output")[0].decode() for r in chunks)
    assert streamed == response.as_numpy("text_output")[0].decode()
