"""The OpenAI-compatible endpoint over a scripted backend (no server): the official openai client as the client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from specdec_client.openai_api.app import Outcome, StopScanner, create_app
from specdec_client.openai_api.triton import BackendError, Chunk, TokenLogprob, classify

MODEL = "ensemble"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STATS = {"acceptance_rate": 0.5, "total_accepted_draft_tokens": 3, "total_draft_tokens": 6, "fallback_active": 0,
         "total_verification_passes": 4, "max_draft_depth": 2}
HISTOGRAM = [2, 1, 1]  # of the 4 verifications: 2 accepted nothing, 1 one draft token, 1 two (3 accepted)


class FakeTokenizer:
    chat_template = TEMPLATE

    def apply_chat_template(self, conversation, tokenize, add_generation_prompt, chat_template):
        from jinja2 import Template

        return Template(chat_template).render(messages=conversation, add_generation_prompt=add_generation_prompt)

    def decode(self, ids: list[int]) -> str:
        return f"t{ids[0]}"


class ScriptedBackend:
    """Answers every prompt with `pieces` (one token each), or fails with `error` before the first one."""

    def __init__(self, pieces: list[str], error: BackendError | None = None, limit: int | None = 64) -> None:
        self.pieces, self.error, self.limit = pieces, error, limit
        self.calls: list[tuple[str, int, dict[str, Any]]] = []
        self.closed_early = 0

    async def ready(self) -> bool:
        return True

    async def max_tokens_limit(self) -> int | None:
        return self.limit

    async def close(self) -> None:
        pass

    async def stream(self, text_input: str, max_tokens: int, options: dict[str, Any]) -> AsyncIterator[Chunk]:
        self.calls.append((text_input, max_tokens, options))
        if self.error is not None:
            raise self.error
        pieces = self.pieces[:max_tokens]
        finished = False
        try:
            for i, piece in enumerate(pieces):
                logprobs = []
                if options.get("return_log_probs"):  # token i, log-probability -(i + 1) / 10, alternatives after it
                    top = [(i, -(i + 1) / 10), (90 + i, -(i + 1) / 10 - 1)][:options.get("num_top_log_probs") or 0]
                    logprobs = [TokenLogprob(i, -(i + 1) / 10, tuple(top))]
                yield Chunk(piece, num_input_tokens=5, num_output_tokens=1, stats=STATS, final=i == len(pieces) - 1,
                            logprobs=logprobs, acceptance_histogram=HISTOGRAM)
            finished = True
        finally:
            self.closed_early += not finished


def client_for(backend: ScriptedBackend, tokenizer: Any = None) -> openai.AsyncOpenAI:
    app = create_app(backend, served_model=MODEL, tokenizer=tokenizer)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http, max_retries=0)


def run(coro):
    return asyncio.run(coro)


def test_completion_text_usage_and_speculation():
    backend = ScriptedBackend(["Hello", ",", " world", "!"])

    async def go():
        return await client_for(backend).completions.create(model=MODEL, prompt="Say hi", max_tokens=3, seed=7,
                                                             temperature=0.5, top_p=0.9)

    out = run(go())
    assert out.choices[0].text == "Hello, world" and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (5, 3, 8)
    assert out.model_extra["speculation"] == {"acceptance_rate": 0.5, "accepted_draft_tokens": 3, "draft_tokens": 6,
                                              "fallback_active": False}
    text_input, max_tokens, options = backend.calls[0]
    assert (text_input, max_tokens) == ("Say hi", 3)
    assert (options["seed"], options["temperature"], options["top_p"]) == (7, 0.5, 0.9)


VLLM_STATS = {"mean_acceptance_length": 1.75, "draft_acceptance_rate": 0.5,
              "acceptance_histogram": {"0": 2, "1": 1, "2": 1}, "num_spec_steps": 4,
              "num_accepted_draft_tokens": 3, "num_draft_tokens": 6, "num_spec_tokens": 2}


def test_each_choice_carries_vllms_speculative_decoding_stats():
    """vLLM's per-choice `speculative_decoding_stats` (as AIPerf reads it): on every non-streamed choice and on
    the terminal chunk's choice of a stream; null where no verification ran."""
    backend = ScriptedBackend(["Hello", ",", " world"])

    async def go():
        client = client_for(backend, FakeTokenizer())
        completion = await client.completions.create(model=MODEL, prompt="Say hi", max_tokens=3, n=2)
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3)
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=3, stream=True)
        chunks = [chunk async for chunk in stream]
        return completion, chat, chunks

    completion, chat, chunks = run(go())
    assert [c.model_extra["speculative_decoding_stats"] for c in completion.choices] == [VLLM_STATS, VLLM_STATS]
    assert chat.choices[0].model_extra["speculative_decoding_stats"] == VLLM_STATS
    terminal = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(terminal) == 1 and terminal[0].model_extra["speculative_decoding_stats"] == VLLM_STATS
    assert all("speculative_decoding_stats" not in (c.choices[0].model_extra or {})
               for c in chunks if c.choices and not c.choices[0].finish_reason)
    plain = Outcome(max_tokens=1)
    plain.add(Chunk("x", 5, 1, stats={**STATS, "total_verification_passes": 0}))
    assert plain.speculative_decoding_stats() is None


