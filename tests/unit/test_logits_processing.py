"""specdec.logits_processing: each option as its definition says, every row with its own path's context, bad words
matched across the context and the path; through the generator, greedy speculation (chains, trees, lookup) with
the options equals plain decoding with them, and stop sequences end the output."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from specdec.config import SpeculationSettings
from specdec.errors import InvalidRequestError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.logits_processing import LogitsOptions
from specdec.params import ServerLimits, parse_request
from specdec.sampling import SamplingParams
from specdec.tokenizer import TextTokenizer

VOCAB = 12


def rows(count: int = 1) -> np.ndarray:
    return np.tile(np.linspace(-3.0, 3.0, VOCAB), (count, 1))


def test_defaults_change_nothing():
    options = LogitsOptions()
    assert not options.active
    np.testing.assert_array_equal(options.apply(rows(), [1, 2, 3], 2, [[]]), rows())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    base = rows()[0]
    out = LogitsOptions(repetition_penalty=2.0).apply(rows(), [0, 11], 1, [[]])[0]
    assert out[11] == base[11] / 2 and out[0] == base[0] * 2  # the prompt counts (token 0) as the output does
    np.testing.assert_array_equal(np.delete(out, [0, 11]), np.delete(base, [0, 11]))


def test_presence_and_frequency_penalties_count_the_output_only():
    base = rows()[0]
    out = LogitsOptions(presence_penalty=0.5, frequency_penalty=0.25).apply(rows(), [4, 5, 5, 6, 6, 6], 1, [[]])[0]
    assert out[4] == base[4]  # in the prompt only
    assert out[5] == pytest.approx(base[5] - 0.5 - 2 * 0.25)
    assert out[6] == pytest.approx(base[6] - 0.5 - 3 * 0.25)


def test_each_row_counts_the_draft_tokens_on_its_path():
    options = LogitsOptions(frequency_penalty=1.0)
    out = options.apply(rows(3), [1], 1, [[], [7], [7, 7]])
    base = rows()[0]
    assert [out[r][7] for r in range(3)] == pytest.approx([base[7], base[7] - 1, base[7] - 2])


def test_logit_bias_adds_to_the_named_tokens():
    out = LogitsOptions(logit_bias=((3, -100.0), (9, 5.0))).apply(rows(), [1], 1, [[]])[0]
    base = rows()[0]
    assert out[3] == base[3] - 100 and out[9] == base[9] + 5


def test_bad_words_are_never_completed_across_context_and_path():
    options = LogitsOptions(bad_words=((2,), (4, 5, 6)))
    out = options.apply(rows(4), [1, 4], 1, [[], [5], [3], [5, 6]])
    assert np.isneginf(out[:, 2]).all()  # a one-token bad word: never
    assert np.isneginf(out[1, 6]) and not np.isinf(out[0, 6]) and not np.isinf(out[2, 6])  # 4 (context), 5 (path)
    assert not np.isinf(out[3, 6])
    out = options.apply(rows(1), [4, 5], 2, [[]])  # wholly in the context (the prompt)
    assert np.isneginf(out[0, 6])


# ---- through the generator: greedy speculation with the options equals greedy plain decoding with them ----

OPTIONS = {
    "repetition": LogitsOptions(repetition_penalty=1.3),
    "presence+frequency": LogitsOptions(presence_penalty=0.8, frequency_penalty=0.6),
    "bias+bad-words": LogitsOptions(logit_bias=((5, 3.0), (17, -100.0)), bad_words=((42,), (66, 3))),
}


def generate(backend, request: GenerationRequest, stats: GenerationStats | None = None) -> list[int]:
    async def collect() -> list[int]:
        out: list[int] = []
        async for update in SpeculativeGenerator(backend, 160).generate(request, 1, stats):
            out.extend(update.token_ids)
        return out

    return asyncio.run(collect())


PAIR_12M = Path(__file__).resolve().parents[1] / "fixtures" / "pair_12m"


@pytest.fixture(scope="module")
def backend(make_inprocess_backend):
    """The trained 12M pair: its draft agrees with its target often enough for paths to be accepted."""
    return make_inprocess_backend((PAIR_12M / "target", PAIR_12M / "draft"), max_length=160)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = TextTokenizer(PAIR_12M / "target")
    return [tokenizer.encode(text) for text in ("The quick brown fox", "def add(a, b):\n    return",
                                                  '{"name": "Ada", "age":')]


@pytest.mark.parametrize("shape", [(4, 1, "model"), (3, 3, "model"), (4, 1, "ngram")],
                         ids=["chain", "tree", "lookup"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_greedy_speculation_with_options_equals_plain_decoding_with_them(backend, prompts, name, shape):
    options = OPTIONS[name]
    k, candidates, drafter = shape
    accepted = 0
    for prompt in prompts:
        plain = generate(backend, GenerationRequest(prompt, 30, logits_options=options))
        assert plain != generate(backend, GenerationRequest(prompt, 30)) or name == "bias+bad-words"
        stats = GenerationStats()
        spec = generate(backend, GenerationRequest(
            prompt, 30, logits_options=options,
            settings=SpeculationSettings("text", drafter, k, k, candidates, "greedy", 0.7)), stats)
        assert spec == plain, (name, shape, prompt)
        assert stats.verification_passes > 0
        accepted += stats.accepted_draft_tokens
        if name == "bias+bad-words":
            assert 17 not in plain and 42 not in plain
            assert all(plain[i:i + 2] != [66, 3] for i in range(len(plain) - 1))
    assert accepted > 0, "no draft token was accepted: the paths were never exercised"


def test_stop_texts_end_the_output_at_the_token_that_completes_one(backend, prompts):
    """A stop text inside the plain answer (spanning tokens, starting mid-token) ends it at the token that
    completes the text, plain and speculative alike; one that never appears changes nothing."""
    decode = TextTokenizer(PAIR_12M / "target").decode
    plain = generate(backend, GenerationRequest(prompts[1], 30))
    text = decode(plain)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    end = next(n for n in range(1, len(plain) + 1) if stop in decode(plain[:n]))
    for settings in (None, SpeculationSettings("text", "ngram", 4, 4, 1, "greedy", 0.7),
                     SpeculationSettings("text", "model", 3, 3, 3, "greedy", 0.7)):
        out = generate(backend, GenerationRequest(prompts[1], 30, stop_texts=(stop, "never there"), decode=decode,
                                                  settings=settings))
        assert out == plain[:end], settings
    assert generate(backend, GenerationRequest(prompts[1], 30, stop_texts=("never there",), decode=decode)) == plain


def test_sampled_speculation_with_options_is_reproducible_and_respects_bad_words(backend, prompts):
    options = LogitsOptions(frequency_penalty=0.5, bad_words=((42,),))
    request = GenerationRequest(prompts[0], 30, sampling=SamplingParams(0.9, seed=3), logits_options=options,
                                settings=SpeculationSettings("text", "model", 3, 3, 1, "rejection", 0.7))
    first = generate(backend, request)
    assert first == generate(backend, request) and 42 not in first


# ---- the ensemble's inputs ----

def parsed(**inputs):
    return parse_request({"max_tokens": np.array([[8]], np.int32), **inputs}, ServerLimits())


def test_penalties_bias_and_words_are_parsed_from_the_ensembles_inputs():
    options = parsed(repetition_penalty=np.array([[1.2]], np.float32), presence_penalty=np.array([[0.5]], np.float32),
                     frequency_penalty=np.array([[-0.5]], np.float32),
                     logit_bias_ids=np.array([[4, 9]], np.int32), logit_bias_values=np.array([[-100, 2]], np.float32),
                     bad_words=np.array([[b"foo", b""]], object), stop_words=np.array([[b"\n\n"]], object))
    assert options.logits.repetition_penalty == pytest.approx(1.2)
    assert (options.logits.presence_penalty, options.logits.frequency_penalty) == (0.5, -0.5)
    assert options.logits.logit_bias == ((4, -100.0), (9, 2.0))
    assert options.bad_words == ("foo",) and options.stop_words == ("\n\n",)
    assert not parsed().logits.active and parsed(stop_words=np.array([[b""]], object)).stop_words == ()


@pytest.mark.parametrize("inputs, field", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"presence_penalty": 1e9}, "presence_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"logit_bias_ids": [[1, 2]], "logit_bias_values": [[1.0]]}, "logit_bias_values"),
    ({"logit_bias_ids": [[1]], "logit_bias_values": [[101.0]]}, "logit_bias_values"),
    ({"logit_bias_ids": [[3, 3]], "logit_bias_values": [[1.0, 2.0]]}, "logit_bias_ids"),
    ({"bad_words": [[b"\xff"]]}, "bad_words"),
    ({"length_penalty": 0.5}, "length_penalty"),
])
def test_bad_values_are_refused_naming_the_field(inputs, field):
    arrays = {name: np.array(value if isinstance(value, list) else [[value]],
                             object if name.endswith("words") else np.float32) for name, value in inputs.items()}
    with pytest.raises(InvalidRequestError, match=field):
        parsed(**arrays)
