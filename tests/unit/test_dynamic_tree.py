"""The EAGLE head's dynamic draft tree (EAGLE-2, engines._DynamicTree): its shape, that it is the best nodes by
the head's own path probability, that the same forwards written as a chain give the chain's first path, and
that greedy speculation with it equals plain decoding (with and without prompt lookup, across prefill chunks)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from specdec.config import DynamicTree, SpeculationConfig, SpeculationSettings, resolve
from specdec.drafting.base import proposal_of_tree
from specdec.drafting.ngram import PromptLookup
from specdec.engines import DraftEngine, StepRequest
from specdec.errors import InvalidRequestError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.inprocess import InProcessBackend
from specdec.runtime.torch_llama import TorchLlamaRuntime
from specdec.sampling import SamplingParams
from test_eagle import MAX_LENGTH, PROMPT, backend

FEATURES_SEED = 11


def head_engine(tiny_eagle) -> DraftEngine:
    return DraftEngine(TorchLlamaRuntime(tiny_eagle, num_slots=4, max_length=MAX_LENGTH), 60)


def features(engine: DraftEngine, rows: int) -> np.ndarray:
    return np.random.default_rng(FEATURES_SEED).normal(size=(rows, engine.runtime.feature_size)).astype(np.float32)


def draft_tree(tiny_eagle, nodes: int, width: int, depth: int, floor: float = 0.0):
    engine = head_engine(tiny_eagle)
    result = engine.step([StepRequest(1, input_ids=np.asarray(PROMPT), start=True, num_draft_tokens=depth,
                                      num_candidates=width, tree_nodes=nodes, min_confidence=floor,
                                      features=features(engine, len(PROMPT)))])[0]
    assert result.error is None
    return result


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize(("nodes", "width", "depth"), [(6, 2, 4), (10, 3, 5), (3, 4, 2), (8, 1, 8)])
def test_the_tree_has_its_budget_parents_first_and_distinct_siblings(tiny_eagle, nodes, width, depth):
    result = draft_tree(tiny_eagle, nodes, width, depth)
    parents = result.parents.tolist()
    assert len(result.token_ids) == len(parents) <= nodes
    assert all(-1 <= parent < i for i, parent in enumerate(parents))  # parents first
    for parent in set(parents):
        siblings = [int(result.token_ids[i]) for i, p in enumerate(parents) if p == parent]
        assert len(siblings) == len(set(siblings)) <= width
    assert proposal_of_tree(result.token_ids, result.parents).depth <= depth


def test_the_first_level_is_the_heads_top_tokens(tiny_eagle):
    """The root's children are the head's most probable first tokens (what a chain's first logits rank)."""
    engine = head_engine(tiny_eagle)
    chain = engine.step([StepRequest(1, input_ids=np.asarray(PROMPT), start=True, num_draft_tokens=1,
                                     features=features(engine, len(PROMPT)), want_logits=True)])[0]
    ranked = [int(t) for t in np.argsort(-log_softmax(chain.logits[0]), kind="stable")]
    tree = draft_tree(tiny_eagle, 12, 3, 3)
    roots = [int(t) for t, p in zip(tree.token_ids, tree.parents, strict=True) if p < 0]
    assert roots == ranked[:len(roots)] and len(roots) >= 1


def test_a_width_one_tree_is_the_chain(tiny_eagle):
    engine = head_engine(tiny_eagle)
    chain = engine.step([StepRequest(1, input_ids=np.asarray(PROMPT), start=True, num_draft_tokens=5,
                                     features=features(engine, len(PROMPT)))])[0]
    tree = draft_tree(tiny_eagle, 5, 1, 5)
    assert tree.token_ids.tolist() == chain.token_ids.tolist() and tree.parents.tolist() == [-1, 0, 1, 2, 3]


def paths(result) -> set[tuple[int, ...]]:
    """Each node as the tokens of its path from the root."""
    found: list[tuple[int, ...]] = []
    for token, parent in zip(result.token_ids.tolist(), result.parents.tolist(), strict=True):
        found.append((found[parent] if parent >= 0 else ()) + (token,))
    return set(found)


def test_a_confidence_floor_keeps_the_likely_part_of_the_tree(tiny_eagle):
    """min_confidence floors a node's path probability: the floored tree is the unfloored one less its
    unlikely nodes, and a floor nothing reaches leaves the head's first choice alone."""
    full = draft_tree(tiny_eagle, 10, 3, 5)
    floored = draft_tree(tiny_eagle, 10, 3, 5, floor=0.05)
    assert paths(floored) <= paths(full)
    alone = draft_tree(tiny_eagle, 10, 3, 5, floor=0.999)
    assert len(alone.token_ids) == 1 and alone.token_ids[0] == full.token_ids[0] and alone.parents.tolist() == [-1]


def test_a_dynamic_tree_refuses_sampled_drafting(tiny_eagle):
    engine = head_engine(tiny_eagle)
    sampled = engine.step([StepRequest(1, input_ids=np.asarray(PROMPT), start=True, num_draft_tokens=3,
                                       num_candidates=2, tree_nodes=4, sampling=SamplingParams(0.8),
                                       features=features(engine, len(PROMPT)))])[0]
    assert isinstance(sampled.error, InvalidRequestError) and "tree_nodes" in str(sampled.error)


def generate(backend_, settings: SpeculationSettings, prefill_chunk: int = 256,
             others: int = 0) -> tuple[list[int], GenerationStats]:
    """The tokens and statistics of one greedy generation, with `others` sequences already generating."""
    generator = SpeculativeGenerator(backend_, MAX_LENGTH, prefill_chunk=prefill_chunk)
    generator.sequences = others
    stats = GenerationStats()

    async def run() -> list[int]:
        tokens: list[int] = []
        async for update in generator.generate(GenerationRequest(PROMPT, 40, settings=settings), 7, stats):
            tokens += update.token_ids
        return tokens

    return asyncio.run(run()), stats


@pytest.mark.parametrize(("drafter", "nodes", "width", "depth", "prefill_chunk", "floor"),
                         [("eagle", 6, 2, 4, 256, 0.0), ("eagle", 10, 3, 5, 5, 0.0), ("eagle+ngram", 6, 2, 3, 256, 0.0),
                          ("eagle", 8, 2, 5, 256, 0.1)])
def test_greedy_with_a_dynamic_tree_equals_plain_decoding(tiny_pair, tiny_eagle, drafter, nodes, width, depth,
                                                          prefill_chunk, floor):
    plain, _ = generate(backend(tiny_pair, tiny_eagle), SpeculationSettings("text", "model", 0, 0, 1, "greedy", 0.7))
    settings = SpeculationSettings("text", drafter, depth, depth, 1, "greedy", 0.7, explicit_length=True,
                                   prompt_lookup=PromptLookup(adaptive=False),
                                   tree=DynamicTree(nodes, depth, width, floor))
    got, stats = generate(backend(tiny_pair, tiny_eagle), settings, prefill_chunk)
    assert got == plain and stats.draft_failures == 0 and stats.draft_calls > 0


def resolved(config: SpeculationConfig, task: str, **overrides) -> SpeculationSettings:
    options = {"num_draft_tokens": None, "num_candidates": None, "acceptance": None, "verify_threshold": None,
               "drafter": None, "sampling": False, **overrides}
    return resolve(config, task, None, **options)


def test_the_tree_comes_from_the_profile_and_requests_set_its_depth_and_width():
    config = SpeculationConfig.from_dict({"dynamic_tree": {"nodes": {"json": 8}, "depth": 4, "min_probability": 0.1},
                                          "candidate_num": {"default": 3}})
    assert config.profiles["json"].tree == DynamicTree(8, 4, 2, 0.1)
    assert config.profiles["code"].tree is None and config.profiles["text"].tree is None
    assert resolved(config, "json").tree == DynamicTree(8, 4, 2, 0.1)
    assert resolved(config, "json", num_draft_tokens=3, num_candidates=4).tree == DynamicTree(8, 3, 4, 0.1)
    assert resolved(config, "json").num_candidates == 3  # the chains' settings are untouched
    assert SpeculationConfig.from_dict({"dynamic_tree": {"nodes": 6}}).profiles["text"].tree == DynamicTree(6)
    assert SpeculationConfig.from_dict({}).profiles["json"].tree is None
    for bad in ({"nodes": -1}, {"nodes": 4, "depth": 0}, {"nodes": 4, "min_probability": 1.0}):
        with pytest.raises(ValueError, match="dynamic_tree"):
            SpeculationConfig.from_dict({"dynamic_tree": bad})


def test_sampled_requests_and_the_draft_model_keep_chains(tiny_pair, tiny_eagle, monkeypatch):
    """The tree needs greedy drafting with the head: a sampled request under rejection sampling, and the draft
    model, draft the profile's chains (no tree_nodes on their calls)."""
    from specdec.sampling import SamplingParams as Sampling

    calls: list[StepRequest] = []
    original = InProcessBackend.drafter_step

    async def recording(self, drafter, request):
        calls.append(request)
        return await original(self, drafter, request)

    monkeypatch.setattr(InProcessBackend, "drafter_step", recording)
    tree = DynamicTree(6, 3, 2, 0.0)
    for drafter, acceptance, sampling in (("eagle", "rejection", Sampling(0.8, seed=3)), ("model", "greedy",
                                                                                        Sampling())):
        settings = SpeculationSettings("text", drafter, 2, 2, 1, acceptance, 0.7, explicit_length=True, tree=tree)
        generator = SpeculativeGenerator(backend(tiny_pair, tiny_eagle), MAX_LENGTH)

        async def run(generator=generator, settings=settings, sampling=sampling) -> None:
            request = GenerationRequest(PROMPT, 12, settings=settings, sampling=sampling)
            async for _ in generator.generate(request, 7, GenerationStats()):
                pass

        asyncio.run(run())
    drafting = [call for call in calls if call.num_draft_tokens]
    assert drafting and all(call.tree_nodes == 0 and call.num_candidates == 1 for call in drafting)


def _recording(monkeypatch) -> list[StepRequest]:
    calls: list[StepRequest] = []
    original = InProcessBackend.drafter_step

    async def recording(self, drafter, request):
        if drafter == "eagle":
            calls.append(request)
        return await original(self, drafter, request)

    monkeypatch.setattr(InProcessBackend, "drafter_step", recording)
    return calls


@pytest.mark.parametrize(("others", "max_sequences", "trees"), [(0, 0, True), (0, 1, True), (2, 3, True),
                                                                (3, 3, False), (15, 8, False)])
def test_a_tree_is_drafted_while_no_more_sequences_generate_than_its_max(tiny_pair, tiny_eagle, monkeypatch, others,
                                                                         max_sequences, trees):
    """With `others` sequences already generating on the instance, a greedy request drafts the tree when it makes
    at most `max_sequences` (0: no limit), the profile's chains otherwise; its output is plain decoding's either
    way, and the count is back to what it was when it ends."""
    plain, _ = generate(backend(tiny_pair, tiny_eagle), SpeculationSettings("text", "model", 0, 0, 1, "greedy", 0.7))
    calls = _recording(monkeypatch)
    settings = SpeculationSettings("text", "eagle", 3, 3, 1, "greedy", 0.7, explicit_length=True,
                                   tree=DynamicTree(6, 3, 2, 0.0, max_sequences))
    generator = SpeculativeGenerator(backend(tiny_pair, tiny_eagle), MAX_LENGTH)
    generator.sequences = others

    async def run() -> list[int]:
        tokens: list[int] = []
        async for update in generator.generate(GenerationRequest(PROMPT, 40, settings=settings), 7):
            tokens += update.token_ids
        return tokens

    assert asyncio.run(run()) == plain
    assert generator.sequences == others
    drafting = [call for call in calls if call.num_draft_tokens]
    assert drafting and all((call.tree_nodes > 0) == trees for call in drafting)
    assert max(call.num_draft_tokens for call in drafting) == 3  # the tree's depth, or the chain's k


def test_a_seeded_sampled_request_drafts_its_tree_on_any_load(tiny_pair, tiny_eagle, monkeypatch):
    """A sampled request with a seed gives the same text on any load: under typical acceptance it drafts the
    tree however many sequences are generating (an unseeded one follows the load)."""
    calls = _recording(monkeypatch)
    settings = SpeculationSettings("text", "eagle", 3, 3, 1, "typical", 0.7, explicit_length=True,
                                   tree=DynamicTree(6, 3, 2, 0.0, max_sequences=1))
    texts = []
    for others, seed in ((0, 5), (4, 5), (4, None)):
        calls.clear()
        generator = SpeculativeGenerator(backend(tiny_pair, tiny_eagle), MAX_LENGTH)
        generator.sequences = others

        async def run(generator=generator, seed=seed) -> list[int]:
            tokens: list[int] = []
            request = GenerationRequest(PROMPT, 24, settings=settings, sampling=SamplingParams(0.9, seed=seed))
            async for update in generator.generate(request, 7):
                tokens += update.token_ids
            return tokens

        texts.append(asyncio.run(run()))
        drafting = [call for call in calls if call.num_draft_tokens]
        assert drafting and all((call.tree_nodes > 0) == (seed is not None) for call in drafting)
    assert texts[0] == texts[1]


def test_the_trees_max_sequences_comes_from_the_profile():
    config = SpeculationConfig.from_dict({"dynamic_tree": {"nodes": {"code": 8}, "max_sequences": 8,
                                                           "min_probability": 0.0}})
    assert config.profiles["code"].tree == DynamicTree(8, 5, 2, 0.0, 8)
    assert config.profiles["code"].tree.serves(8) and not config.profiles["code"].tree.serves(9)
    assert DynamicTree(8, max_sequences=0).serves(1000)  # 0: no limit
    with pytest.raises(ValueError, match="max_sequences"):
        SpeculationConfig.from_dict({"dynamic_tree": {"nodes": 4, "max_sequences": -1}})


@pytest.mark.parametrize(("others", "max_sequences", "speculates"), [(0, 0, True), (15, 0, True), (3, 4, True),
                                                                     (4, 4, False), (15, 8, False)])
def test_speculation_pauses_above_the_profiles_max_sequences(tiny_pair, tiny_eagle, monkeypatch, others,
                                                            max_sequences, speculates):
    """With more sequences generating on the instance than the profile's max_sequences, a greedy request takes
    plain steps (no draft calls, no lookup proposals) and its output is still plain decoding's."""
    plain, _ = generate(backend(tiny_pair, tiny_eagle), SpeculationSettings("text", "model", 0, 0, 1, "greedy", 0.7))
    calls = _recording(monkeypatch)
    settings = SpeculationSettings("text", "eagle+ngram", 3, 3, 1, "greedy", 0.7,
                                   prompt_lookup=PromptLookup(adaptive=False), max_sequences=max_sequences)
    got, stats = generate(backend(tiny_pair, tiny_eagle), settings, others=others)
    assert got == plain
    assert (stats.draft_tokens > 0) == speculates and (stats.load_plain_steps == 0) == speculates
    assert bool([call for call in calls if call.num_draft_tokens]) == speculates
    assert set(stats.phase_seconds) >= {"target", "accept"}
    assert all(seconds >= 0 for seconds in stats.phase_seconds.values())
    assert stats.iteration_seconds >= sum(stats.phase_seconds.values())  # "other" is never negative


def test_a_seeded_sampled_request_speculates_on_any_load(tiny_pair, tiny_eagle):
    """Its text must not depend on the load (rejection sampling draws per proposal): it ignores max_sequences,
    and gives the same text alone and beside 9 other sequences."""
    settings = SpeculationSettings("text", "eagle", 3, 3, 1, "rejection", 0.7, max_sequences=2)
    texts = []
    for others in (0, 9):
        generator = SpeculativeGenerator(backend(tiny_pair, tiny_eagle), MAX_LENGTH)
        generator.sequences = others
        stats = GenerationStats()

        async def run(generator=generator, stats=stats) -> list[int]:
            tokens: list[int] = []
            request = GenerationRequest(PROMPT, 24, settings=settings, sampling=SamplingParams(0.9, seed=4))
            async for update in generator.generate(request, 7, stats):
                tokens += update.token_ids
            return tokens

        texts.append(asyncio.run(run()))
        assert stats.draft_tokens > 0 and stats.load_plain_steps == 0
    assert texts[0] == texts[1]


def test_max_sequences_comes_from_the_profile_and_an_explicit_length_lifts_it():
    config = SpeculationConfig.from_dict({"max_sequences": 6})
    assert config.max_sequences == 6 and resolved(config, "code").max_sequences == 6
    assert resolved(config, "code").speculates_under(6) and not resolved(config, "code").speculates_under(7)
    assert resolved(config, "code", num_draft_tokens=3).max_sequences == 0  # the request asked for its k
    assert SpeculationConfig.from_dict({}).max_sequences == 2  # the shipped default (test_config.py)
    assert SpeculationConfig.from_dict({"max_sequences": 0}).max_sequences == 0  # any load
    with pytest.raises(ValueError, match="max_sequences"):
        SpeculationConfig.from_dict({"max_sequences": -1})


def test_sampled_requests_decode_plain_unless_the_profile_or_the_request_asks_for_speculation():
    off, on = SpeculationConfig.from_dict({}), SpeculationConfig.from_dict({"speculate_sampled": True})
    assert not off.speculate_sampled and on.speculate_sampled
    assert not resolved(off, "code", sampling=True).enabled and resolved(off, "code").enabled
    assert resolved(on, "code", sampling=True).enabled
    for option in ({"num_draft_tokens": 2}, {"drafter": "eagle"}, {"acceptance": "rejection"}):
        assert resolved(off, "code", sampling=True, **option).enabled, option  # the request asked
    with pytest.raises(ValueError, match="speculate_sampled"):
        SpeculationConfig.from_dict({"speculate_sampled": "yes"})
