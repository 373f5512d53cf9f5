"""Long contexts: a 4,096-token prompt gives Hugging Face's greedy output (chunked prefill, paged KV), and a
long prompt's prefill is interleaved with the steps of a stream already running."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from specdec.engines import DraftEngine, StepRequest, TargetEngine
from specdec.generation import GenerationRequest, SpeculativeGenerator
from specdec.inprocess import BatchingBackend
from specdec.runtime.torch_llama import TorchLlamaRuntime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/family_checkpoints.py

from family_checkpoints import VOCAB_SIZE, make_family_checkpoint  # noqa: E402

LONG_CONTEXT = 8192
LONG_PROMPT = 4096
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-layer target and a 1-layer draft with 8,192 positions (Qwen2: biases matter too)."""
    root = tmp_path_factory.mktemp("long_pair")
    return (make_family_checkpoint(root / "target", "qwen2", 2, seed=11, max_position_embeddings=LONG_CONTEXT),
            make_family_checkpoint(root / "draft", "qwen2", 1, seed=12, max_position_embeddings=LONG_CONTEXT))


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def backend_of(pair, num_slots: int = 2, on_batch=lambda model, requests: None) -> BatchingBackend:
    target_dir, draft_dir = pair
    return BatchingBackend(TargetEngine(TorchLlamaRuntime(target_dir, num_slots=num_slots), idle_timeout_s=60),
                           DraftEngine(TorchLlamaRuntime(draft_dir, num_slots=num_slots), idle_timeout_s=60),
                           on_batch=on_batch)


async def collect(generator: SpeculativeGenerator, request: GenerationRequest, sequence_id: int) -> list[int]:
    out: list[int] = []
    async for update in generator.generate(request, sequence_id):
        out.extend(update.token_ids)
    return out


def test_a_4k_token_prompt_gives_hugging_faces_greedy_output(long_pair):
    prompt = [int(t) for t in np.random.default_rng(3).integers(4, VOCAB_SIZE, LONG_PROMPT)]
    expected = hf_greedy(long_pair[0], prompt, NEW_TOKENS)
    backend = backend_of(long_pair)
    runtime = backend._target.engine.runtime
    assert runtime.max_length == LONG_CONTEXT  # the model's own context when the deployment sets none
    generator = SpeculativeGenerator(backend, max_context_length=runtime.max_length, prefill_chunk=512)

    async def both():
        return await asyncio.gather(collect(generator, GenerationRequest(prompt, NEW_TOKENS), 1),
                                    collect(generator, GenerationRequest(prompt, NEW_TOKENS, num_draft_tokens=3), 2))

    plain, speculative = asyncio.run(both())
    assert plain == expected
    assert speculative == expected
    assert runtime.kv.blocks_in_use == 0


def interleaving(pair, prefill_chunk: int) -> tuple[list[int], list[list[StepRequest]], int]:
    """A stream runs; a 1,500-token prompt arrives. Returns the long prompt's output, every target batch
    and how many of the running stream's steps ran while the long prompt was being prefilled."""
    batches: list[list[StepRequest]] = []
    backend = backend_of(pair, on_batch=lambda model, requests: batches.append(requests) if model == "target" else None)
    generator = SpeculativeGenerator(backend, max_context_length=LONG_CONTEXT, prefill_chunk=prefill_chunk)
    long_prompt = [int(t) for t in np.random.default_rng(5).integers(4, VOCAB_SIZE, 1500)]

    async def scenario():
        stream_started = asyncio.Event()

        async def stream() -> None:
            async for update in generator.generate(GenerationRequest([5, 9, 14], 60), 1):
                if update.token_ids:
                    stream_started.set()

        running = asyncio.create_task(stream())
        await stream_started.wait()
        long_output = await collect(generator, GenerationRequest(long_prompt, 4), 2)
        await running
        return long_output

    output = asyncio.run(scenario())
    prefill = [i for i, batch in enumerate(batches) for r in batch
               if r.sequence_id == 2 and r.past_length < len(long_prompt) and len(r.input_ids) > 1]
    during = sum(1 for batch in batches[prefill[0]:prefill[-1] + 1] for r in batch if r.sequence_id == 1)
    return output, batches, during


def test_a_long_prompt_is_prefilled_in_chunks_between_the_steps_of_a_running_stream(long_pair):
    chunked, batches, during = interleaving(long_pair, prefill_chunk=128)
    chunks = [len(r.input_ids) for batch in batches for r in batch if r.sequence_id == 2 and len(r.input_ids) > 1]
    assert chunks[:12] == [128] * 11 + [1500 - 11 * 128]
    assert during >= 10  # the running stream got a step beside (nearly) every chunk
    whole, batches, during_whole = interleaving(long_pair, prefill_chunk=0)
    assert [len(r.input_ids) for batch in batches for r in batch if r.sequence_id == 2][0] == 1500
    assert during_whole <= 1  # without chunking: one call, the stream waits for all of it
    assert chunked == whole
