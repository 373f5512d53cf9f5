"""The whole loop in process: trees, n-gram drafting, sampling modes, seeds, fallback and adaptive length."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
from specdec.config import FallbackConfig, SpeculationSettings
from specdec.engines import DraftEngine, StepRequest
from specdec.fallback import FallbackMonitor
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.inprocess import InProcessBackend
from specdec.runtime.base import ForwardItem
from specdec.runtime.torch_llama import TorchLlamaRuntime
from specdec.sampling import SamplingParams, probabilities
from specdec.tokenizer import TextTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/first_token_law.py
from first_token_law import first_token_law_pvalue  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [[5, 17, 42], [8, 66, 3, 91, 12, 7, 30], [10, 20, 30, 40, 50, 60, 70, 80]]


@pytest.fixture(scope="module")
def backend(tiny_pair, make_inprocess_backend):
    return make_inprocess_backend(tiny_pair, max_length=160)


def settings(k: int, candidates: int = 1, acceptance: str = "greedy", drafter: str = "model",
             k_max: int | None = None, task: str = "text") -> SpeculationSettings:
    return SpeculationSettings(task, drafter, k, k_max or k, candidates, acceptance, 0.7)


def run(generator, request, sequence_id=1, stats=None) -> list[int]:
    async def collect():
        out = []
        async for update in generator.generate(request, sequence_id, stats):
            out.extend(update.token_ids)
        return out

    return asyncio.run(collect())


def assert_greedy_speculation_equals_plain(backend, k: int, candidates: int) -> None:
    """Greedy chains/trees of k tokens and `candidates` branches give plain greedy decoding's output."""
    generator = SpeculativeGenerator(backend, 160)
    for prompt in PROMPTS:
        plain = run(generator, GenerationRequest(prompt, 30))
        stats = GenerationStats()
        tree = run(generator, GenerationRequest(prompt, 30, settings=settings(k, candidates)), stats=stats)
        assert tree == plain
        assert stats.verification_passes > 0 and stats.draft_tokens <= k * stats.verification_passes
    assert backend.target.slots_in_use == 0 and backend.draft.slots_in_use == 0


@pytest.mark.parametrize(("k", "candidates"), [(1, 2), (3, 3), (6, 5), (4, 1)])
def test_greedy_trees_equal_plain_greedy(backend, k, candidates):
    assert_greedy_speculation_equals_plain(backend, k, candidates)


def test_tree_drafts_are_top_candidates_then_greedy_chains(backend, tiny_pair):
    draft = DraftEngine(TorchLlamaRuntime(tiny_pair[1], num_slots=1, max_length=64), idle_timeout_s=60)
    prompt = np.array([5, 17, 42, 8])
    tokens = draft.step([StepRequest(1, 0, prompt, start=True, num_draft_tokens=3, num_candidates=3)])[0].token_ids
    reference = TorchLlamaRuntime(tiny_pair[1], num_slots=1, max_length=64)
    logits = reference.forward([ForwardItem(0, 0, prompt)])[0][-1]
    top = list(np.argsort(-logits, kind="stable")[:3])
    assert list(tokens[:3]) == top
    for branch in range(3):  # each branch continues greedily from its first token
        ids = list(prompt) + [top[branch]]
        chain = [top[branch]]
        for _ in range(2):
            nxt = int(reference.forward([ForwardItem(0, 0, np.array(ids))])[0][-1].argmax())
            chain.append(nxt)
            ids.append(nxt)
        assert [int(tokens[branch + 3 * d]) for d in range(3)] == chain


def test_ngram_drafter_is_lossless_and_needs_no_draft_model(backend):
    no_draft = InProcessBackend(backend.target, None)
    generator = SpeculativeGenerator(no_draft, 160)
    prompt = [4, 9, 4, 9, 4, 9, 4, 9, 33]
    plain = run(generator, GenerationRequest(prompt, 40))
    stats = GenerationStats()
    out = run(generator, GenerationRequest(prompt, 40, settings=settings(4, drafter="ngram")), stats=stats)
    assert out == plain and stats.draft_failures == 0


@pytest.mark.parametrize("candidates", [1, 3])
def test_sampling_is_reproducible_with_a_seed(backend, candidates):
    generator = SpeculativeGenerator(backend, 160)
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=1234)

    def sampled(seed_params):
        return run(generator, GenerationRequest(PROMPTS[1], 30, sampling=seed_params,
                                                settings=settings(4, candidates, "rejection")))

    first, second = sampled(sampling), sampled(sampling)
    assert first == second
    other = sampled(SamplingParams(temperature=1.0, top_k=20, seed=99))
    assert other != first


def test_typical_acceptance_accepts_at_least_what_greedy_accepts(backend):
    generator = SpeculativeGenerator(backend, 160)
    greedy_stats, typical_stats = GenerationStats(), GenerationStats()
    run(generator, GenerationRequest(PROMPTS[0], 40, settings=settings(4)), stats=greedy_stats)
    out = run(generator, GenerationRequest(PROMPTS[0], 40, settings=settings(4, acceptance="typical")),
              stats=typical_stats)
    assert len(out) == 40
    assert typical_stats.acceptance_rate >= greedy_stats.acceptance_rate


