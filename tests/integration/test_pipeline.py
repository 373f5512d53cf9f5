"""End to end through a real tritonserver: lossless greedy speculation, streaming, concurrency, bad input."""

from __future__ import annotations

import json
import queue
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
import tritonclient.grpc as grpcclient
from specdec_client.api import GenerationError, generate_grpc, generate_http
from specdec_client.scrape import scrape, wait_for
from transformers import AutoTokenizer, LlamaForCausalLM

pytestmark = pytest.mark.integration
MAX_TOKENS = 40


def ids_of(server, prompt: str, k: int) -> str:
    params = {"text_input": prompt, "max_tokens": MAX_TOKENS, "num_draft_tokens": k, "exclude_input_in_output": True}
    return generate_grpc(server.grpc_url, params)


@pytest.fixture(scope="module")
def plain_outputs(server, all_prompts):
    return {prompt: ids_of(server, prompt, 0) for _, prompt in all_prompts}


def test_prompt_set_covers_three_domains(all_prompts):
    assert len(all_prompts) >= 20 and {d for d, _ in all_prompts} == {"json", "code", "text"}


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculation_equals_plain_decoding(server, all_prompts, plain_outputs, k):
    drafted = 0
    for _, prompt in all_prompts:
        result = ids_of(server, prompt, k)
        assert result.text == plain_outputs[prompt].text, (k, prompt)
        # A second token needs an iteration, which drafts (a first-token end leaves nothing to draft).
        assert result.stats["total_draft_tokens"] > 0 or result.num_output_tokens < 2
        drafted += result.stats["total_draft_tokens"]
        assert 0 <= result.stats["total_accepted_draft_tokens"] <= result.stats["total_draft_tokens"]
        rate = result.stats["total_accepted_draft_tokens"] / max(result.stats["total_draft_tokens"], 1)
        assert result.stats["acceptance_rate"] == pytest.approx(rate, abs=1e-6)
    assert drafted > 0


def test_plain_decoding_equals_hugging_face_generate(server, all_prompts, plain_outputs):
    model_dir = Path(server.model_repository) / "target_model" / "1"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    for _, prompt in all_prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tokenizer.pad_token_id)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert plain_outputs[prompt].text == expected, prompt
        assert plain_outputs[prompt].num_output_tokens == len([t for t in out[0, ids.shape[1]:] if t != eos])


def test_streaming_grpc_and_sse_assemble_to_the_same_text(server, all_prompts, plain_outputs):
    for _, prompt in all_prompts[::4]:
        params = {"text_input": prompt, "max_tokens": MAX_TOKENS, "num_draft_tokens": 4, "stream": True}
        grpc_stream = generate_grpc(server.grpc_url, params)
        sse = generate_http(server.http_url, params)
        assert grpc_stream.text == plain_outputs[prompt].text
        assert sse.text == plain_outputs[prompt].text
        # Equal concatenations also prove no chunk split a character (each half would decode to U+FFFD).
        # One chunk per iteration (a few tokens may wait for a whole character).
        assert len(grpc_stream.chunks) > 1 or grpc_stream.num_output_tokens < 5


def test_http_generate_returns_one_response_with_stats(server):
    resp = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate",
                         json={"text_input": "def add(a, b):", "max_tokens": 16}, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["text_output"].startswith("def add(a, b):")  # the prompt is echoed unless excluded
    for name in ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_output_tokens"):
        assert name in body


