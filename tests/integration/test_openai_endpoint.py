"""The OpenAI-compatible endpoint on a real tritonserver, with the official openai package as the client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import tritonclient.grpc as grpcclient
from specdec_client.api import generate_grpc
from specdec_client.server import OpenAIEndpoint, free_port
from test_cancellation import LONG, stopped_lines, wait_for_stop
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration
MODEL = "ensemble"
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 32
# For a target whose tokenizer has no chat template (the 12M test pair): the documented --chat-template fallback.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(server):
    return AutoTokenizer.from_pretrained(server.model_repository / "target_model" / "1")


def endpoint_args(server, tokenizer, tmp_path_factory) -> list[str]:
    extra = ["--tokenizer", str(server.model_repository / "target_model" / "1")]
    if not tokenizer.chat_template:
        template = tmp_path_factory.mktemp("openai") / "chat_template.jinja"
        template.write_text(CHATML)
        extra += ["--chat-template", str(template)]
    return extra


@pytest.fixture(scope="module")
def endpoint(server, tokenizer, tmp_path_factory):
    """The endpoint as deployed: it tokenizes here and calls speculative_decoding directly."""
    log = tmp_path_factory.mktemp("openai_log") / "endpoint.log"
    with OpenAIEndpoint(server.grpc_url, free_port(), extra_args=endpoint_args(server, tokenizer, tmp_path_factory),
                        log_file=log) as instance:
        yield instance


@pytest.fixture(scope="module")
def ensemble_endpoint(server, tokenizer, tmp_path_factory):
    """An endpoint with --via-ensemble: every generation through the ensemble's pre- and postprocessing."""
    log = tmp_path_factory.mktemp("openai_log") / "endpoint-via-ensemble.log"
    args = [*endpoint_args(server, tokenizer, tmp_path_factory), "--via-ensemble"]
    with OpenAIEndpoint(server.grpc_url, free_port(), extra_args=args, log_file=log) as instance:
        yield instance


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=120)


# The draft model alone (the profile's fixed k): its proposals, so the speculation counters, repeat exactly
# between requests; prompt lookup's adaptive length follows the instance's measured costs and need not.
DETERMINISTIC_DRAFTER = "model"


@pytest.fixture(scope="module")
def greedy(server):
    return generate_grpc(server.grpc_url, {"text_input": PROMPT, "max_tokens": MAX_TOKENS,
                                           "exclude_input_in_output": True, "drafter": DETERMINISTIC_DRAFTER})


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_equals_the_ensembles_greedy_text(client, greedy, tokenizer):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"drafter": DETERMINISTIC_DRAFTER})
    assert out.choices[0].text == greedy.text
    assert out.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    assert out.usage.completion_tokens == greedy.num_output_tokens
    assert out.choices[0].finish_reason == ("length" if greedy.num_output_tokens == MAX_TOKENS else "stop")
    speculation = out.model_extra["speculation"]
    assert speculation["draft_tokens"] == greedy.stats["total_draft_tokens"]
    assert speculation["accepted_draft_tokens"] == greedy.stats["total_accepted_draft_tokens"]
    stats = out.choices[0].model_extra["speculative_decoding_stats"]  # vLLM's per-choice shape
    steps, histogram = stats["num_spec_steps"], {int(j): n for j, n in stats["acceptance_histogram"].items()}
    assert steps == greedy.stats["total_verification_passes"] > 0 and sum(histogram.values()) == steps
    assert sum(j * n for j, n in histogram.items()) == stats["num_accepted_draft_tokens"]
    assert stats["num_draft_tokens"] == speculation["draft_tokens"]
    assert stats["mean_acceptance_length"] == 1 + stats["num_accepted_draft_tokens"] / steps
    assert max(histogram) <= stats["num_spec_tokens"] == greedy.stats["max_draft_depth"]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                      extra_body={"num_draft_tokens": 0})
    assert plain.choices[0].model_extra["speculative_decoding_stats"] is None


def test_streamed_completion_assembles_to_the_same_text_and_usage(client, greedy):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy.text
    assert len([c for c in chunks if c.choices]) > 2  # streamed, not one piece
    assert chunks[-1].usage.completion_tokens == greedy.num_output_tokens


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Fibonacci?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
    assert 0 < whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_sequence_cuts_the_text(client, greedy):
    words = greedy.text.split()
    assert len(words) > 3, greedy.text
    stop = words[len(words) // 2]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert out.choices[0].text == greedy.text[: greedy.text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text

    assert sample(11) == sample(11)


def test_n_choices_sample_with_consecutive_seeds(client):
    """n = 3: three generations; choice i is the n = 1 answer with seed + i."""
    def sample(seed, n=1):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95,
                                         seed=seed, n=n)

    three = sample(21, n=3)
    singles = [sample(21 + i) for i in range(3)]
    assert [c.text for c in three.choices] == [single.choices[0].text for single in singles]
    assert len({c.text for c in three.choices}) > 1
    assert three.usage.completion_tokens == sum(single.usage.completion_tokens for single in singles)


def test_penalties_and_logit_bias_change_the_answer(client, greedy):
    penalized = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                          frequency_penalty=1.5, presence_penalty=0.5)
    assert penalized.choices[0].text != greedy.text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={"99999999": 5})
    assert "logit_bias_ids" in str(info.value)


