"""specdec.grammar: guides compile (or are refused naming the field), rows are masked with the grammar's state
after each row's path, drafts are cut where the grammar stops admitting them, forced bytes are drafted; through
the generator, every answer matches its guide, greedy speculation (chains, trees, lookup, the grammar's own
drafts) equals constrained plain decoding, and sampled speculation keeps the masked target's law."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from specdec.config import SpeculationSettings
from specdec.drafting.base import Proposal, pruned
from specdec.errors import InvalidRequestError, UnsupportedError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.grammar import MAX_GUIDE_BYTES, Grammars, Guide
from specdec.params import ServerLimits, parse_request
from specdec.sampling import SamplingParams
from specdec.tokenizer import TextTokenizer
from specdec_client.openai_api.schemas import choice_grammar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/first_token_law.py
from first_token_law import first_token_law_pvalue  # noqa: E402

PAIR_12M = Path(__file__).resolve().parents[1] / "fixtures" / "pair_12m"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "colors"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                    "minItems": 1, "maxItems": 3}}}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe later"]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(PAIR_12M / "target")


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer.to_json(), tokenizer.vocab_size, tokenizer.end_ids)


def valid(guide: Guide, text: str) -> bool:
    if guide.type in ("json", "json_schema"):
        value = json.loads(text)
        if guide.type == "json_schema":
            jsonschema.validate(value, json.loads(guide.text))
        return True
    if guide.type == "regex":
        return re.fullmatch(guide.text, text) is not None
    return text in CHOICES


GUIDES = {"json_schema": Guide("json_schema", json.dumps(SCHEMA)), "regex": Guide("regex", PHONE),
          "choice": Guide("ebnf_grammar", choice_grammar(CHOICES)), "json": Guide("json")}


# ---- compiling ----

@pytest.mark.parametrize("guide, field, message", [
    (Guide("json_schema", "{not json"), "guided_decoding_guide", "not a valid json_schema"),
    (Guide("json_schema", "[1, 2]"), "guided_decoding_guide", "a JSON schema is an object"),
    (Guide("json_schema", '{"type": "bogus"}'), "guided_decoding_guide", "bogus"),
    (Guide("regex", "(unclosed"), "guided_decoding_guide", "unclosed group"),
    (Guide("ebnf_grammar", "root ::= ("), "guided_decoding_guide", "not a valid ebnf_grammar"),
    (Guide("regex", ""), "guided_decoding_guide", "is required"),
    (Guide("regex", "a" * (MAX_GUIDE_BYTES + 1)), "guided_decoding_guide", "at most"),
    (Guide("xml"), "guided_decoding_guide_type", "must be one of"),
])
def test_bad_guides_are_refused_naming_the_field(grammars, guide, field, message):
    with pytest.raises(InvalidRequestError, match=f"^{field}: .*{re.escape(message)}"):
        grammars.constraint(guide)


def test_structural_tags_are_refused_as_unsupported(grammars):
    with pytest.raises(UnsupportedError, match="guided_decoding_guide_type"):
        grammars.constraint(Guide("structural_tag", "{}"))


def test_guides_are_compiled_once_and_each_request_gets_its_own_state(grammars, tokenizer):
    guide = Guide("regex", "ab+c")
    first, second = grammars.constraint(guide), grammars.constraint(guide)
    assert list(grammars._matchers).count(guide) == 1
    first.consume(tokenizer.encode("a", special_tokens=False)[0])
    assert second.matcher.validate_tokens(tokenizer.encode("b", special_tokens=False)) == 0  # untouched


def test_the_guide_inputs_are_parsed_from_the_ensembles_tensors():
    def parsed(**inputs):
        arrays = {name: np.array([[value]], object) for name, value in inputs.items()}
        return parse_request({"max_tokens": np.array([[8]], np.int32), **arrays}, ServerLimits())

    assert parsed().guide is None and parsed(guided_decoding_guide_type=b"").guide is None
    assert parsed(guided_decoding_guide_type=b"json").guide == Guide("json")
    assert parsed(guided_decoding_guide_type=b"regex", guided_decoding_guide=b"a+").guide == Guide("regex", "a+")
    with pytest.raises(InvalidRequestError, match="guided_decoding_guide_type: is required"):
        parsed(guided_decoding_guide=b"a+")
    with pytest.raises(InvalidRequestError, match="guided_decoding_guide: is not valid UTF-8"):
        parsed(guided_decoding_guide_type=b"regex", guided_decoding_guide=b"\xff")


# ---- masks, cuts and forced bytes ----

def test_each_row_is_masked_with_the_state_after_its_path(grammars, tokenizer):
    constraint = grammars.constraint(GUIDES["regex"])
    digit, dash = (tokenizer.encode(t, special_tokens=False)[0] for t in ("5", "-"))
    paths = [[], [digit], [digit, digit, digit], [dash]]
    rows = constraint.allowed(paths, tokenizer.vocab_size + 5)
    assert rows[0, digit] and not rows[0, dash]
    assert rows[2, dash] and not rows[2, digit]  # after three digits only the dash (or a token holding it)
    assert rows[3].all()  # a path the grammar refuses is never reached: its row is left alone
    assert not rows[:3, tokenizer.vocab_size:].any()  # the model's padding columns are never admitted
    for path, row in zip(paths[:3], rows[:3], strict=True):  # the same as consuming the path for real
        fresh = grammars.constraint(GUIDES["regex"])
        for token in path:
            fresh.consume(token)
        np.testing.assert_array_equal(fresh.allowed([[]], tokenizer.vocab_size)[0], row[:tokenizer.vocab_size])
    assert constraint.admitted(paths[1:]) == [True, True, False]


def test_the_end_is_admitted_only_where_the_grammar_can_end_and_as_the_requests_end_token(grammars, tokenizer):
    end = next(iter(tokenizer.end_ids))
    constraint = grammars.constraint(GUIDES["choice"], end_ids=[7])
    yes = tokenizer.encode("yes", special_tokens=False)
    rows = constraint.allowed([[], yes], tokenizer.vocab_size)
    assert not rows[0, 7] and rows[1, 7] and not rows[1, end]


def test_pruning_keeps_the_admitted_nodes_and_their_descendants_only():
    proposal = Proposal([10, 11, 12, 13, 14], [-1, -1, 0, 1, 2], 3)
    kept = pruned(proposal, [True, False, True, True, False])
    assert (kept.tokens, kept.parents, kept.depth) == ([10, 12], [-1, 0], 2)  # 13's parent 11 was cut
    assert pruned(proposal, [False] * 5) is None
    assert pruned(proposal, [True] * 5) is proposal


def test_forced_bytes_are_drafted_as_the_tokenizers_spelling(grammars, tokenizer):
    constraint = grammars.constraint(GUIDES["json_schema"])
    forced = constraint.forced(16)
    assert tokenizer.decode(forced).startswith('{"name": ')
    assert constraint.admitted([forced]) == [True]
    assert len(constraint.forced(2)) == 2


# ---- through the generator ----

def generate(backend, request: GenerationRequest, stats: GenerationStats | None = None) -> list[int]:
    async def collect() -> list[int]:
        out: list[int] = []
        async for update in SpeculativeGenerator(backend, 200).generate(request, 1, stats):
            out.extend(update.token_ids)
        return out

    return asyncio.run(collect())


@pytest.fixture(scope="module")
def backend(make_inprocess_backend):
    return make_inprocess_backend((PAIR_12M / "target", PAIR_12M / "draft"), max_length=200)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in ('{"name": "Ada", "age":', "The quick brown fox")]


SHAPES = {"chain": ("model", 4, 1, True), "tree": ("model", 3, 3, True), "lookup": ("ngram", 4, 1, False),
          "chain, no grammar drafts": ("model", 4, 1, False)}


@pytest.mark.parametrize("name", list(GUIDES))
def test_greedy_speculation_under_a_guide_equals_constrained_plain_decoding(backend, grammars, tokenizer, prompts,
                                                                           name):
    guide = GUIDES[name]
    forced = pruned_tokens = 0
    for prompt in prompts:
        plain = generate(backend, GenerationRequest(prompt, 80, tokenizer.end_ids, grammar=grammars.constraint(guide)))
        assert valid(guide, tokenizer.decode(plain)), tokenizer.decode(plain)
        for shape, (drafter, k, candidates, grammar_drafting) in SHAPES.items():
            stats = GenerationStats()
            settings = SpeculationSettings("json", drafter, k, k, candidates, "greedy", 0.7,
                                           grammar_drafting=grammar_drafting)
            spec = generate(backend, GenerationRequest(prompt, 80, tokenizer.end_ids, settings=settings,
                                                       grammar=grammars.constraint(guide)), stats)
            assert spec == plain, (name, shape)
            forced += stats.grammar_accepted_tokens
            pruned_tokens += stats.grammar_pruned_tokens
    if name == "json_schema":
        assert forced > 0 and pruned_tokens > 0  # both paths were exercised


def test_every_held_out_bench_schema_is_followed_plain_and_speculative(backend, grammars, tokenizer):
    """The structured bench's eight schemas (nested objects, arrays with min / max items, enums, numbers with
    ranges, strings with lengths and patterns): every answer parses and validates, the same with speculation."""
    from specdec_client.bench_structured import REQUESTS

    settings = SpeculationSettings("json", "ngram", 4, 4, 1, "greedy", 0.7, grammar_drafting=True)
    for text, schema in REQUESTS:
        prompt = tokenizer.encode(text)
        guide = Guide("json_schema", json.dumps(schema))
        plain = generate(backend, GenerationRequest(prompt, 160, tokenizer.end_ids, grammar=grammars.constraint(guide)))
        stats = GenerationStats()
        spec = generate(backend, GenerationRequest(prompt, 160, tokenizer.end_ids, settings=settings,
                                                   grammar=grammars.constraint(guide)), stats)
        assert spec == plain, text
        jsonschema.validate(json.loads(tokenizer.decode(plain)), schema)
        assert stats.drafter == "grammar+ngram"


def test_grammar_drafts_save_target_calls(backend, grammars, tokenizer, prompts):
    calls = {}
    for grammar_drafting in (False, True):
        stats = GenerationStats()
        settings = SpeculationSettings("json", "model", 4, 4, 1, "greedy", 0.7, grammar_drafting=grammar_drafting)
        generate(backend, GenerationRequest(prompts[0], 80, tokenizer.end_ids, settings=settings,
                                            grammar=grammars.constraint(GUIDES["json_schema"])), stats)
        calls[grammar_drafting] = stats.target_calls
        assert stats.grammar_draft_tokens == (stats.grammar_draft_tokens if grammar_drafting else 0)
    assert calls[True] < calls[False]


@pytest.mark.parametrize("name", ["json_schema", "regex"])
def test_sampled_speculation_under_a_guide_is_valid_and_reproducible(backend, grammars, tokenizer, prompts, name):
    guide = GUIDES[name]
    settings = SpeculationSettings("json", "model", 4, 4, 1, "rejection", 0.7, grammar_drafting=True)
    for seed in range(4):
        request = GenerationRequest(prompts[1], 80, tokenizer.end_ids, settings=settings,
                                    sampling=SamplingParams(1.0, seed=seed), grammar=grammars.constraint(guide))
        first = generate(backend, request)
        assert valid(guide, tokenizer.decode(first)), tokenizer.decode(first)
        request.grammar = grammars.constraint(guide)
        assert generate(backend, request) == first


def test_a_masked_target_keeps_its_law_under_rejection_sampling_from_an_unmasked_draft(grammars, tokenizer):
    """A sampled model proposal is not cut (cutting would change what the residuals correct for): the first token
    of a verification is then distributed as the masked target's p, whatever q proposes outside the mask."""
    vocab = tokenizer.vocab_size
    rng = np.random.default_rng(0)
    logits = rng.normal(size=vocab) * 2
    allowed = grammars.constraint(GUIDES["regex"]).allowed([[]], vocab)[0]  # ten digits (and tokens of digits)
    masked = np.where(allowed, logits, -np.inf)
    p = np.exp(masked - masked.max())
    p /= p.sum()
    q = np.exp(logits - logits.max())
    q /= q.sum()
    q = 0.5 * q + 0.5 * p  # the draft puts half its mass where the grammar forbids
    assert q[~allowed].sum() > 0.4
    assert first_token_law_pvalue(p, q, draws=40_000) > 1e-3


