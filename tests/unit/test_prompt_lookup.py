"""Prompt lookup in front of a model drafter (`model+ngram`, `eagle+ngram`): the incremental n-gram index
answers as the reference scan, the combined drafters stay lossless, the model drafts where lookup finds
nothing, and the profile options resolve and degrade as the other drafters do."""

from __future__ import annotations

import asyncio
import random

import pytest
from specdec.config import SpeculationConfig, SpeculationSettings, drafters_served, resolve
from specdec.drafting.ngram import NgramIndex, PromptLookup, lookup
from specdec.errors import InvalidRequestError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator

MAX_LENGTH = 160
# Repeats itself: the suffix "7 1 2 3" matched earlier, so lookup proposes from the first iteration on.
REPEATING = [7, 1, 2, 3, 4, 5, 6, 9, 11, 7, 1, 2, 3]


@pytest.mark.parametrize("seed", range(6))
def test_the_index_answers_as_the_scan_of_the_whole_context(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    min_ngram = rng.choice([1, 2])
    max_ngram = rng.choice([min_ngram, 3, 4])
    index = NgramIndex(max_ngram, min_ngram)
    tokens: list[int] = []
    for _ in range(120):
        tokens.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 3])))
        k = rng.choice([1, 4, 12])
        assert index.propose(tokens, k) == lookup(tokens, k, max_ngram, min_ngram)


def test_the_index_refuses_an_empty_range_of_ngrams():
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=2, min_ngram=3)


def generate(backend, drafter: str, k: int, prompt: list[int], candidates: int = 1, max_tokens: int = 48,
             lookup_length: int = 6, adaptive: bool = False) -> tuple[list[int], GenerationStats]:
    settings = SpeculationSettings("text", drafter, k, k, candidates, "greedy", 0.7, explicit_length=True,
                                   prompt_lookup=PromptLookup(length=lookup_length, min_ngram=1, adaptive=adaptive))
    generator = SpeculativeGenerator(backend, MAX_LENGTH)
    stats = GenerationStats()

    async def run() -> list[int]:
        out: list[int] = []
        async for update in generator.generate(GenerationRequest(prompt, max_tokens, settings=settings), 5, stats):
            out += update.token_ids
        return out

    return asyncio.run(run()), stats


@pytest.fixture(scope="module")
def backend(tiny_pair, make_inprocess_backend):
    return make_inprocess_backend(tiny_pair, max_length=MAX_LENGTH)


@pytest.mark.parametrize(("k", "candidates"), [(1, 1), (3, 1), (2, 3)])
@pytest.mark.parametrize("prompt", [REPEATING, [5, 17, 42, 8, 66, 3]])
def test_lookup_in_front_of_the_draft_model_equals_plain_greedy(backend, k, candidates, prompt):
    plain, _ = generate(backend, "model", 0, prompt)
    got, stats = generate(backend, "model+ngram", k, prompt, candidates)
    assert got == plain
    assert stats.drafter == "model+ngram" and stats.draft_failures == 0
    # Every verification had a proposal from one of the two; lookup's are counted apart.
    assert stats.draft_calls + (stats.lookup_draft_tokens > 0) <= stats.verification_passes
    assert stats.lookup_accepted_tokens <= stats.lookup_draft_tokens <= stats.draft_tokens
    assert backend.target.slots_in_use == 0 and backend.draft.slots_in_use == 0


def test_lookup_proposes_where_the_context_repeats_and_the_model_elsewhere(backend):
    _, stats = generate(backend, "model+ngram", 2, REPEATING)
    assert stats.lookup_draft_tokens > 0, "the repeated suffix was never looked up"
    assert stats.draft_calls > 0, "the draft model never proposed"



