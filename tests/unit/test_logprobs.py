"""specdec.logprobs: log-probabilities are the log-softmax of the rows that chose the tokens; through the
generator they are equal between plain and speculative decoding (chains, trees, prompt lookup), with logits
options and a grammar, and equal to a fresh forward over the answer; the ensemble's inputs are parsed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from specdec.config import SpeculationSettings
from specdec.errors import InvalidRequestError
from specdec.generation import GenerationRequest, SpeculativeGenerator
from specdec.grammar import Grammars, Guide
from specdec.logits_processing import LogitsOptions
from specdec.logprobs import token_logprobs
from specdec.params import ServerLimits, parse_request
from specdec.tokenizer import TextTokenizer
from transformers import LlamaForCausalLM

PAIR_12M = Path(__file__).resolve().parents[1] / "fixtures" / "pair_12m"


def test_log_probabilities_are_the_rows_log_softmax_with_the_top_tokens_in_order():
    rows = np.log(np.array([[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]]))
    rows[1, 0] = -np.inf  # forbidden (a grammar's mask)
    first, second = token_logprobs(rows + 3.0, [1, 3], top=3)
    assert first.logprob == pytest.approx(np.log(0.25)) and second.logprob == pytest.approx(np.log(0.4 / 0.9))
    assert [t for t, _ in first.top] == [0, 1, 2]  # ties in probability: by id
    assert [t for t, _ in second.top] == [3, 2, 1]
    assert token_logprobs(rows[1:], [2], top=4)[0].top[-1][0] == 1  # the forbidden token is left out
    assert token_logprobs(rows[:1], [0], top=0)[0].top == ()


def test_the_ensembles_inputs_ask_for_them():
    def parsed(**inputs):
        return parse_request({"max_tokens": np.array([[8]], np.int32), **inputs}, ServerLimits())

    assert parsed().logprobs is None
    assert parsed(return_log_probs=np.array([[True]])).logprobs == 0
    assert parsed(return_log_probs=np.array([[True]]), num_top_log_probs=np.array([[5]], np.int32)).logprobs == 5
    with pytest.raises(InvalidRequestError, match="num_top_log_probs"):
        parsed(return_log_probs=np.array([[True]]), num_top_log_probs=np.array([[21]], np.int32))
    with pytest.raises(InvalidRequestError, match="num_top_log_probs: needs return_log_probs"):
        parsed(num_top_log_probs=np.array([[2]], np.int32))


@pytest.fixture(scope="module")
def backend(make_inprocess_backend):
    return make_inprocess_backend((PAIR_12M / "target", PAIR_12M / "draft"), max_length=160)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(PAIR_12M / "target")


def generate(backend, request: GenerationRequest) -> tuple[list[int], list]:
    async def collect():
        tokens, logprobs = [], []
        async for update in SpeculativeGenerator(backend, 160).generate(request, 1):
            tokens += update.token_ids
            logprobs += update.logprobs
        return tokens, logprobs

    return asyncio.run(collect())


SHAPES = [None, SpeculationSettings("text", "model", 4, 4, 1, "greedy", 0.7),
          SpeculationSettings("text", "model", 3, 3, 3, "greedy", 0.7),
          SpeculationSettings("text", "ngram", 4, 4, 1, "greedy", 0.7)]


@pytest.mark.parametrize("case", ["raw", "penalties", "grammar"])
def test_speculation_reports_the_log_probabilities_plain_decoding_does(backend, tokenizer, case):
    prompt = tokenizer.encode('{"name": "Ada", "age":')
    grammars = Grammars(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.end_ids)
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                         "required": ["city"]})
    answers = []
    for settings in SHAPES:
        request = GenerationRequest(prompt, 30, tokenizer.end_ids, settings=settings, logprobs=3,
                                    logits_options=LogitsOptions(frequency_penalty=0.5) if case == "penalties"
                                    else LogitsOptions(),
                                    grammar=grammars.constraint(Guide("json_schema", schema))
                                    if case == "grammar" else None)
        answers.append(generate(backend, request))
    tokens, logprobs = answers[0]
    assert len(logprobs) == len(tokens) > 3
    for token, entry in zip(tokens, logprobs, strict=True):
        assert entry.logprob <= 0 and 1 <= len(entry.top) <= 3 and entry.top[0][1] >= entry.logprob
        assert entry.top[0][0] == token  # greedy: the chosen token is its row's most probable (a grammar may leave one)
    for other_tokens, other in answers[1:]:
        assert other_tokens == tokens
        np.testing.assert_allclose([e.logprob for e in other], [e.logprob for e in logprobs], atol=2e-4)
        assert [[t for t, _ in e.top] for e in other] == [[t for t, _ in e.top] for e in logprobs]


def test_they_equal_a_fresh_forward_over_the_answer(backend, tokenizer):
    prompt = tokenizer.encode("The quick brown fox")
    tokens, logprobs = generate(backend, GenerationRequest(prompt, 20, tokenizer.end_ids, logprobs=0,
                                                           settings=SHAPES[1]))
    model = LlamaForCausalLM.from_pretrained(PAIR_12M / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
    np.testing.assert_allclose([e.logprob for e in logprobs], expected.numpy(), atol=2e-3)
