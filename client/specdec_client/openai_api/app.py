"""The FastAPI application: OpenAI's completions and chat completions over the ensemble (docs/OPENAI.md).

Usage counts come from the ensemble's num_input_tokens / num_output_tokens; the speculation statistics of a
generation ride in the `speculation` extension field (the final chunk of a stream). Stop sequences are matched
here on the streamed text (the text returned stops before them) and the generation is then cancelled, as it is
when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec_client.openai_api.schemas import ChatCompletionRequest, CompletionRequest, _Request
from specdec_client.openai_api.triton import BackendError, Chunk, TokenLogprob

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
DISCONNECT_POLL_S = 0.1
MAX_BODY_BYTES = 1 << 20


class Backend(Protocol):
    async def ready(self) -> bool: ...
    async def max_tokens_limit(self) -> int | None: ...
    def stream(self, text_input: str, max_tokens: int, options: dict[str, Any]) -> AsyncIterator[Chunk]: ...
    async def close(self) -> None: ...


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class StopScanner:
    """Finds the first stop sequence in streamed text; holds back a tail that could begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that may go out now, whether a stop sequence was found)."""
        if not self.stops:
            return text, False
        buffer = self.held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buffer[: min(hits)], True
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(longest, len(buffer)), 0, -1):  # the longest tail that begins a stop sequence
            if any(s.startswith(buffer[-k:]) for s in self.stops):
                self.held = buffer[-k:]
                return buffer[:-k], False
        self.held = ""
        return buffer, False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class BodyLimit:
    """413 for a body whose Content-Length is over the limit (a plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would hide the client's disconnect from the handlers)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers", [])).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.limit:
                await APIError(413, f"the body is larger than {self.limit} bytes").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class Outcome:
    """What a generation reports besides its text."""

    max_tokens: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
    acceptance_histogram: list[int] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        if chunk.num_input_tokens is not None:
            self.prompt_tokens = chunk.num_input_tokens
        self.completion_tokens += chunk.num_output_tokens
        self.stats = chunk.stats or self.stats
        self.acceptance_histogram = chunk.acceptance_histogram or self.acceptance_histogram

    def speculative_decoding_stats(self) -> dict[str, Any] | None:
        """vLLM's per-choice `speculative_decoding_stats` (its `summary` level, which AIPerf reads), or None
        when no verification ran (plain decoding). `num_spec_tokens` is the deepest proposal this choice
        verified: the draft length varies per iteration here, where vLLM reports its configured one."""
        steps = int(self.stats.get("total_verification_passes", 0))
        if not steps:
            return None
        accepted, drafted = int(self.stats.get("total_accepted_draft_tokens", 0)), int(
            self.stats.get("total_draft_tokens", 0))
        return {
            "mean_acceptance_length": 1 + accepted / steps,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "acceptance_histogram": {str(j): count for j, count in enumerate(self.acceptance_histogram) if count},
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted,
            "num_spec_tokens": int(self.stats.get("max_draft_depth", 0)),
        }

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def speculation(self) -> dict[str, Any]:
        """The `speculation` extension field."""
        stats = self.stats
        return {
            "acceptance_rate": stats.get("acceptance_rate", 0.0),
            "accepted_draft_tokens": int(stats.get("total_accepted_draft_tokens", 0)),
            "draft_tokens": int(stats.get("total_draft_tokens", 0)),
            "fallback_active": bool(stats.get("fallback_active", False)),
        }


@dataclass
class Piece:
    """Text a generation adds, with the log-probabilities of the tokens that brought it (where asked)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def _pieces(first: Chunk | None, rest: AsyncIterator[Chunk], outcome: Outcome,
                  stops: list[str]) -> AsyncIterator[Piece]:
    """Text pieces of a generation, cut at the first stop sequence (the backend stream is closed after). A
    token's log-probability goes out with the first piece after its chunk arrived (a chunk that completes a stop
    sequence keeps all of its tokens')."""
    scanner = StopScanner(stops)
    held: list[TokenLogprob] = []
    try:
        chunk = first
        while chunk is not None:
            outcome.add(chunk)
            held += chunk.logprobs
            text, stopped = scanner.push(chunk.text)
            if text or (stopped and held):
                yield Piece(text, held)
                held = []
            if stopped:
                outcome.finish_reason = "stop"
                return
            chunk = await anext(rest, None)
        if (tail := scanner.flush()) or held:
            yield Piece(tail, held)
        outcome.finish_reason = "length" if outcome.completion_tokens >= outcome.max_tokens else "stop"
    finally:
        await rest.aclose()  # cancels the gRPC call when the generation is not over


async def _merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece | None]]:
    """(choice, piece) from several choices' pieces as they come, and (choice, None) once a choice is done."""
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put((index, piece))
            await queue.put((index, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item is None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _total_speculation(outcomes: list[Outcome]) -> dict[str, Any]:
    """The `speculation` field over every choice."""
    each = [outcome.speculation() for outcome in outcomes]
    if len(each) == 1:
        return each[0]
    drafted, accepted = sum(s["draft_tokens"] for s in each), sum(s["accepted_draft_tokens"] for s in each)
    return {"acceptance_rate": accepted / drafted if drafted else 0.0, "accepted_draft_tokens": accepted,
            "draft_tokens": drafted, "fallback_active": any(s["fallback_active"] for s in each)}


def _total_usage(outcomes: list[Outcome]) -> dict[str, int]:
    prompt, completion = outcomes[0].prompt_tokens, sum(outcome.completion_tokens for outcome in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def create_app(backend: Backend, served_model: str = "ensemble", tokenizer: Any = None,
               chat_template: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The endpoint over `backend` (TritonBackend, or a fake in unit tests); `tokenizer` renders chat prompts."""
    state: dict[str, Any] = {"max_tokens_limit": None, "created": int(time.time())}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await backend.close()

    app = FastAPI(title="specdec-triton OpenAI-compatible endpoint", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}").response()
        where = [".".join(str(p) for p in e.get("loc", ()) if p != "body") for e in errors]
        message = "; ".join(f"{w or 'body'}: {e.get('msg')}" for w, e in zip(where, errors, strict=True))
        return APIError(400, message, param=where[0] if where else None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    app.add_middleware(BodyLimit, limit=max_body_bytes)

    def check_model(body: _Request) -> None:
        if body.model != served_model:
            raise APIError(404, f"The model `{body.model}` does not exist; this endpoint serves `{served_model}`",
                           param="model", code="model_not_found")
        if body.wants_logprobs() and tokenizer is None:
            raise APIError(400, "log-probabilities name their tokens: start the endpoint with --tokenizer",
                           param="logprobs")

    async def token_limit(requested: int | None, default: int | None) -> int:
        """max_tokens for the ensemble: the request's, checked against the server's limit, or `default`."""
        if state["max_tokens_limit"] is None:  # asked once the server answers
            state["max_tokens_limit"] = await backend.max_tokens_limit()
        limit = state["max_tokens_limit"]
        if requested is None:
            default = default or limit or COMPLETION_DEFAULT_MAX_TOKENS
            return min(default, limit) if limit else default
        if limit and requested > limit:
            raise APIError(400, f"max_tokens: at most {limit} on this server, got {requested}", param="max_tokens")
        return requested

    async def open_stream(text_input: str, body: _Request, max_tokens: int,
                          choice: int = 0) -> tuple[Chunk | None, AsyncIterator]:
        """Start a generation and wait for its first response, so that an error still gets its status code."""
        stream = backend.stream(text_input, max_tokens, body.ensemble_inputs(choice))
        try:
            return await anext(stream, None), stream
        except BackendError as exc:
            await stream.aclose()
            raise APIError(exc.status, str(exc)) from exc
        except BaseException:
            await stream.aclose()
            raise

    async def open_choices(text_input: str, body: _Request,
                           max_tokens: int) -> tuple[list[Outcome], list[AsyncIterator[Piece]]]:
        """The request's `n` generations, started together: each choice's outcome and text pieces."""
        opened = await asyncio.gather(*(open_stream(text_input, body, max_tokens, i) for i in range(body.n)),
                                      return_exceptions=True)
        failed = [result for result in opened if isinstance(result, BaseException)]
        if failed:
            for result in opened:
                if not isinstance(result, BaseException):
                    await result[1].aclose()
            raise failed[0]
        outcomes = [Outcome(max_tokens) for _ in opened]
        pieces = [_pieces(first, stream, outcome, body.stop_sequences())
                  for (first, stream), outcome in zip(opened, outcomes, strict=True)]
        return outcomes, pieces

    async def collect_all(pieces: list[AsyncIterator[Piece]]) -> list[Piece]:
        async def collect(stream: AsyncIterator[Piece]) -> Piece:
            whole = Piece("")
            async for piece in stream:
                whole.text += piece.text
                whole.logprobs += piece.logprobs
            return whole

        return list(await asyncio.gather(*(collect(stream) for stream in pieces)))

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def chat_logprobs(body: _Request, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        """OpenAI chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        if not body.wants_logprobs():
            return None

        def item(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def completion_logprobs(body: _Request, entries: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        """OpenAI completions' `logprobs`: tokens, token_logprobs, top_logprobs, text_offset (from `offset`)."""
        if not body.wants_logprobs():
            return None
        tokens = [token_text(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    async def until_disconnected(request: Request, work: Any) -> Any:
        """Await `work`; cancel it (and so the generation) when the client goes away first."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not done and await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    raise APIError(499, "the client closed the request")
            return task.result()
        except BackendError as exc:
            raise APIError(exc.status, str(exc)) from exc
        finally:
            task.cancel()

    def sse(events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
        async def frames() -> AsyncIterator[dict[str, str]]:
            try:
                async for event in events:
                    yield {"data": json.dumps(event, ensure_ascii=False)}
            except BackendError as exc:  # after the first chunk: the status line is already sent
                yield {"data": json.dumps(APIError(exc.status, str(exc)).body())}
            yield {"data": "[DONE]"}

        return EventSourceResponse(frames(), sep="\n", ping=15)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": served_model, "object": "model", "created": state["created"], "owned_by": "specdec-triton"}]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != served_model:
            raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
        return {"id": served_model, "object": "model", "created": state["created"], "owned_by": "specdec-triton"}

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = await backend.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body)
        max_tokens = await token_limit(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        outcomes, pieces = await open_choices(body.prompt, body, max_tokens)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def envelope(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": served_model,
                    "choices": choices, **extra}

        echoed = len(body.prompt) if body.echo else 0
        offsets = [echoed] * body.n  # where each choice's next token starts in its text

        def choice(index: int, text: str, finish_reason: str | None,
                   entries: list[TokenLogprob] | None = None) -> dict[str, Any]:
            logprobs = completion_logprobs(body, entries or [], offsets[index])
            offsets[index] += sum(len(token) for token in (logprobs or {}).get("tokens", []))
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

        if not body.stream:
            answers = await until_disconnected(request, collect_all(pieces))
            return envelope([{**choice(i, body.prompt + answer.text if body.echo else answer.text,
                                       outcome.finish_reason, answer.logprobs),
                              "speculative_decoding_stats": outcome.speculative_decoding_stats()}
                             for i, (answer, outcome) in enumerate(zip(answers, outcomes, strict=True))],
                            usage=_total_usage(outcomes), speculation=_total_speculation(outcomes))

        async def events() -> AsyncIterator[dict[str, Any]]:
            usage = {"usage": None} if body.include_usage() else {}
            if body.echo:
                yield envelope([{**choice(i, body.prompt, None), "logprobs": None} for i in range(body.n)], **usage)
            async for i, piece in _merged(pieces):
                if piece is not None:
                    yield envelope([choice(i, piece.text, None, piece.logprobs)], **usage)
                else:
                    last = {**choice(i, "", outcomes[i].finish_reason),
                            "speculative_decoding_stats": outcomes[i].speculative_decoding_stats()}
                    yield envelope([last], **usage, speculation=outcomes[i].speculation())
            if body.include_usage():
                yield envelope([], usage=_total_usage(outcomes))

        return sse(events())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body)
        prompt = render_chat(body)
        max_tokens = await token_limit(body.token_limit(), None)  # OpenAI: as long as allowed
        outcomes, pieces = await open_choices(prompt, body, max_tokens)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def envelope(kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {"id": rid, "object": kind, "created": created, "model": served_model, "choices": choices,
                    "system_fingerprint": None, **extra}

        if not body.stream:
            answers = await until_disconnected(request, collect_all(pieces))
            return envelope("chat.completion", [
                {"index": i, "message": {"role": "assistant", "content": answer.text},
                 "logprobs": chat_logprobs(body, answer.logprobs), "finish_reason": outcome.finish_reason,
                 "speculative_decoding_stats": outcome.speculative_decoding_stats()}
                for i, (answer, outcome) in enumerate(zip(answers, outcomes, strict=True))],
                usage=_total_usage(outcomes), speculation=_total_speculation(outcomes))

        def delta(index: int, content: dict[str, Any], finish_reason: str | None,
                  entries: list[TokenLogprob] | None = None) -> list[dict[str, Any]]:
            logprobs = chat_logprobs(body, entries) if entries else None
            return [{"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}]

        async def events() -> AsyncIterator[dict[str, Any]]:
            usage = {"usage": None} if body.include_usage() else {}
            for i in range(body.n):
                yield envelope("chat.completion.chunk", delta(i, {"role": "assistant", "content": ""}, None), **usage)
            async for i, piece in _merged(pieces):
                if piece is not None:
                    yield envelope("chat.completion.chunk", delta(i, {"content": piece.text}, None, piece.logprobs),
                                   **usage)
                else:
                    last = delta(i, {}, outcomes[i].finish_reason)
                    last[0]["speculative_decoding_stats"] = outcomes[i].speculative_decoding_stats()
                    yield envelope("chat.completion.chunk", last, **usage, speculation=outcomes[i].speculation())
            if body.include_usage():
                yield envelope("chat.completion.chunk", [], usage=_total_usage(outcomes))

        return sse(events())

    def render_chat(body: ChatCompletionRequest) -> str:
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if tokenizer is None or not template:
            raise APIError(400, f"the model `{served_model}` has no chat template: use /v1/completions, or start "
                                "the endpoint with --chat-template FILE", param="messages",
                           code="chat_template_missing")
        try:
            return tokenizer.apply_chat_template(body.conversation(), tokenize=False, add_generation_prompt=True,
                                                 chat_template=template)
        except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from exc

    return app
