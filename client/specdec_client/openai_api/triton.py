"""The pipeline over tritonclient's asyncio gRPC client: one bidirectional stream per generation.

Every generation is streamed from Triton (stream true), also for a non-streamed OpenAI answer: the endpoint
can then stop at a stop sequence, and a cancelled call reaches the generation. Closing the iterator cancels
the gRPC call.

With the target's tokenizer at hand, the endpoint does the ensemble's two text steps itself and calls
`speculative_decoding` directly: it tokenizes the prompt as preprocessing does and decodes each response's
chunk as postprocessing does (the same TextTokenizer and `decode_chunk`), so a streamed token costs one Python
model and one hop less (under 16 streams the response path took ~0.5 of the 2 cores, postprocessing 0.12 of
it). It does so only after preprocessing answered a probe text with the ids the local tokenizer gives
(`TritonBackend.direct`); otherwise, and with `via_ensemble`, it calls the ensemble. A cancelled direct call
reaches the generation through its response sender (for an ensemble call postprocessing marks it abandoned,
docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from specdec.detokenize import decode_chunk
from specdec.tokenizer import TextTokenizer
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from specdec_client.api import INPUT_DTYPES, LIST_INPUT_DTYPES, input_array

STAT_NAMES = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "fallback_active",
              "total_verification_passes", "max_draft_depth")
# An error naming one of the ensemble's inputs ("max_tokens: must be in [1, 1024], got 5000") is the client's.
_FIELD_ERROR = re.compile(r"(?:^|[\s,'])(" + "|".join(["text_input", *INPUT_DTYPES, *LIST_INPUT_DTYPES]) + r"): ")
_BUSY = ("server busy", "KV slots", "maximum queue size", "queue timeout", "Request timeout expired", "deadline")
GENERATION_MODEL = "speculative_decoding"  # the ensemble's generation step, called directly (module docstring)
# Text the direct path checks the served tokenizer with: words, digits, spaces, accents, CJK and an emoji.
PROBE_TEXT = "Hello, world!  def f(x): return x ** 2  # Ärger, naïve 日本語 🙂 1234567"


@dataclass(frozen=True)
class TokenLogprob:
    """A token a response adds: its id, log-probability and its row's most probable (id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Chunk:
    """One response of the ensemble."""

    text: str
    num_input_tokens: int | None
    num_output_tokens: int  # tokens this response adds (return_num_output_tokens)
    stats: dict[str, float] = field(default_factory=dict)
    final: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with return_log_probs
    acceptance_histogram: list[int] = field(default_factory=list)  # [j]: verifications that accepted j drafts


def _logprobs(result: Any) -> list[TokenLogprob]:
    """The ensemble's LOGPROB_OUTPUTS of one response (empty where it carries none)."""
    values, tokens = result.as_numpy("output_log_probs"), result.as_numpy("output_token_ids")
    if values is None or tokens is None or not values.size:
        return []
    top_ids, top_values = result.as_numpy("top_log_prob_ids"), result.as_numpy("top_log_probs")
    count = values.size
    top_ids = top_ids.reshape(count, -1) if top_ids is not None else np.zeros((count, 0), np.int32)
    top_values = top_values.reshape(count, -1) if top_values is not None else np.zeros((count, 0), np.float32)
    return [TokenLogprob(int(token), float(value), tuple((int(t), float(v)) for t, v in zip(ids, lps, strict=True)
                                                         if np.isfinite(v)))
            for token, value, ids, lps in zip(tokens.reshape(-1), values.reshape(-1), top_ids, top_values,
                                              strict=True)]


