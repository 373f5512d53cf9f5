"""speculative_decoding: the decoupled speculate -> verify -> accept loop (specdec.generation) over BLS.

One asyncio task per request; each iteration streams a chunk of token ids that ends on a whole UTF-8
character (or, when not streaming, one response with all of them).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
from specdec.adaptive import CostModel
from specdec.admission import Admission, CancelledWhileQueued
from specdec.config import SpeculationConfig, drafters_served, resolve
from specdec.detokenize import IncrementalDetokenizer
from specdec.errors import DeadlineExceededError, InvalidRequestError
from specdec.fallback import FallbackMonitor
from specdec.generation import (
    DEFAULT_PREFILL_CHUNK,
    GenerationRequest,
    GenerationStats,
    GenerationUpdate,
    SpeculativeGenerator,
)
from specdec.grammar import Grammars
from specdec.kv_memory import DEFAULT_BLOCK_SIZE, KVPoolConfig
from specdec.liveness import AbandonedGenerations, StopCheck, generation_deadline_s
from specdec.logits_processing import LogitsOptions
from specdec.logprobs import TokenLogprob
from specdec.metrics import ACTIVE_REQUESTS, UNKNOWN_TASK, GenerationMetrics, ProcessMetrics, RequestTimer
from specdec.params import RequestOptions, ServerLimits, parse_request
from specdec.tokenizer import TextTokenizer
from specdec_triton.bls import BlsModelBackend
from specdec_triton.contract import GENERATION_INPUTS, MODEL_NAMES
from specdec_triton.metrics import TritonMetricSink
from specdec_triton.tensors import (
    check_token_ids,
    error_response,
    ids_tensor,
    model_dir,
    model_parameters,
    read_inputs,
    tokenizer_dir,
    value_tensor,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def stats_tensors(stats: GenerationStats, num_input_tokens: int, num_output_tokens: int) -> list[Any]:
    return [
        value_tensor("acceptance_rate", stats.acceptance_rate, np.float32),
        value_tensor("total_accepted_draft_tokens", stats.accepted_draft_tokens, np.int32),
        value_tensor("total_draft_tokens", stats.draft_tokens, np.int32),
        value_tensor("num_output_tokens", num_output_tokens, np.int32),
        # Plain decoding instead of speculation: by the acceptance monitor, or because draft_model failed.
        value_tensor("fallback_active", stats.fallback_active or stats.draft_failures > 0, np.bool_),
        value_tensor("num_input_tokens", num_input_tokens, np.int32),
        pb_utils.Tensor("drafter_used", np.array([[stats.drafter.encode()]], dtype=object)),
        value_tensor("total_verification_passes", stats.verification_passes, np.int32),
        ids_tensor("acceptance_histogram", stats.acceptance_histogram),
        value_tensor("max_draft_depth", len(stats.accepted_per_position), np.int32),
    ]


class Responder:
    """Builds a generation's responses: token chunks plus statistics, and the log-probabilities of the tokens
    each response adds (`logprobs`: one per output token so far, where asked)."""

    def __init__(self, stats: GenerationStats, num_input_tokens: int, per_response: bool, generation_id: int,
                 top_log_probs: int | None = None):
        self.stats, self.num_input_tokens, self.per_response = stats, num_input_tokens, per_response
        self.generation_id = generation_id
        self.top = top_log_probs
        self.tokens: list[int] = []  # the output so far
        self.logprobs: list[TokenLogprob] = []
        self.sent = 0  # output tokens whose log-probabilities went out
        self.cumulative = 0.0

    def later(self, prefix: list[int], chunk: list[int], new_tokens: int) -> Callable[[], Any]:
        """The response, built when it is sent (off the path to the next wave: ResponseQueue) from the
        statistics as they are now. `new_tokens`: generated tokens this response adds (num_output_tokens with
        return_num_output_tokens)."""
        stats = replace(self.stats, acceptance_histogram=list(self.stats.acceptance_histogram),
                        accepted_per_position=list(self.stats.accepted_per_position))
        return lambda: self._response(prefix, chunk, new_tokens, stats)

    def _response(self, prefix: list[int], chunk: list[int], new_tokens: int, stats: GenerationStats) -> Any:
        count = new_tokens if self.per_response else stats.output_tokens
        return pb_utils.InferenceResponse([
            ids_tensor("output_ids", chunk), ids_tensor("prefix_ids", prefix),
            *stats_tensors(stats, self.num_input_tokens, count),
            *self._logprob_tensors(new_tokens),
            pb_utils.Tensor("generation_id", np.array([[self.generation_id]], np.uint64)),
        ])

    def add(self, update: GenerationUpdate) -> None:
        self.tokens.extend(update.token_ids)
        self.logprobs.extend(update.logprobs or [])

    def _logprob_tensors(self, new_tokens: int) -> list[Any]:
        """LOGPROB_OUTPUTS for the next `new_tokens` output tokens (empty where not asked)."""
        entries = self.logprobs[self.sent:self.sent + new_tokens] if self.top is not None else []
        self.sent += len(entries)
        values = np.asarray([e.logprob for e in entries], np.float32)
        self.cumulative += float(values.astype(np.float64).sum())
        k = self.top or 0
        top_ids, top_values = np.zeros((len(entries), k), np.int32), np.full((len(entries), k), -np.inf, np.float32)
        for row, entry in enumerate(entries):
            for column, (token, logprob) in enumerate(entry.top):
                top_ids[row, column], top_values[row, column] = token, logprob
        return [pb_utils.Tensor("output_log_probs", values.reshape(1, 1, -1)),
                pb_utils.Tensor("cum_log_probs", np.array([[self.cumulative]], np.float32)),
                pb_utils.Tensor("output_token_ids", np.asarray(self.tokens[self.sent - len(entries):self.sent],
                                                               np.int32).reshape(1, -1)),
                pb_utils.Tensor("top_log_prob_ids", top_ids.reshape(1, len(entries), k)),
                pb_utils.Tensor("top_log_probs", top_values.reshape(1, len(entries), k))]


class ResponseQueue:
    """A generation's responses, sent in order by a task of their own, off its path to the next target call.

    `send` is a blocking round trip to the server (~1 ms). Sent in line, 64 streams' chunks spread their next
    target calls over tens of milliseconds, so the wave gate let waves go without their stragglers (mean target
    batch 42 of 64, 147 tok/s streamed against 239 unstreamed). Queued, every sequence of a wave reaches the
    gate first (their tasks were scheduled before the sender tasks), and a response waits until the next wave
    has gone out (`may_go`: specdec.waves), so the sends run while the target computes; the last ones (`close`)
    go at once."""

    def __init__(self, sender: Any, may_go: Callable[[], Awaitable[None]]) -> None:
        self.sender = sender
        self.may_go = may_go
        self.closing = False
        self.queue: asyncio.Queue[tuple[Callable[[], Any], int] | None] = asyncio.Queue()
        self.error: BaseException | None = None
        self.task = asyncio.ensure_future(self._run())

    def put(self, build: Callable[[], Any], flags: int = 0) -> None:
        """Queue the response `build` makes (built when it is sent, in order)."""
        self.queue.put_nowait((build, flags))

    async def _run(self) -> None:
        while (item := await self.queue.get()) is not None:
            if not self.closing:
                await self.may_go()
            if self.error is None:
                try:
                    self.sender.send(item[0](), flags=item[1])
                except Exception as exc:  # the first failure is the generation's; the rest are dropped
                    self.error = exc

    async def close(self) -> None:
        """Send every queued response (without waiting for a wave); raises the first send's failure."""
        self.closing = True
        self.queue.put_nowait(None)
        await asyncio.shield(self.task)
        if self.error is not None:
            raise self.error


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        self.tokenizer = TextTokenizer(tokenizer_dir(args, params))
        self.grammars = Grammars(self.tokenizer.to_json(), self.tokenizer.vocab_size, self.tokenizer.end_ids)
        # The context served: the deployment's cap, both models' own context and the KV pool's rows.
        pool = KVPoolConfig.from_json(params["kv_pool"], args["model_repository"]) if "kv_pool" in params else None
        context = int(params["max_context_length"])
        if pool is not None:
            context = pool.served_context(context)
        self.limits = ServerLimits(
            max_tokens_limit=min(int(params["max_tokens_limit"]), context - 1),
            max_draft_tokens=int(params["max_draft_tokens"]),
            max_candidates=int(params["max_candidates"]),
            exclude_input_in_output=params.get("default_exclude_input_in_output", "false").lower() == "true",
        )
        self.speculation = SpeculationConfig.load(model_dir(args) / params["profiles_file"])
        # A drafter model is served when the repository holds its checkpoint: an imported pair has no EAGLE
        # head, and a deployment that drafts only with the head can leave the draft model out (its memory).
        repository = Path(args["model_repository"]).parent
        loaded = {role: (repository / MODEL_NAMES[role] / "1" / "config.json").is_file() for role in ("eagle", "draft")}
        self.speculation = self.speculation.serving(drafters_served(loaded["eagle"], loaded["draft"]))
        # Shared by this instance's requests: fallback state per task, and the measured call costs.
        monitors = {task: FallbackMonitor(task, self.speculation.fallback) for task in self.speculation.profiles}
        backend = BlsModelBackend(pack_waves=params.get("pack_target_waves", "false") == "true")
        self.generator = SpeculativeGenerator(
            backend, context, costs=CostModel(), monitors=monitors,
            prefill_chunk=int(params.get("prefill_chunk_tokens", DEFAULT_PREFILL_CHUNK)))
        # At most as many live generations as KV slots, each with the KV blocks of its prompt + max_tokens
        # reserved: the rest wait here (bounded), never inside the decoders.
        # The stub runs each BLS `async_exec` in a thread of the event loop's default executor, which holds
        # min(32, CPUs + 4) threads: 6 on a 2-core machine, so at most 6 model calls were in flight and 16
        # sequences reached the decoders in batches of 3-4. Room for every live sequence's calls (a prefill
        # chunk runs the target and the draft at once) plus END calls of finishing ones.
        max_sequences = int(params["max_concurrent_sequences"])
        self.bls_executor = ThreadPoolExecutor(max_workers=2 * max_sequences + 8, thread_name_prefix="bls")
        self.admission = Admission(max_sequences, int(params["max_queued_generations"]),
                                   float(params["queue_timeout_s"]),
                                   kv_blocks=pool.num_blocks() if pool else None,
                                   block_size=pool.block_size if pool else DEFAULT_BLOCK_SIZE)
        self.max_generation_s = float(params["max_generation_s"])
        self.abandoned = AbandonedGenerations.for_this_server()  # marked by postprocessing (specdec.liveness)
        self.metric_sink = TritonMetricSink()
        self.metrics = GenerationMetrics(self.metric_sink, args["model_name"], args["model_instance_name"])
        metrics = self.metrics
        self.process_metrics = ProcessMetrics(self.metric_sink, args["model_name"], args["model_instance_name"],
                                              gauges={ACTIVE_REQUESTS: lambda: metrics.active})

    async def execute(self, requests: list) -> None:
        asyncio.get_running_loop().set_default_executor(self.bls_executor)
        await asyncio.gather(*(self._serve(request) for request in requests))

    async def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        timer = self.metrics.start(UNKNOWN_TASK)
        try:
            inputs = read_inputs(request, GENERATION_INPUTS)
            options = parse_request(inputs, self.limits)
            if "input_ids" not in inputs:
                raise InvalidRequestError("input_ids", "is required")
            prompt_ids = inputs["input_ids"].reshape(-1).astype(np.int64)
            check_token_ids(prompt_ids, self.tokenizer.vocab_size)
            prompt = prompt_ids.tolist()
            settings = resolve(
                self.speculation, options.task, self.tokenizer.decode(prompt) if options.task == "auto" else None,
                num_draft_tokens=options.num_draft_tokens, num_candidates=options.num_candidates,
                acceptance=options.acceptance, verify_threshold=options.verify_threshold, drafter=options.drafter,
                sampling=not options.sampling.greedy, constrained=options.guide is not None,
            )
            timer.task = settings.task
            end_ids = frozenset([options.end_id]) if options.end_id is not None else self.tokenizer.end_ids
            generation = GenerationRequest(prompt, options.max_tokens, end_ids, min_tokens=options.min_length,
                                           settings=settings, sampling=options.sampling,
                                           logits_options=self._logits_options(options),
                                           stop_texts=options.stop_words, decode=self.tokenizer.decode,
                                           grammar=self.grammars.constraint(options.guide, end_ids)
                                           if options.guide is not None else None, logprobs=options.logprobs)
            self.generator.validate(generation)
            deadline_s = generation_deadline_s(self.max_generation_s, request.timeout())
            async with self.admission.slot(sender.is_cancelled, rows=generation.rows_needed):
                self.metrics.begin_generation()
                try:
                    reason = await self._generate(sender, generation, options, timer, deadline_s)
                finally:
                    self.metrics.end_generation()
            self.metrics.finish(timer, reason or "cancelled")
        except CancelledWhileQueued as exc:
            self.metrics.finish(timer, "cancelled")
            sender.send(error_response(exc), flags=FINAL)
        except Exception as exc:
            self.metrics.finish(timer, "error", error=exc)
            if not isinstance(exc, InvalidRequestError):
                pb_utils.Logger.log_error(f"speculative_decoding: {type(exc).__name__}: {exc}")
            sender.send(error_response(exc), flags=FINAL)

    def _word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each word as its own token ids (as TensorRT-LLM's preprocessing tokenizes bad_words)."""
        return tuple(ids for ids in (tuple(self.tokenizer.encode(word, special_tokens=False)) for word in words) if ids)

    def _logits_options(self, options: RequestOptions) -> LogitsOptions:
        ids = np.asarray([token for token, _ in options.logits.logit_bias], dtype=np.int64)
        check_token_ids(ids, self.tokenizer.vocab_size, "logit_bias_ids")
        return replace(options.logits, bad_words=self._word_ids(options.bad_words))

    async def _generate(self, sender: Any, generation: GenerationRequest, options: RequestOptions,
                        timer: RequestTimer, deadline_s: float | None) -> str | None:
        """Run the generator and send its responses; returns the finish reason."""
        stats = timer.stats = GenerationStats()
        reason = None
        sequence_id = secrets.randbits(63) or 1
        stop = StopCheck(sender.is_cancelled, self.abandoned, sequence_id, deadline_s)
        try:
            responder = Responder(stats, len(generation.prompt_ids), options.output_tokens_per_response, sequence_id,
                                  options.logprobs)
            reason = await self._stream(sender, generation, options, timer, responder, stop)
        finally:
            if stop.reason is not None:  # the generator has ENDed its sequences: the KV slots are free
                self.abandoned.clear(sequence_id)
                self.abandoned.sweep()
                pb_utils.Logger.log_info(f"speculative_decoding: generation {sequence_id} stopped ({stop.reason}) "
                                         f"after {stats.output_tokens} tokens, {stop.elapsed_s():.2f} s")
        if stop.reason == "deadline":
            raise DeadlineExceededError(f"generation stopped at its deadline of {deadline_s:g} s after "
                                        f"{stats.output_tokens} tokens")
        return reason

    async def _stream(self, sender: Any, generation: GenerationRequest, options: RequestOptions,
                      timer: RequestTimer, responder: Responder, stop: StopCheck) -> str | None:
        reason = None
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode) if options.stream else None
        output: list[int] = []
        responses = ResponseQueue(sender, self.generator.waves.responses_may_go)
        try:
            reason = await self._generate_into(responses, generation, options, timer, responder, stop, detokenizer,
                                               output)
        finally:
            await responses.close()
        return reason

    async def _generate_into(self, responses: ResponseQueue, generation: GenerationRequest, options: RequestOptions,
                             timer: RequestTimer, responder: Responder, stop: StopCheck,
                             detokenizer: IncrementalDetokenizer | None, output: list[int]) -> str | None:
        reason = None
        async for update in self.generator.generate(generation, responder.generation_id, responder.stats, stop):
            if stop.reason == "deadline":
                continue  # the last update; the caller answers with an error instead
            timer.tokens(len(update.token_ids))
            reason = update.finish_reason
            output.extend(update.token_ids)
            responder.add(update)
            if detokenizer is None:
                continue
            piece = detokenizer.push(update.token_ids)
            if update.finished and piece is None:
                piece = detokenizer.flush()
            if update.finished:
                prefix, chunk = piece or ([], [])
                responses.put(responder.later(prefix, chunk, len(chunk)), FINAL)
            elif piece is not None:
                responses.put(responder.later(*piece, len(piece[1])))
        if detokenizer is None and stop.reason != "deadline":
            ids = output if options.exclude_input_in_output else generation.prompt_ids + output
            responses.put(responder.later([], ids, len(output)), FINAL)
        return reason

    def finalize(self) -> None:
        self.bls_executor.shutdown(wait=False, cancel_futures=True)
        self.process_metrics.close()
        self.metric_sink.close()
        self.abandoned.remove_all()