def test_n_choices_are_separate_generations_with_their_own_seeds():
    backend = ScriptedBackend(["Hel", "lo"])

    async def go():
        client = client_for(backend, FakeTokenizer())
        text = await client.completions.create(model=MODEL, prompt="p", max_tokens=2, n=3, seed=40, temperature=0.8)
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, n=2)
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2, n=2, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        return text, chat, chunks

    text, chat, chunks = run(go())
    assert [c.index for c in text.choices] == [0, 1, 2] and all(c.text == "Hello" for c in text.choices)
    assert [call[2]["seed"] for call in backend.calls[:3]] == [40, 41, 42]
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (5, 6)
    assert [c.message.content for c in chat.choices] == ["Hello", "Hello"] and chat.usage.completion_tokens == 4
    by_choice: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        for c in chunk.choices:
            by_choice[c.index] = by_choice.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert by_choice == {0: "Hello", 1: "Hello"} and finished == {0, 1}
    assert chunks[-1].usage.completion_tokens == 4


def test_penalties_and_logit_bias_reach_the_ensemble():
    from specdec_client.openai_api.schemas import ChatCompletionRequest

    options = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], presence_penalty=0.5,
                                    frequency_penalty=-0.25, logit_bias={"42": -100, "7": 2.5},
                                    repetition_penalty=1.2).ensemble_inputs()
    assert (options["presence_penalty"], options["frequency_penalty"], options["repetition_penalty"]) == (
        0.5, -0.25, 1.2)
    assert (options["logit_bias_ids"], options["logit_bias_values"]) == ([42, 7], [-100, 2.5])
    plain = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}]).ensemble_inputs()
    assert plain["logit_bias_ids"] is None and plain["presence_penalty"] is None


def test_a_sampled_request_sends_its_nucleus_explicitly():
    """OpenAI samples whenever the temperature is above 0; the ensemble (TensorRT-LLM's semantics) is greedy
    without top_k and top_p, so the endpoint sends top_p 1.0 when the client left it out."""
    from specdec_client.openai_api.schemas import CompletionRequest

    def sent(**fields):
        options = CompletionRequest(model=MODEL, prompt="hi", **fields).ensemble_inputs()
        return options["temperature"], options["top_p"], options["top_k"]

    assert sent(temperature=0.8) == (0.8, 1.0, None)
    assert sent(temperature=0.8, top_p=0.5) == (0.8, 0.5, None)
    assert sent(top_k=20) == (None, 1.0, 20)  # sampled at the ensemble's default temperature, 1.0
    assert sent(temperature=0.0) == (0.0, None, None)
    assert sent() == (None, None, None)  # the server's default: greedy


def test_completion_default_max_tokens_and_echo():
    backend = ScriptedBackend(["x"] * 40)
    out = run(client_for(backend).completions.create(model=MODEL, prompt="P:", echo=True))
    assert backend.calls[0][1] == 16  # OpenAI's default for completions
    assert out.choices[0].text == "P:" + "x" * 16


def test_stop_sequence_across_chunks_cuts_the_text_and_stops_the_generation():
    backend = ScriptedBackend(["one", " two", " th", "ree", " four", " five"])
    out = run(client_for(backend).completions.create(model=MODEL, prompt="count", max_tokens=6, stop=["three", "six"]))
    assert out.choices[0].text == "one two " and out.choices[0].finish_reason == "stop"
    assert backend.closed_early == 1