@pytest.mark.parametrize("max_tokens", [2, 3, 5, 9])
def test_lookup_proposals_stop_at_max_tokens(backend, max_tokens, monkeypatch):
    proposals: list[tuple[int, list[int]]] = []
    propose = NgramIndex.propose

    def recording(self, tokens, k, after=()):
        out = propose(self, tokens, k, after)
        proposals.append((len(tokens) - len(REPEATING), out))
        return out

    monkeypatch.setattr(NgramIndex, "propose", recording)
    plain, _ = generate(backend, "model", 0, REPEATING, max_tokens=max_tokens)
    got, stats = generate(backend, "model+ngram", 2, REPEATING, max_tokens=max_tokens, lookup_length=12)
    assert got == plain and stats.output_tokens == len(got) <= max_tokens
    # no proposal reaches past max_tokens: the tokens so far, the proposal and the target's bonus token fit
    assert all(generated + len(out) + 1 <= max_tokens for generated, out in proposals)


def _recorded_lookups(monkeypatch) -> list[tuple[int, int]]:
    """(k asked, tokens proposed) of every lookup from now on."""
    asked: list[tuple[int, int]] = []
    propose = NgramIndex.propose

    def recording(self, tokens, k, after=()):
        out = propose(self, tokens, k, after)
        asked.append((k, len(out)))
        return out

    monkeypatch.setattr(NgramIndex, "propose", recording)
    return asked


@pytest.mark.parametrize("prompt", [REPEATING, [5, 17, 42, 8, 66, 3], [3, 4] * 12])
def test_an_adaptive_lookup_length_stays_lossless_and_within_its_bound(backend, prompt, monkeypatch):
    asked = _recorded_lookups(monkeypatch)
    plain, _ = generate(backend, "model", 0, prompt, max_tokens=40)
    got, stats = generate(backend, "model+ngram", 2, prompt, max_tokens=40, lookup_length=12, adaptive=True)
    assert got == plain and stats.draft_failures == 0
    assert asked and all(1 <= k <= 12 for k, _ in asked)
    assert backend.target.slots_in_use == 0 and backend.draft.slots_in_use == 0


def test_lookups_that_fail_get_shorter_and_copied_spans_get_longer():
    from specdec.adaptive import AcceptanceEstimate, CostModel, choose_lookup_length

    costs = CostModel()
    for rows, seconds in ((1, 0.050), (4, 0.052), (8, 0.055), (13, 0.059)):  # ~1.5% of a step per row
        costs.target.observe(rows, seconds)
    wrong, copying = AcceptanceEstimate(), AcceptanceEstimate()
    for _ in range(6):
        wrong.observe(0, 12)
        copying.observe(12, 12)
    short = choose_lookup_length(wrong.rate, 12, costs)
    long = choose_lookup_length(copying.rate, 12, costs)
    assert 1 <= short <= 3 and long == 12
    assert choose_lookup_length(copying.rate, 5, costs) == 5  # never past the bound (max_tokens, context)
    assert choose_lookup_length(0.9, 0, costs) == 0
    # Rows that cost nothing: the longest lookup whatever the rate.
    free = CostModel()
    for rows in (1, 13):
        free.target.observe(rows, 0.05)
    assert choose_lookup_length(0.3, 12, free) == 12


def test_a_seeded_sampled_request_gives_the_same_text_whatever_the_measured_costs(backend):
    """Rejection sampling's draws follow the proposals, so a seeded request chooses its adaptive lookup length
    from the cost model's priors and its own acceptance, not from the instance's measured call times (which
    differ with load): the same seed gives the same text on an instance whose verification rows look free and on
    one where they look dear. A greedy request may follow the measured costs: its text never depends on them."""
    from specdec.adaptive import CostModel
    from specdec.sampling import SamplingParams

    def instance_costs(seconds_per_row: float) -> CostModel:
        costs = CostModel()
        for rows in (1, 4, 8, 13):
            costs.target.observe(rows, 0.05 + seconds_per_row * rows)
        return costs

    settings = SpeculationSettings("text", "model+ngram", 2, 2, 1, "rejection", 0.7, explicit_length=True,
                                   prompt_lookup=PromptLookup(length=12, min_ngram=1, adaptive=True))
    texts, lookups = [], []
    for seconds_per_row in (0.0, 0.05):
        generator = SpeculativeGenerator(backend, MAX_LENGTH, costs=instance_costs(seconds_per_row))
        stats = GenerationStats()
        request = GenerationRequest(REPEATING, 40, settings=settings, sampling=SamplingParams(0.8, seed=7))

        async def run(generator=generator, request=request, stats=stats) -> list[int]:
            out: list[int] = []
            async for update in generator.generate(request, 5, stats):
                out += update.token_ids
            return out

        texts.append(asyncio.run(run()))
        lookups.append(stats.lookup_draft_tokens)
    assert texts[0] == texts[1] and lookups[0] == lookups[1] > 0


