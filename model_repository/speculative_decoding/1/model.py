"""speculative_decoding: the decoupled speculate -> verify -> accept loop (specdec.generation) over BLS.

One asyncio task per request; each iteration streams a chunk of token ids that ends on a whole UTF-8
character (or, when not streaming, one response with all of them).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.detokenize import IncrementalDetokenizer
from specdec.errors import InvalidRequestError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.metrics import UNKNOWN_TASK, GenerationMetrics, ProcessMetrics, RequestTimer
from specdec.params import ServerLimits, parse_request
from specdec.tokenizer import TextTokenizer
from specdec_triton.bls import BlsModelBackend
from specdec_triton.contract import GENERATION_INPUTS
from specdec_triton.metrics import TritonMetricSink
from specdec_triton.tensors import (
    error_response,
    ids_tensor,
    model_parameters,
    read_inputs,
    tokenizer_dir,
    value_tensor,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def stats_tensors(stats: GenerationStats) -> list[Any]:
    return [
        value_tensor("acceptance_rate", stats.acceptance_rate, np.float32),
        value_tensor("total_accepted_draft_tokens", stats.accepted_draft_tokens, np.int32),
        value_tensor("total_draft_tokens", stats.draft_tokens, np.int32),
        value_tensor("num_output_tokens", stats.output_tokens, np.int32),
    ]


def chunk_response(prefix: list[int], chunk: list[int], stats: GenerationStats) -> Any:
    return pb_utils.InferenceResponse([ids_tensor("output_ids", chunk), ids_tensor("prefix_ids", prefix),
                                       *stats_tensors(stats)])


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        self.tokenizer = TextTokenizer(tokenizer_dir(args, params))
        self.limits = ServerLimits(
            max_tokens_limit=int(params["max_tokens_limit"]),
            max_draft_tokens=int(params["max_draft_tokens"]),
            max_candidates=int(params["max_candidates"]),
            default_num_draft_tokens=int(params["default_num_draft_tokens"]),
        )
        self.generator = SpeculativeGenerator(BlsModelBackend(), int(params["max_context_length"]))
        # At most as many live generations as KV slots: the rest wait here, not inside the decoders.
        self.slots = asyncio.Semaphore(int(params["max_concurrent_sequences"]))
        self.metric_sink = TritonMetricSink()
        self.metrics = GenerationMetrics(self.metric_sink, args["model_name"], args["model_instance_name"])
        self.process_metrics = ProcessMetrics(self.metric_sink, args["model_name"], args["model_instance_name"])

    async def execute(self, requests: list) -> None:
        await asyncio.gather(*(self._serve(request) for request in requests))

    async def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        timer = self.metrics.start(UNKNOWN_TASK)
        try:
            inputs = read_inputs(request, GENERATION_INPUTS)
            options = parse_request(inputs, self.limits)
            timer.task = options.task
            if "input_ids" not in inputs:
                raise InvalidRequestError("input_ids", "is required")
            prompt = inputs["input_ids"].reshape(-1).astype(np.int64).tolist()
            end_ids = frozenset([options.end_id]) if options.end_id is not None else self.tokenizer.end_ids
            generation = GenerationRequest(prompt, options.max_tokens, end_ids, options.num_draft_tokens,
                                           min_tokens=options.min_length)
            self.generator.validate(generation)
            async with self.slots:
                self.metrics.begin_generation()
                try:
                    reason = await self._generate(sender, generation, options.stream,
                                                  options.exclude_input_in_output, timer)
                finally:
                    self.metrics.end_generation()
            self.metrics.finish(timer, reason or "cancelled")
            self.process_metrics.update()
        except Exception as exc:
            self.metrics.finish(timer, "error", error=exc)
            if not isinstance(exc, InvalidRequestError):
                pb_utils.Logger.log_error(f"speculative_decoding: {type(exc).__name__}: {exc}")
            sender.send(error_response(exc), flags=FINAL)

    async def _generate(self, sender: Any, generation: GenerationRequest, stream: bool, exclude_input: bool,
                        timer: RequestTimer) -> str | None:
        """Run the generator and send its responses; returns the finish reason."""
        stats = timer.stats = GenerationStats()
        reason = None
        sequence_id = secrets.randbits(63) or 1
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode) if stream else None
        output: list[int] = []
        async for update in self.generator.generate(generation, sequence_id, stats, sender.is_cancelled):
            timer.tokens(len(update.token_ids))
            reason = update.finish_reason
            output.extend(update.token_ids)
            if detokenizer is None:
                continue
            piece = detokenizer.push(update.token_ids)
            if update.finished and piece is None:
                piece = detokenizer.flush()
            if update.finished:
                prefix, chunk = piece or ([], [])
                sender.send(chunk_response(prefix, chunk, stats), flags=FINAL)
            elif piece is not None:
                sender.send(chunk_response(*piece, stats))
        if detokenizer is None:
            ids = output if exclude_input else generation.prompt_ids + output
            sender.send(chunk_response([], ids, stats), flags=FINAL)
        return reason

    def finalize(self) -> None:
        self.metric_sink.close()