class BackendError(Exception):
    """Triton answered with an error; `status` is the HTTP status the endpoint answers with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def classify(message: str) -> int:
    """HTTP status for a Triton error message (a stream's errors carry no code)."""
    if _FIELD_ERROR.search(message):
        return 400
    if any(marker in message for marker in _BUSY):
        return 503
    return 500


def _array_tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def _tensor(name: str, value: Any) -> grpcclient.InferInput:
    if name in LIST_INPUT_DTYPES or name in INPUT_DTYPES:
        return _array_tensor(name, input_array(name, value))
    return _array_tensor(name, np.array([[value]], dtype=np.bool_))  # the endpoint's own flags (stream, return_*)


def _ints(result: Any, name: str) -> list[int]:
    value = result.as_numpy(name)
    return [] if value is None else [int(v) for v in value.reshape(-1)]


def _scalar(result: Any, name: str) -> float | None:
    value = result.as_numpy(name)
    return None if value is None or not value.size else value.reshape(-1)[0].item()


class TritonBackend:
    """Generations and health of one ensemble on one tritonserver. `tokenizer_dir`: the target's tokenizer, for
    calling the generation step directly (module docstring); `via_ensemble`: always call the ensemble."""

    def __init__(self, url: str, model: str = "ensemble", tokenizer_dir: str | Path | None = None,
                 via_ensemble: bool = False) -> None:
        self.url, self.model = url, model
        self._client: grpcclient.InferenceServerClient | None = None
        self.tokenizer = (TextTokenizer(tokenizer_dir) if tokenizer_dir is not None and not via_ensemble
                          and model == "ensemble" else None)
        self._direct: bool | None = None  # decided at the first generation
        self._max_input_bytes = 0

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:  # made inside the running event loop
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_server_ready() and await self.client.is_model_ready(self.model))
        except InferenceServerException:
            return False

    async def max_tokens_limit(self) -> int | None:
        """speculative_decoding's max_tokens_limit parameter, when the server answers."""
        try:
            config = await self.client.get_model_config("speculative_decoding", as_json=True)
        except InferenceServerException:
            return None
        value = config.get("config", {}).get("parameters", {}).get("max_tokens_limit", {}).get("string_value")
        return int(value) if value else None

    async def direct(self) -> bool:
        """Whether generations go to the generation step directly: the tokenizer is here and preprocessing
        tokenizes the probe text as it does (decided once, when the server first answers)."""
        if self._direct is None and self.tokenizer is not None:
            try:
                probe = grpcclient.InferInput("text_input", [1, 1], "BYTES")
                probe.set_data_from_numpy(np.array([[PROBE_TEXT.encode()]], dtype=np.object_))
                served = await self.client.infer("preprocessing", [probe])
                config = await self.client.get_model_config("preprocessing", as_json=True)
            except InferenceServerException:
                return False  # not answering yet: decided at a later generation
            parameters = config.get("config", {}).get("parameters", {})
            self._max_input_bytes = int(parameters.get("max_input_bytes", {}).get("string_value") or 0)
            self._direct = (_ints(served, "input_ids") == self.tokenizer.encode(PROBE_TEXT)
                            and self._max_input_bytes > 0)
        return bool(self._direct)

    def _prompt_ids(self, text_input: str) -> np.ndarray:
        """The prompt's ids as preprocessing makes them, with its checks and messages."""
        assert self.tokenizer is not None
        size = len(text_input.encode("utf-8"))
        if size > self._max_input_bytes:
            raise BackendError(f"text_input: {size} bytes exceeds the limit of {self._max_input_bytes}", 400)
        ids = self.tokenizer.encode(text_input)
        if not text_input or not ids:
            raise BackendError("text_input: the prompt is empty", 400)
        return np.asarray([ids], dtype=np.int32)

    async def stream(self, text_input: str, max_tokens: int, options: dict[str, Any]) -> AsyncIterator[Chunk]:
        """The pipeline's responses for one prompt; raises BackendError for an error response."""
        params = {"max_tokens": max_tokens, "stream": True,
                  "exclude_input_in_output": True, **{k: v for k, v in options.items() if v is not None},
                  "return_num_input_tokens": True, "return_num_output_tokens": True}
        direct = await self.direct()
        if direct:
            ids = self._prompt_ids(text_input)
            inputs = [_array_tensor("input_ids", ids),
                      _array_tensor("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32))]
        else:
            inputs = [_tensor("text_input", text_input)]
        inputs += [_tensor(name, value) for name, value in params.items()]
        model = GENERATION_MODEL if direct else self.model
        done = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": inputs}
            await done.wait()  # keep the stream open until the last response

        call = self.client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    message = error.message() if isinstance(error, InferenceServerException) else str(error)
                    raise BackendError(message, classify(message))
                final = result.get_response().parameters.get("triton_final_response")
                num_input = _scalar(result, "num_input_tokens")
                yield Chunk(
                    text=self._text_of(result, direct),
                    num_input_tokens=None if num_input is None else int(num_input),
                    num_output_tokens=int(_scalar(result, "num_output_tokens") or 0),
                    stats={name: value for name in STAT_NAMES if (value := _scalar(result, name)) is not None},
                    final=final is None or final.bool_param,
                    logprobs=_logprobs(result),
                    acceptance_histogram=_ints(result, "acceptance_histogram"),
                )
                if final is None or final.bool_param:
                    return
        except grpc.RpcError as exc:  # the server is gone or unreachable
            raise BackendError(f"tritonserver at {self.url} did not answer: {exc.code().name}", 503) from exc
        finally:
            done.set()
            call.cancel()  # a no-op after the last response; stops the generation otherwise

    def _text_of(self, result: Any, direct: bool) -> str:
        """A response's text: decoded here from its ids (direct), else the ensemble's text_output."""
        if direct:
            assert self.tokenizer is not None
            return decode_chunk(self.tokenizer.decode, _ints(result, "prefix_ids"), _ints(result, "output_ids"))
        text = result.as_numpy("text_output")
        return text.reshape(-1)[0].decode("utf-8") if text is not None and text.size else ""