@pytest.mark.parametrize("draft", [5, None], ids=["k5", "profile"])
def test_concurrent_streams_match_sequential(server, all_prompts, plain_outputs, draft):
    """16 streams at once (the profile's drafter, or a fixed k) each give their single-stream plain answer, and the
    target serves several of them in one execution, as one packed request (specdec.waves, specdec.packing)."""
    prompts = [p for _, p in all_prompts[:16]]
    assert len(prompts) == 16

    def run(prompt):
        params = {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True, "exclude_input_in_output": True}
        if draft is not None:
            params["num_draft_tokens"] = draft
        return generate_grpc(server.grpc_url, params).text

    before = scrape(server.metrics_url)
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together == [plain_outputs[p].text for p in prompts]

    def executions_of_five_or_more(now) -> float:
        delta = (now - before).values("specdec_decoder_executions_total", model="target_model")
        return sum(value for labels, value in delta if int(labels["batch_size"]) >= 8)

    # The decoders publish their execution counts once a second.
    after = wait_for(server.metrics_url, lambda now: executions_of_five_or_more(now) > 0, timeout_s=10.0)
    assert executions_of_five_or_more(after) > 0
    # A wave's steps travel as one request (specdec.packing): fewer requests reached target_model than steps (each
    # sequence's first step and its END go alone), far fewer where the profile decodes plain and waves stay whole
    # (unpacked, every step would be a request). Plain calls pick plain_steps tokens each, so a plain sequence
    # makes few steps besides its first and its END: those are left out of the profile's count (a full-suite run
    # on 2 busy cores measured 132 such steps in 52 requests).
    steps = (after - before).total("specdec_decoder_steps_total", model="target_model")
    requests_served = (after - before).total("nv_inference_request_success", model="target_model")
    if draft is None:
        alone = 2 * len(prompts)
        assert requests_served - alone < (steps - alone) / 2, (requests_served, steps)
    else:
        assert requests_served < steps / 1.5, (requests_served, steps)


def test_concurrent_seeded_sampled_streams_match_their_single_stream_answers(server, all_prompts):
    """Plain sampled steps draw their tokens in target_model (specdec.sampling.sample_rows): a seeded answer is the
    same alone (one request per step) and among 8 streams (packed waves, several rows drawn at once)."""
    prompts = [p for _, p in all_prompts[:8]]

    def run(prompt):
        params = {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True,
                  "num_draft_tokens": 0, "temperature": 0.8, "top_p": 0.95, "seed": 17}
        return generate_grpc(server.grpc_url, params).text

    alone = [run(prompt) for prompt in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, prompts))
    assert together == alone
    assert len(set(alone)) == len(alone)