def test_lookup_alone_keeps_its_k_and_needs_no_draft_model(backend):
    from specdec.inprocess import InProcessBackend

    no_draft = InProcessBackend(backend.target, None)
    plain, _ = generate(no_draft, "model", 0, REPEATING)
    got, stats = generate(no_draft, "ngram", 3, REPEATING)
    assert got == plain and stats.draft_calls == 0
    assert stats.draft_tokens <= 3 * stats.verification_passes


def test_profiles_name_the_combined_drafters_and_their_lookup_options():
    config = SpeculationConfig.from_dict({
        "drafter": {"json": "eagle+ngram", "code": "model+ngram", "text": "ngram"},
        "prompt_lookup": {"length": 9, "min_ngram": 3, "max_ngram": 4, "adaptive": True},
    })
    assert [config.profiles[t].drafter for t in ("json", "code", "text")] == ["eagle+ngram", "model+ngram", "ngram"]
    assert config.prompt_lookup == PromptLookup(9, 3, 4, adaptive=True)
    settings = resolve(config, "json", None, num_draft_tokens=None, num_candidates=None, acceptance=None,
                       verify_threshold=None, drafter=None, sampling=False)
    assert settings.drafter == "eagle+ngram" and settings.prompt_lookup.length == 9
    with pytest.raises(ValueError, match="prompt_lookup"):
        SpeculationConfig.from_dict({"prompt_lookup": {"length": 0}})
    with pytest.raises(ValueError, match="adaptive"):
        SpeculationConfig.from_dict({"prompt_lookup": {"adaptive": "yes"}})
    assert SpeculationConfig.from_dict({}).prompt_lookup.adaptive  # the shipped default (test_config.py)
    assert not SpeculationConfig.from_dict({"prompt_lookup": {"adaptive": False}}).prompt_lookup.adaptive


def test_without_the_head_eagle_with_lookup_becomes_the_draft_model_with_lookup():
    config = SpeculationConfig.from_dict({"drafter": {"json": "eagle+ngram", "code": "eagle", "text": "ngram"}})
    served = config.serving(drafters_served(eagle_head=False))
    assert [served.profiles[t].drafter for t in ("json", "code", "text")] == ["model+ngram", "model", "ngram"]
    for name in ("eagle+ngram", "medusa"):
        with pytest.raises(InvalidRequestError, match="drafter"):
            resolve(served, "json", None, num_draft_tokens=None, num_candidates=None, acceptance=None,
                    verify_threshold=None, drafter=name, sampling=False)
    assert set(drafters_served(eagle_head=True)) == {"model", "eagle", "ngram", "model+ngram", "eagle+ngram"}


def test_without_the_draft_model_model_drafters_become_the_head_and_model_requests_are_refused():
    config = SpeculationConfig.from_dict({"drafter": {"json": "model+ngram", "code": "model", "text": "eagle+ngram"}})
    served = config.serving(drafters_served(eagle_head=True, draft_model=False))
    assert set(served.served_drafters) == {"eagle", "ngram", "eagle+ngram"}
    assert [served.profiles[t].drafter for t in ("json", "code", "text")] == ["eagle+ngram", "eagle", "eagle+ngram"]
    for name in ("model", "model+ngram"):
        with pytest.raises(InvalidRequestError, match="not served here"):
            resolve(served, "json", None, num_draft_tokens=None, num_candidates=None, acceptance=None,
                    verify_threshold=None, drafter=name, sampling=False)
    # Neither drafter model loaded: every profile drafts by prompt lookup alone.
    lookup_only = config.serving(drafters_served(eagle_head=False, draft_model=False))
    assert lookup_only.served_drafters == ("ngram",)
    assert {profile.drafter for profile in lookup_only.profiles.values()} == {"ngram"}
