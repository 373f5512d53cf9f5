"""Client calls of the `ensemble` over gRPC (tritonclient, streaming or not) and HTTP (/generate, SSE).

Returns one `GenerationResult` with the text and the server's speculation statistics, plus client-side
timings (time to first token, total latency) that the benchmark harness uses.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

MODEL = "ensemble"
STAT_NAMES = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_output_tokens",
              "fallback_active", "total_verification_passes", "max_draft_depth")
INPUT_DTYPES = {
    "text_input": np.object_, "max_tokens": np.int32, "stream": np.bool_, "end_id": np.int32, "pad_id": np.int32,
    "temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "seed": np.uint64,
    "runtime_top_k": np.int32, "runtime_top_p": np.float32,
    "min_length": np.int32, "exclude_input_in_output": np.bool_, "num_draft_tokens": np.int32,
    "num_candidates": np.int32, "acceptance": np.object_, "verify_threshold": np.float32, "task": np.object_,
    "drafter": np.object_, "random_seed": np.uint64,
    "guided_decoding_guide_type": np.object_, "guided_decoding_guide": np.object_, "num_top_log_probs": np.int32,
    "min_p": np.float32,
    "beam_width": np.int32, "return_log_probs": np.bool_,
    "repetition_penalty": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32,
}
# Inputs that carry a list ([1, n]); the rest carry one value ([1, 1]).
LIST_INPUT_DTYPES = {"bad_words": np.object_, "stop_words": np.object_, "logit_bias_ids": np.int32,
                     "logit_bias_values": np.float32}


class GenerationError(RuntimeError):
    """The server answered with an error (message as the server wrote it)."""


@dataclass
class GenerationResult:
    text: str = ""
    chunks: list[str] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    time_to_first_token_s: float | None = None
    latency_s: float = 0.0
    drafter_used: str | None = None  # model | eagle | ngram | none (the ensemble's drafter_used output)
    # With return_log_probs (gRPC): each output token's id and log-probability, and cum_log_probs at the end.
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    cum_log_prob: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return int(self.stats.get("num_output_tokens", 0))

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.latency_s if self.latency_s else 0.0


def input_array(name: str, value: Any) -> np.ndarray:
    """An ensemble input as the [1, n] array Triton takes (n = 1 but for LIST_INPUT_DTYPES)."""
    if name in LIST_INPUT_DTYPES:
        values = list(value)
        dtype = LIST_INPUT_DTYPES[name]
        if dtype is np.object_:
            if not all(isinstance(item, str | bytes) for item in values):
                raise TypeError(f"{name} must be a list of text")
            values = [item.encode() if isinstance(item, str) else item for item in values]
        return np.array([values], dtype=dtype).reshape(1, -1)
    dtype = INPUT_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"unknown input {name}")
    if dtype is np.object_ and not isinstance(value, str | bytes):
        raise TypeError(f"{name} must be text, got {type(value).__name__}")  # numpy would send its repr
    return np.array([[value.encode() if isinstance(value, str) else value]], dtype=dtype)


def grpc_inputs(params: dict[str, Any]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in params.items():
        if value is None:
            continue
        array = input_array(name, value)
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _stats_from(result: Any) -> dict[str, float]:
    stats = {}
    for name in STAT_NAMES:
        value = result.as_numpy(name)
        if value is not None:
            stats[name] = float(value.reshape(-1)[0])
    return stats


def generate_grpc(url: str, params: dict[str, Any], on_text: Callable[[str], None] | None = None,
                  model: str = MODEL, timeout_s: float = 600.0,
                  client: grpcclient.InferenceServerClient | None = None) -> GenerationResult:
    """One request over a gRPC stream (works for stream true and false; decoupled models need a stream)."""
    owned = client is None
    client = client or grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    out = GenerationResult()
    started = time.perf_counter()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, grpc_inputs(params), enable_empty_final_response=False)
        while True:
            result, error = responses.get(timeout=timeout_s)
            if error is not None:
                raise GenerationError(str(error))
            text = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
            if text and out.time_to_first_token_s is None:
                out.time_to_first_token_s = time.perf_counter() - started
            out.chunks.append(text)
            if on_text:
                on_text(text)
            out.stats = _stats_from(result)
            drafter = result.as_numpy("drafter_used")
            if drafter is not None:
                out.drafter_used = drafter.reshape(-1)[0].decode()
            log_probs, token_ids = result.as_numpy("output_log_probs"), result.as_numpy("output_token_ids")
            if log_probs is not None and token_ids is not None and log_probs.size:
                out.log_probs += log_probs.reshape(-1).tolist()
                out.token_ids += token_ids.reshape(-1).tolist()
                out.cum_log_prob = float(result.as_numpy("cum_log_probs").reshape(-1)[0])
            final = result.get_response().parameters.get("triton_final_response")
            if final is None or final.bool_param:
                break
    finally:
        client.stop_stream()
        if owned:
            client.close()
    out.latency_s = time.perf_counter() - started
    out.text = "".join(out.chunks)
    return out


def generate_http(url: str, params: dict[str, Any], on_text: Callable[[str], None] | None = None,
                  model: str = MODEL, timeout_s: float = 600.0) -> GenerationResult:
    """POST /generate (one response) or /generate_stream (server-sent events) when params['stream']."""
    stream = bool(params.get("stream"))
    endpoint = f"http://{url}/v2/models/{model}/generate" + ("_stream" if stream else "")
    body = {k: v for k, v in params.items() if v is not None}
    out = GenerationResult()
    started = time.perf_counter()
    with requests.post(endpoint, json=body, stream=stream, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            raise GenerationError(f"HTTP {resp.status_code}: {resp.text}")
        events = (line[len(b"data: "):] for line in resp.iter_lines() if line.startswith(b"data: ")) if stream \
            else iter([resp.content])
        for raw in events:
            event = json.loads(raw)
            if "error" in event:
                raise GenerationError(event["error"])
            text = event.get("text_output", "")
            if text and out.time_to_first_token_s is None:
                out.time_to_first_token_s = time.perf_counter() - started
            out.chunks.append(text)
            if on_text:
                on_text(text)
            out.stats = {name: float(event[name]) for name in STAT_NAMES if name in event}
            out.drafter_used = event.get("drafter_used", out.drafter_used)
    out.latency_s = time.perf_counter() - started
    out.text = "".join(out.chunks)
    return out
