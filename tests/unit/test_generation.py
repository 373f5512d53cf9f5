"""The speculative loop is lossless for greedy decoding, frees its slots, and reports its statistics."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from specdec.engines import DraftEngine, StepRequest
from specdec.errors import InvalidRequestError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.inprocess import InProcessBackend
from specdec.runtime.base import ForwardItem
from specdec.runtime.torch_llama import TorchLlamaRuntime
from transformers import LlamaForCausalLM

PROMPTS = [[5, 17, 42], [8, 66, 3, 91, 12, 7, 30], [44], [10, 20, 30, 40, 50, 60, 70, 80]]


@pytest.fixture(scope="module")
def backend(tiny_pair, make_inprocess_backend):
    return make_inprocess_backend(tiny_pair, max_length=128)


async def collect(generator: SpeculativeGenerator, request: GenerationRequest, sequence_id: int,
                  stats: GenerationStats | None = None) -> list[int]:
    out: list[int] = []
    async for update in generator.generate(request, sequence_id, stats):
        out.extend(update.token_ids)
    return out


def hf_greedy(model_dir, prompt: list[int], max_tokens: int) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_speculation_equals_plain_and_hf(backend, tiny_pair, k):
    generator = SpeculativeGenerator(backend, max_context_length=128)
    for n, prompt in enumerate(PROMPTS):
        plain = asyncio.run(collect(generator, GenerationRequest(prompt, 40), 100 + n))
        stats = GenerationStats()
        spec = asyncio.run(collect(generator, GenerationRequest(prompt, 40, num_draft_tokens=k), 200 + n, stats))
        assert spec == plain
        assert len(spec) == 40
        assert stats.draft_tokens > 0 and 0 <= stats.accepted_draft_tokens <= stats.draft_tokens
        assert stats.output_tokens == 40
    assert plain == hf_greedy(tiny_pair[0], prompt, 40)
    assert backend.target.slots_in_use == 0 and backend.draft.slots_in_use == 0


def test_concurrent_sequences_match_sequential(backend):
    generator = SpeculativeGenerator(backend, max_context_length=128)
    requests = [GenerationRequest(p, 24, num_draft_tokens=4) for p in PROMPTS]
    alone = [asyncio.run(collect(generator, r, 300 + i)) for i, r in enumerate(requests)]

    async def together():
        return await asyncio.gather(*[collect(generator, r, 400 + i) for i, r in enumerate(requests)])

    assert asyncio.run(together()) == alone


def test_end_token_stops_and_is_not_output(backend):
    generator = SpeculativeGenerator(backend, max_context_length=128)
    reference = asyncio.run(collect(generator, GenerationRequest(PROMPTS[1], 30), 500))
    end = reference[10]
    first = reference.index(end)
    out = asyncio.run(collect(generator, GenerationRequest(PROMPTS[1], 30, frozenset({end}), 5), 501))
    assert out == reference[:first]


def test_prompt_plus_max_tokens_beyond_context_is_rejected(backend):
    generator = SpeculativeGenerator(backend, max_context_length=128)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        asyncio.run(collect(generator, GenerationRequest([1] * 100, 29), 600))
    with pytest.raises(InvalidRequestError, match="text_input"):
        asyncio.run(collect(generator, GenerationRequest([], 5), 601))


def test_failing_draft_falls_back_to_plain_decoding(backend):
    class BrokenDraft(InProcessBackend):
        async def drafter_step(self, drafter, request: StepRequest):
            raise RuntimeError("draft unavailable")

    broken = BrokenDraft(backend.target, backend.draft)
    plain = asyncio.run(collect(SpeculativeGenerator(backend, 128), GenerationRequest(PROMPTS[0], 20), 700))
    stats = GenerationStats()
    out = asyncio.run(collect(SpeculativeGenerator(broken, 128), GenerationRequest(PROMPTS[0], 20, num_draft_tokens=4),
                              701, stats))
    assert out == plain and stats.draft_failures == 1
    assert backend.target.slots_in_use == 0


def test_draft_engine_proposes_its_own_greedy_chain(tiny_pair):
    _, draft_dir = tiny_pair
    engine = DraftEngine(TorchLlamaRuntime(draft_dir, num_slots=2, max_length=64), idle_timeout_s=60)
    prompt = np.array([5, 17, 42, 8])
    proposal = engine.step([StepRequest(1, 0, prompt, start=True, num_draft_tokens=6)])[0].token_ids
    runtime = TorchLlamaRuntime(draft_dir, num_slots=1, max_length=64)
    ids = list(prompt)
    for _ in range(6):
        logits = runtime.forward([ForwardItem(0, 0, np.array(ids))])[0]
        ids.append(int(logits[-1].argmax()))
    assert proposal.tolist() == ids[4:]


def test_verification_statistics_count_each_acceptance_length():
    """GenerationStats: per position and per accepted count (vLLM's acceptance_histogram)."""
    stats = GenerationStats()
    for depth, accepted in ((4, 0), (4, 2), (3, 3), (4, 2)):
        stats.record_verification(depth, accepted)
    assert stats.acceptance_histogram == [1, 0, 2, 1]
    assert stats.accepted_per_position == [3, 3, 1, 0]
    assert (stats.verification_passes, stats.draft_tokens, stats.accepted_draft_tokens) == (4, 15, 7)