@pytest.mark.parametrize("kwargs, status", [
    ({"temperature": "warm"}, 400),
    ({"max_tokens": 100_000}, 400),  # over the server's max_tokens limit
    ({"extra_body": {"num_draft_tokens": 10_000}}, 400),  # refused by the ensemble: its error, with 400
    ({"model": "gpt-4o"}, 404),
])
def test_errors(client, kwargs, status):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    assert info.value.body["message"] and info.value.body["type"]


def test_malformed_json_is_400(endpoint):
    resp = httpx.post(f"{endpoint.base_url}/chat/completions", content=b"{not json",
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


LONG_BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "min_tokens": LONG, "num_draft_tokens": 0}


# Called directly, speculative_decoding sees the cancelled call itself ("cancelled"); through the ensemble,
# postprocessing marks the generation abandoned ("abandoned").
STOP_REASONS = {"endpoint": "cancelled", "ensemble_endpoint": "abandoned"}


@pytest.mark.parametrize("which", STOP_REASONS)
def test_a_client_that_leaves_a_stream_stops_the_generation(server, which, request):
    endpoint = request.getfixturevalue(which)
    before = len(stopped_lines(server))
    with httpx.stream("POST", f"{endpoint.base_url}/completions", json={**LONG_BODY, "stream": True},
                      timeout=60) as resp:
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    _, _, tokens = wait_for_stop(server, before, STOP_REASONS[which])
    assert tokens < LONG // 4


@pytest.mark.parametrize("which", STOP_REASONS)
def test_a_client_that_leaves_a_non_streamed_request_stops_the_generation(server, which, request):
    endpoint = request.getfixturevalue(which)
    before = len(stopped_lines(server))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{endpoint.base_url}/completions", json=LONG_BODY, timeout=httpx.Timeout(30, read=2.0))
    started = time.monotonic()
    _, _, tokens = wait_for_stop(server, before, STOP_REASONS[which])
    assert tokens < LONG and time.monotonic() - started < 15


def requests_served(server, model: str) -> int:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"]
        return sum(int(entry["inference_stats"]["success"].get("count", 0)) for entry in stats)
    finally:
        client.close()


@pytest.mark.parametrize("prompt", [PROMPT, "Ärger über 日本語 🙂 und \"Anführungszeichen\"\n\tx = 1"])
def test_direct_and_ensemble_paths_answer_the_same(server, endpoint, ensemble_endpoint, prompt):
    """The endpoint tokenizes and detokenizes as the ensemble's steps do: the same greedy text, streamed and
    not, and the same usage; the default endpoint's generations skip the ensemble, --via-ensemble's go through."""
    answers = {}
    for which, instance in (("direct", endpoint), ("ensemble", ensemble_endpoint)):
        client = openai.OpenAI(base_url=instance.base_url, api_key="unused", max_retries=0, timeout=120)
        ensemble_before = requests_served(server, MODEL)
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True) if chunk.choices)
        ensemble_calls = requests_served(server, MODEL) - ensemble_before
        assert ensemble_calls == (0 if which == "direct" else 2)
        answers[which] = (whole.choices[0].text, streamed, whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert answers["direct"] == answers["ensemble"]
    assert answers["direct"][0] == answers["direct"][1]


def test_direct_path_checks_the_prompt_as_preprocessing_does(endpoint, ensemble_endpoint):
    """A prompt over preprocessing's byte limit: the same 400 naming text_input on both paths."""
    for instance in (endpoint, ensemble_endpoint):
        resp = httpx.post(f"{instance.base_url}/completions", timeout=30,
                          json={"model": MODEL, "prompt": "x" * 70_000, "max_tokens": 4})
        assert resp.status_code == 400, resp.text
        assert "text_input: 70000 bytes exceeds the limit" in resp.json()["error"]["message"]


def test_response_format_json_schema_with_the_official_client(client):
    """OpenAI's structured outputs: the answer parses and validates, equally with speculation on and off."""
    import json

    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "population": {"type": "integer", "minimum": 0}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
    answers = []
    for extra in ({"num_draft_tokens": 0}, {}):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                response_format=response_format, extra_body=extra)
        jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
        answers.append(answer.choices[0].message.content)
    assert answers[0] == answers[1]
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
    assert choice.choices[0].text in ("alpha", "beta")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"guided_regex": "(unclosed"})
    assert "guided_decoding_guide" in info.value.message


def test_log_probabilities_with_the_official_client(client):
    """Chat logprobs with top_logprobs and completions logprobs: one entry per token, the same with speculation
    on and off."""
    messages = [{"role": "user", "content": "Say hello."}]
    answers = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body=extra)
               for extra in ({"num_draft_tokens": 0}, {"num_draft_tokens": 3})]
    contents = [answer.choices[0].logprobs.content for answer in answers]
    assert len(contents[0]) == answers[0].usage.completion_tokens > 0
    assert [c.token for c in contents[0]] == [c.token for c in contents[1]]
    assert all(abs(a.logprob - b.logprob) < 5e-4 for a, b in zip(*contents, strict=True))
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in contents[0])
    assert "".join(c.token for c in contents[0]) == answers[0].choices[0].message.content
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert "".join(logprobs.tokens) == text.choices[0].text and logprobs.text_offset[0] == 0
