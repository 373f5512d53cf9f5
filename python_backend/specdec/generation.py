"""The speculate -> verify -> accept loop, independent of any transport.

`SpeculativeGenerator.generate` drives one sequence through a `ModelBackend` (BLS calls inside Triton, or
in-process engines in tests) and yields the tokens each iteration adds. `num_draft_tokens == 0` is plain
autoregressive decoding through the same target: the baseline and the fallback.

Cache bookkeeping (rollback by length): `target_valid` / `draft_valid` count the leading tokens of `tokens`
whose KV rows are valid in each model's slot; every call sends `tokens[valid:]` after `past_length=valid`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specdec.acceptance import greedy_accept
from specdec.engines import StepRequest, StepResult
from specdec.errors import InvalidRequestError

log = logging.getLogger(__name__)


class ModelBackend(Protocol):
    async def target_step(self, request: StepRequest) -> StepResult: ...

    async def draft_step(self, request: StepRequest) -> StepResult: ...


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    end_ids: frozenset[int] = frozenset()
    num_draft_tokens: int = 0
    min_tokens: int = 0  # end tokens are ignored until this many tokens were generated


@dataclass
class GenerationStats:
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    verification_passes: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_failures: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.output_tokens / self.target_calls if self.target_calls else 0.0


@dataclass
class GenerationUpdate:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "context" | "cancelled"


class StepError(RuntimeError):
    """A model call failed; carries the model's message."""


def _checked(result: StepResult, model: str) -> StepResult:
    if result.error is not None:
        raise StepError(f"{model}: {result.error}")
    return result


class SpeculativeGenerator:
    def __init__(self, backend: ModelBackend, max_context_length: int) -> None:
        self.backend = backend
        self.max_context_length = max_context_length

    def validate(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise InvalidRequestError("text_input", "the prompt is empty")
        if len(request.prompt_ids) + request.max_tokens > self.max_context_length:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the "
                f"context window of {self.max_context_length} tokens",
            )

    async def generate(
        self,
        request: GenerationRequest,
        sequence_id: int,
        stats: GenerationStats | None = None,
        is_cancelled: Callable[[], bool] = lambda: False,
    ) -> AsyncIterator[GenerationUpdate]:
        self.validate(request)
        stats = stats if stats is not None else GenerationStats()
        tokens = list(request.prompt_ids)
        prompt_len = len(tokens)
        target_valid = draft_valid = 0
        draft_started = False
        speculate = request.num_draft_tokens > 0
        try:
            result = _checked(
                await self.backend.target_step(
                    StepRequest(sequence_id, past_length=0, input_ids=np.asarray(tokens), start=True)
                ),
                "target_model",
            )
            stats.target_calls += 1
            target_valid = len(tokens)
            new = [int(result.token_ids[-1])]
            while True:
                update = self._emit(tokens, new, prompt_len, request, stats)
                if update.finished or is_cancelled():
                    if not update.finished:
                        update.finished, update.finish_reason = True, "cancelled"
                    yield update
                    return
                yield update
                remaining = request.max_tokens - (len(tokens) - prompt_len)
                room = self.max_context_length - len(tokens)
                k = min(request.num_draft_tokens, remaining - 1, room) if speculate else 0
                drafts: list[int] = []
                if k > 0:
                    try:
                        draft = _checked(
                            await self.backend.draft_step(
                                StepRequest(
                                    sequence_id, past_length=draft_valid,
                                    input_ids=np.asarray(tokens[draft_valid:]), start=not draft_started,
                                    num_draft_tokens=k,
                                )
                            ),
                            "draft_model",
                        )
                        draft_started = True
                        stats.draft_calls += 1
                        drafts = [int(t) for t in draft.token_ids[:k]]
                    except Exception as exc:  # a failing draft degrades to plain decoding, never to an error
                        log.warning("draft_model failed (%s); sequence %d continues without speculation",
                                    exc, sequence_id)
                        stats.draft_failures += 1
                        speculate = False
                        drafts = []
                result = _checked(
                    await self.backend.target_step(
                        StepRequest(
                            sequence_id, past_length=target_valid,
                            input_ids=np.asarray(tokens[target_valid:] + drafts), num_logits=len(drafts) + 1,
                        )
                    ),
                    "target_model",
                )
                stats.target_calls += 1
                if drafts:
                    accepted, bonus = greedy_accept(drafts, result.token_ids)
                    stats.verification_passes += 1
                    stats.draft_tokens += len(drafts)
                    stats.accepted_draft_tokens += accepted
                    if len(stats.accepted_per_position) < len(drafts):
                        stats.accepted_per_position.extend([0] * (len(drafts) - len(stats.accepted_per_position)))
                    for position in range(accepted):
                        stats.accepted_per_position[position] += 1
                    # Draft rows hold tokens + drafts[:-1]; those agreeing with the new sequence stay valid.
                    draft_valid = len(tokens) + min(accepted, len(drafts) - 1)
                    target_valid = len(tokens) + accepted
                    new = drafts[:accepted] + [bonus]
                else:
                    target_valid = len(tokens)
                    new = [int(result.token_ids[-1])]
        finally:
            await self._release(sequence_id, draft_started)

    def _emit(self, tokens: list[int], new: list[int], prompt_len: int, request: GenerationRequest,
              stats: GenerationStats) -> GenerationUpdate:
        """Append `new` to `tokens`, cut at an end token or max_tokens, and report what was added."""
        room = request.max_tokens - (len(tokens) - prompt_len)
        kept: list[int] = []
        reason = None
        generated = len(tokens) - prompt_len
        for token in new[:room]:
            if token in request.end_ids and generated + len(kept) >= request.min_tokens:
                reason = "stop"
                break
            kept.append(token)
        tokens.extend(kept)
        stats.output_tokens += len(kept)
        if reason is None and len(tokens) - prompt_len >= request.max_tokens:
            reason = "length"
        if reason is None and len(tokens) >= self.max_context_length:
            reason = "context"
        return GenerationUpdate(kept, finished=reason is not None, finish_reason=reason)

    async def _release(self, sequence_id: int, draft_started: bool) -> None:
        """END both sequences so their KV slots are freed now, not at the idle timeout."""
        calls = [self.backend.target_step(StepRequest(sequence_id, end=True))]
        if draft_started:
            calls.append(self.backend.draft_step(StepRequest(sequence_id, end=True)))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.warning("releasing sequence %d failed: %s", sequence_id, outcome)
            elif outcome.error is not None:
                log.warning("releasing sequence %d: %s", sequence_id, outcome.error)