def test_penalties_bias_and_words_through_the_ensemble(server, all_prompts):
    """Penalties, a logit bias and bad words change the greedy answer, equally with and without speculation (chain
    and tree); stop_words end it on the first word it completes."""
    prompt = all_prompts[0][1]
    base = {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
    unprocessed = generate_grpc(server.grpc_url, {**base, "num_draft_tokens": 0}).text
    options = {"frequency_penalty": 0.7, "repetition_penalty": 1.2, "bad_words": [" the", " a"],
               "logit_bias_ids": [11], "logit_bias_values": [-100.0]}
    plain = generate_grpc(server.grpc_url, {**base, **options, "num_draft_tokens": 0}).text
    assert plain != unprocessed
    for shape in ({"num_draft_tokens": 4}, {"num_draft_tokens": 3, "num_candidates": 3}):
        assert generate_grpc(server.grpc_url, {**base, **options, **shape}).text == plain, shape
    word = unprocessed.split()[3]
    stopped = generate_grpc(server.grpc_url, {**base, "stop_words": [word], "num_draft_tokens": 4})
    completed = unprocessed.index(word) + len(word)  # where the answer first completes the word
    assert unprocessed.startswith(stopped.text) and completed <= len(stopped.text) < completed + 16


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colors"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                    "minItems": 1, "maxItems": 3}}}


@pytest.mark.parametrize("guide_type, guide", [("json_schema", json.dumps(SCHEMA)), ("regex", r"[0-9]{3}-[0-9]{4}"),
                                               ("ebnf_grammar", 'root ::= "yes" | "no" | "maybe later"'),
                                               ("json", "")])
def test_structured_outputs_through_the_ensemble(server, all_prompts, guide_type, guide):
    """TensorRT-LLM's guided_decoding inputs: every answer matches its guide, and greedy speculation (chain, tree,
    the profile's default with the grammar's own drafts) gives the constrained plain answer."""
    import jsonschema

    for _, prompt in all_prompts[:3]:
        base = {"text_input": prompt, "max_tokens": 80, "exclude_input_in_output": True,
                "guided_decoding_guide_type": guide_type, "guided_decoding_guide": guide}
        plain = generate_grpc(server.grpc_url, {**base, "num_draft_tokens": 0})
        if guide_type == "json_schema":
            jsonschema.validate(json.loads(plain.text), SCHEMA)
        elif guide_type == "json":
            json.loads(plain.text)
        elif guide_type == "regex":
            assert re.fullmatch(guide, plain.text), plain.text
        else:
            assert plain.text in ("yes", "no", "maybe later")
        for shape in ({}, {"num_draft_tokens": 4}, {"num_draft_tokens": 3, "num_candidates": 3}):
            assert generate_grpc(server.grpc_url, {**base, **shape}).text == plain.text, (prompt, shape)


def test_log_probabilities_through_the_ensemble(server, all_prompts):
    """return_log_probs: output_log_probs / cum_log_probs (TensorRT-LLM's) and the tokens they belong to, streamed
    or not, equal between plain and speculative decoding (chain and tree), with a grammar too."""
    for _, prompt in all_prompts[:3]:
        base = {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True,
                "return_log_probs": True, "num_top_log_probs": 2}
        plain = generate_grpc(server.grpc_url, {**base, "num_draft_tokens": 0})
        assert len(plain.log_probs) == len(plain.token_ids) == plain.num_output_tokens > 0
        assert all(value <= 0 for value in plain.log_probs)
        assert plain.cum_log_prob == pytest.approx(sum(plain.log_probs), abs=1e-3)
        for shape in ({"num_draft_tokens": 4}, {"num_draft_tokens": 3, "num_candidates": 3}, {"stream": True}):
            other = generate_grpc(server.grpc_url, {**base, **shape})
            assert other.token_ids == plain.token_ids, shape
            np.testing.assert_allclose(other.log_probs, plain.log_probs, atol=5e-4)
    assert not generate_grpc(server.grpc_url, {"text_input": "hi", "max_tokens": 4}).log_probs


def grpc_error(server, inputs: list[grpcclient.InferInput]) -> str:
    """The error a gRPC stream (decoupled models need one) answers to these raw inputs."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    try:
        client.async_stream_infer("ensemble", inputs)
        error = answers.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert error is not None, "the request succeeded"
    return str(error)


def tensor(name: str, value, dtype) -> grpcclient.InferInput:
    array = np.array([[value]], dtype=dtype)
    from tritonclient.utils import np_to_triton_dtype

    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"text_input": "", "max_tokens": 8}, "text_input"),
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "hi", "max_tokens": -5}, "max_tokens"),
        ({"text_input": "hi", "max_tokens": 10**6}, "max_tokens"),
        ({"text_input": "hi", "max_tokens": 8, "num_draft_tokens": 99}, "num_draft_tokens"),
        ({"text_input": "hi", "max_tokens": 8, "num_draft_tokens": -1}, "num_draft_tokens"),
        ({"text_input": "hi", "max_tokens": 8, "beam_width": 2}, "beam_width"),
        ({"text_input": "hi", "max_tokens": 8, "task": "poetry"}, "task"),
        ({"text_input": "hi", "max_tokens": 8, "guided_decoding_guide_type": "regex",
          "guided_decoding_guide": "(unclosed"}, "guided_decoding_guide"),
        ({"text_input": "hi", "max_tokens": 8, "guided_decoding_guide_type": "json_schema",
          "guided_decoding_guide": "{not json"}, "guided_decoding_guide"),
        ({"text_input": "hi", "max_tokens": 8, "guided_decoding_guide_type": "xml"}, "guided_decoding_guide_type"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server, params, field):
    with pytest.raises(GenerationError, match=field):
        generate_grpc(server.grpc_url, params)
    resp = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", json=params, timeout=60)
    assert resp.status_code == 400 and field in resp.json()["error"]
    assert generate_grpc(server.grpc_url, {"text_input": "ok", "max_tokens": 4}).num_output_tokens > 0


def test_wrong_dtype_and_invalid_utf8_are_rejected(server):
    message = grpc_error(server, [tensor("text_input", b"hi", np.object_), tensor("max_tokens", 8.5, np.float32)])
    assert "max_tokens" in message and "FP32" in message
    message = grpc_error(server, [tensor("text_input", b"\xff\xfe bad", np.object_), tensor("max_tokens", 8, np.int32)])
    assert "text_input" in message and "UTF-8" in message
    resp = requests.post(f"http://{server.http_url}/v2/models/ensemble/generate",
                         data=json.dumps({"text_input": "hi", "max_tokens": "eight"}), timeout=60)
    # Triton 2.51's /generate front end answers JSON type errors itself, with 500 and a parse message.
    assert resp.status_code in (400, 500) and "Unable to parse" in resp.json()["error"]
    assert generate_grpc(server.grpc_url, {"text_input": "ok", "max_tokens": 4}).num_output_tokens > 0