# ---- with the EAGLE head ----

def test_the_eagle_head_with_the_grammars_drafts_keeps_the_constrained_answer(grammars, tokenizer, prompts,
                                                                            make_inprocess_backend, make_eagle_head):
    import tempfile

    from specdec.engines import DraftEngine
    from specdec.runtime.torch_llama import TorchLlamaRuntime

    with tempfile.TemporaryDirectory() as folder:
        eagle_dir = make_eagle_head(Path(folder) / "eagle", PAIR_12M / "target", seed=3)
        with_eagle = make_inprocess_backend((PAIR_12M / "target", PAIR_12M / "draft"), max_length=200)
        with_eagle.eagle = DraftEngine(TorchLlamaRuntime(eagle_dir, num_slots=4, max_length=200), idle_timeout_s=60)
        guide = GUIDES["json_schema"]
        for prompt in prompts:
            plain = generate(with_eagle, GenerationRequest(prompt, 80, tokenizer.end_ids,
                                                           grammar=grammars.constraint(guide)))
            stats = GenerationStats()
            settings = SpeculationSettings("json", "eagle", 3, 3, 1, "greedy", 0.7, grammar_drafting=True)
            spec = generate(with_eagle, GenerationRequest(prompt, 80, tokenizer.end_ids, settings=settings,
                                                          grammar=grammars.constraint(guide)), stats)
            assert spec == plain
            assert stats.draft_calls > 0 and stats.grammar_accepted_tokens > 0