def test_streamed_completion_with_usage():
    backend = ScriptedBackend(["a", "b", "c"])

    async def go():
        stream = await client_for(backend).completions.create(model=MODEL, prompt="p", max_tokens=8, stream=True,
                                                               stream_options={"include_usage": True})
        return [chunk async for chunk in stream]

    chunks = run(go())
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == "abc"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert finals[0].model_extra["speculation"]["draft_tokens"] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_chat_uses_the_template_and_streams_deltas():
    backend = ScriptedBackend(["Hi", " there"])
    client = client_for(backend, FakeTokenizer())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]

    async def go():
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
        return whole, [chunk async for chunk in stream]

    whole, chunks = run(go())
    assert backend.calls[0][0] == "<|system|>Be brief.\n<|user|>Hello\n<|assistant|>"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == "Hi there"
    assert whole.usage.completion_tokens == 2 and whole.object == "chat.completion"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hi there"
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].object == "chat.completion.chunk"
    assert backend.calls[1][1] == 4


def test_chat_default_max_tokens_is_the_server_limit():
    backend = ScriptedBackend(["x"], limit=48)
    run(client_for(backend, FakeTokenizer()).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]))
    assert backend.calls[0][1] == 48


def test_chat_without_a_template_is_a_clear_400():
    backend = ScriptedBackend(["x"])
    with pytest.raises(openai.BadRequestError) as info:
        run(client_for(backend).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]))
    assert info.value.code == "chat_template_missing" and "/v1/completions" in info.value.message
    assert not backend.calls


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 65}, "max_tokens"),  # over the server's limit
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
])
def test_bad_requests_get_400_in_openai_format(kwargs, param):
    backend = ScriptedBackend(["x"])
    args = {"model": MODEL, "prompt": "p", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        run(client_for(backend).completions.create(**args))
    assert info.value.status_code == 400
    body = info.value.body
    assert body["type"] == "invalid_request_error" and param in body["param"] and body["message"]
    assert not backend.calls


def test_malformed_json_and_unknown_routes_are_openai_errors():
    app = create_app(ScriptedBackend(["x"]), served_model=MODEL)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            broken = await http.post("/v1/completions", content=b'{"model": "ensemble", "prompt": ',
                                     headers={"content-type": "application/json"})
            missing = await http.post("/v1/nowhere", json={})
            huge = await http.post("/v1/completions", content=b"x" * (2 << 20),
                                   headers={"content-type": "application/json"})
            return broken, missing, huge

    broken, missing, huge = run(go())
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert huge.status_code == 413 and "error" in huge.json()


def test_unknown_model_is_404():
    with pytest.raises(openai.NotFoundError) as info:
        run(client_for(ScriptedBackend(["x"])).completions.create(model="gpt-4", prompt="p"))
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize("message, status, error", [
    ("in ensemble 'ensemble', max_tokens: must be in [1, 1024], got 5000", 400, openai.BadRequestError),
    ("in ensemble 'ensemble', guided_decoding_guide: is not a valid regex: unclosed group", 400,
     openai.BadRequestError),
    ("in ensemble 'ensemble', server busy: 16 generations use all KV slots and 64 wait", 503,
     openai.InternalServerError),
    ("in ensemble 'ensemble', internal error: boom", 500, openai.InternalServerError),
])
def test_triton_errors_keep_their_meaning(message, status, error):
    assert classify(message) == status
    backend = ScriptedBackend([], error=BackendError(message, status))
    with pytest.raises(error) as info:
        run(client_for(backend).completions.create(model=MODEL, prompt="p"))
    assert info.value.status_code == status and message in info.value.message


def test_models_lists_the_served_model():
    async def go():
        return [m.id async for m in client_for(ScriptedBackend([])).models.list()]

    assert run(go()) == [MODEL]


@pytest.mark.parametrize("pieces, stops, expected", [
    (["ab", "cd"], [], ("abcd", False)),
    (["hello wor", "ld"], ["world"], ("hello ", True)),
    (["a<", "/s", "> tail"], ["</s>"], ("a", True)),
    (["a<", "b"], ["</s>"], ("a<b", False)),
    (["xx", "x"], ["xy", "xxx"], ("", True)),
])
def test_stop_scanner(pieces, stops, expected):
    scanner = StopScanner(stops)
    out, stopped = "", False
    for piece in pieces:
        text, stopped = scanner.push(piece)
        out += text
        if stopped:
            break
    if not stopped:
        out += scanner.flush()
    assert (out, stopped) == expected


def test_sse_frames_are_openai_shaped():
    app = create_app(ScriptedBackend(["a", "b"]), served_model=MODEL)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "p", "stream": True})
            return resp

    resp = run(go())
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)


def test_genai_perf_runs_its_openai_completions_endpoint_type(tmp_path):
    from specdec_client.perf_tools import genai_perf_openai_command

    cmd = genai_perf_openai_command("127.0.0.1:9000", "json", 2, 8, tmp_path)
    assert cmd[cmd.index("--endpoint-type") + 1] == "completions" and "--streaming" in cmd
    assert cmd[cmd.index("-u") + 1] == "127.0.0.1:9000" and cmd[cmd.index("-m") + 1] == MODEL