def test_rejection_sampling_on_the_real_pair_keeps_the_targets_first_token_law():
    """The first token a verification produces is distributed as the target's, with the served pair's p and q."""
    target = TorchLlamaRuntime(REPO_ROOT / "tests/fixtures/pair_12m/target", num_slots=1, max_length=64)
    draft = TorchLlamaRuntime(REPO_ROOT / "tests/fixtures/pair_12m/draft", num_slots=1, max_length=64)
    prompt = np.array(TextTokenizer(REPO_ROOT / "tests/fixtures/pair_12m/target").encode("The quick brown fox"))
    params = SamplingParams(temperature=1.0)
    p = probabilities(target.forward([ForwardItem(0, 0, prompt)])[0][-1], params)[0]
    q = probabilities(draft.forward([ForwardItem(0, 0, prompt)])[0][-1], params)[0]
    assert first_token_law_pvalue(p, q, draws=100_000) > 1e-3


def test_fallback_stops_speculation_and_probes(backend):
    clock_now = [0.0]
    monitor = FallbackMonitor("text", FallbackConfig(0.99, window_s=0.0, min_draft_tokens=4, probe_interval_s=1e9),
                              clock=lambda: clock_now[0])
    generator = SpeculativeGenerator(backend, 160, monitors={"text": monitor})
    plain = run(generator, GenerationRequest(PROMPTS[2], 60))
    stats = GenerationStats()
    out = run(generator, GenerationRequest(PROMPTS[2], 60, settings=settings(6)), stats=stats)
    assert out == plain  # lossless whatever the state
    assert monitor.active and stats.fallback_active
    # Once fallen back only the first probe burst (8 iterations) speculated.
    assert stats.verification_passes <= 8 + 4


def test_adaptive_length_stays_in_range(backend):
    generator = SpeculativeGenerator(backend, 160)
    lengths = []

    class Spy(GenerationStats):
        def record_verification(self, depth, accepted):
            lengths.append(depth)
            super().record_verification(depth, accepted)

    run(generator, GenerationRequest(PROMPTS[0], 60, settings=settings(2, k_max=7)), stats=Spy())
    # Only the last iterations may go under the range: k never exceeds the tokens still wanted.
    assert lengths and all(k <= 7 for k in lengths) and all(k >= 2 for k in lengths[:-2])


def test_an_explicit_length_overrides_the_profiles_fallback(backend):
    now = [0.0]
    monitor = FallbackMonitor("text", FallbackConfig(0.99, window_s=10.0, min_draft_tokens=1, probe_interval_s=1e9),
                              clock=lambda: now[0])
    now[0] = 20.0
    monitor.record(8, 0)
    assert monitor.active
    generator = SpeculativeGenerator(backend, 160, monitors={"text": monitor})
    stats = GenerationStats()
    explicit = SpeculationSettings("text", "model", 4, 4, 1, "greedy", 0.7, explicit_length=True)
    run(generator, GenerationRequest(PROMPTS[0], 24, settings=explicit), stats=stats)
    assert stats.verification_passes > 8 and not stats.fallback_active


def test_an_expired_draft_slot_is_started_again(backend):
    generator = SpeculativeGenerator(backend, 160)
    plain = run(generator, GenerationRequest(PROMPTS[1], 30))

    class ExpiringDraft(InProcessBackend):
        calls = 0

        async def drafter_step(self, drafter, request: StepRequest):
            self.calls += 1
            if self.calls == 3 and not request.end:  # the slot vanished between two proposals
                backend.draft.slots.release(request.sequence_id)
            return await super().drafter_step(drafter, request)

    expiring = ExpiringDraft(backend.target, backend.draft)
    stats = GenerationStats()
    out = run(SpeculativeGenerator(expiring, 160), GenerationRequest(PROMPTS[1], 30, settings=settings(3)), 42, stats)
    assert out == plain and stats.draft_failures == 0 and stats.verification_passes > 3
    assert backend.draft.slots_in_use == 0


def test_plain_calls_of_several_steps_give_one_step_calls_output(backend):
    """Where speculation is off, plain_steps tokens per target call: greedy output equal to one token a call (an
    end token and max_tokens cutting a call short), a seeded draw reproducible, fewer target calls, slots freed."""
    generator = SpeculativeGenerator(backend, 160)
    plain = SpeculationSettings("text", "model", 0, 0, 1, "greedy", 0.7)
    several = SpeculationSettings("text", "model", 0, 0, 1, "greedy", 0.7, plain_steps=4)
    for prompt in PROMPTS:
        one_stats, four_stats = GenerationStats(), GenerationStats()
        one = run(generator, GenerationRequest(prompt, 30, settings=plain), stats=one_stats)
        four = run(generator, GenerationRequest(prompt, 30, settings=several), stats=four_stats)
        assert four == one and len(one) == 30
        assert four_stats.target_calls <= 1 + (29 + 3) // 4 < one_stats.target_calls
        end = one[13]  # the first time it occurs ends the output there
        cut = run(generator, GenerationRequest(prompt, 30, end_ids=frozenset({end}), settings=several))
        assert cut == one[:one.index(end)]
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=5)
    drawn = [run(generator, GenerationRequest(PROMPTS[1], 30, sampling=sampling, settings=several)) for _ in range(2)]
    assert drawn[0] == drawn[1] and len(drawn[0]) == 30
    assert backend.target.slots_in_use == 0