def test_a_constrained_request_drafts_with_the_constrained_drafter_at_any_temperature():
    from specdec.config import SpeculationConfig, resolve

    config = SpeculationConfig.load(Path(__file__).resolve().parents[2] / "model_repository" / "speculative_decoding"
                                    / "1" / "profiles.yaml")
    common = dict(num_draft_tokens=None, num_candidates=None, acceptance=None, verify_threshold=None)
    for sampling in (False, True):
        settings = resolve(config, "json", None, drafter=None, sampling=sampling, constrained=True, **common)
        assert settings.drafter == config.constrained_drafter == "ngram" and settings.enabled
        assert settings.grammar_drafting
    assert not resolve(config, "json", None, drafter=None, sampling=True, **common).enabled  # unconstrained
    assert resolve(config, "json", None, drafter="eagle", sampling=False, constrained=True, **common).drafter == "eagle"
    plain = resolve(config, "json", None, drafter=None, sampling=False, constrained=True,
                    **{**common, "num_draft_tokens": 0})
    assert not plain.enabled and not plain.grammar_drafting


def test_a_tokenizer_the_engine_cannot_read_refuses_guides_only():
    from tokenizers import Tokenizer, decoders, models

    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    grammars = Grammars(wordpiece.to_str(), 3, [0])  # made without complaint: the server loads
    for _ in range(2):
        with pytest.raises(UnsupportedError, match="guided_decoding_guide_type: guided decoding is not available"):
            grammars.constraint(Guide("json"))