def test_structured_output_fields_reach_the_ensemble_as_one_guide():
    """response_format (json_object, json_schema) and vLLM's guided_json / guided_regex / guided_choice /
    guided_grammar become TensorRT-LLM's guided_decoding_guide_type and guided_decoding_guide."""
    from specdec_client.openai_api.schemas import ChatCompletionRequest, CompletionRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    messages = [{"role": "user", "content": "hi"}]

    def guide(request) -> tuple[str | None, str | None]:
        options = request.ensemble_inputs()
        return options["guided_decoding_guide_type"], options["guided_decoding_guide"]

    chat = ChatCompletionRequest.model_validate
    assert guide(chat({"model": MODEL, "messages": messages})) == (None, None)
    assert guide(chat({"model": MODEL, "messages": messages, "response_format": {"type": "text"}})) == (None, None)
    assert guide(chat({"model": MODEL, "messages": messages, "response_format": {"type": "json_object"}})) == (
        "json_schema", '{"type": "object"}')
    kind, text = guide(chat({"model": MODEL, "messages": messages, "response_format": {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}}))
    assert kind == "json_schema" and json.loads(text) == schema
    completion = CompletionRequest.model_validate
    assert guide(completion({"model": MODEL, "prompt": "p", "guided_json": schema}))[0] == "json_schema"
    assert guide(completion({"model": MODEL, "prompt": "p", "guided_regex": r"\d+"})) == ("regex", r"\d+")
    assert guide(completion({"model": MODEL, "prompt": "p", "guided_choice": ["yes", 'say "no"']})) == (
        "ebnf_grammar", 'root ::= "yes" | "say \\"no\\""')
    assert guide(completion({"model": MODEL, "prompt": "p", "guided_grammar": "root ::= [0-9]+"})) == (
        "ebnf_grammar", "root ::= [0-9]+")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "body"),
])
def test_bad_structured_output_fields_get_400(extra, param):
    backend = ScriptedBackend(["x"])
    with pytest.raises(openai.BadRequestError) as info:
        run(client_for(backend, FakeTokenizer()).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=extra))
    assert info.value.status_code == 400 and param in (info.value.body["param"] or "body") + info.value.message
    assert not backend.calls


def test_log_probabilities_in_openai_shapes():
    """Chat: logprobs.content per token with top_logprobs; completions: tokens, token_logprobs, top_logprobs and
    text_offset; streamed chunks carry their own tokens'; the ensemble is asked with return_log_probs."""
    backend = ScriptedBackend(["Hello", ",", " world"])
    client = client_for(backend, FakeTokenizer())

    async def go():
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    logprobs=True, top_logprobs=2)
        plain = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        text = await client.completions.create(model=MODEL, prompt="p", logprobs=1, echo=True)
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      logprobs=True, stream=True)
        chunks = [chunk async for chunk in stream]
        return chat, plain, text, chunks

    chat, plain, text, chunks = run(go())
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [("t0", -0.1), ("t1", -0.2), ("t2", -0.3)]
    assert [(t.token, t.logprob) for t in content[2].top_logprobs] == [("t2", -0.3), ("t92", pytest.approx(-1.3))]
    assert content[0].bytes == list(b"t0")
    assert plain.choices[0].logprobs is None
    assert backend.calls[0][2]["return_log_probs"] is True and backend.calls[0][2]["num_top_log_probs"] == 2
    assert backend.calls[1][2]["return_log_probs"] is None
    logprobs = text.choices[0].logprobs
    assert logprobs.tokens == ["t0", "t1", "t2"] and logprobs.token_logprobs == [-0.1, -0.2, -0.3]
    assert logprobs.top_logprobs == [{"t0": -0.1}, {"t1": -0.2}, {"t2": -0.3}]
    assert logprobs.text_offset == [1, 3, 5]  # after the echoed prompt "p"
    streamed = [c.token for chunk in chunks for choice in chunk.choices if choice.logprobs
                for c in choice.logprobs.content]
    assert streamed == ["t0", "t1", "t2"]


@pytest.mark.parametrize("kwargs, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
])
def test_bad_log_probability_fields_get_400(kwargs, param):
    backend = ScriptedBackend(["x"])
    with pytest.raises(openai.BadRequestError) as info:
        run(client_for(backend, FakeTokenizer()).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs))
    assert info.value.status_code == 400 and param in (info.value.body["param"] or "") + info.value.message
    assert not backend.calls
