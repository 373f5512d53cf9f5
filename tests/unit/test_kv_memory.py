"""KV memory that follows use (specdec.kv_memory): block tables, runtimes over a shared fragmented pool, the
engines' accounting returning to zero, and the budget enforced by admission with a clear rejection."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from specdec.admission import Admission
from specdec.engines import DraftEngine, StepRequest, TargetEngine
from specdec.errors import CapacityError, InvalidRequestError
from specdec.generation import GenerationRequest, SpeculativeGenerator
from specdec.inprocess import BatchingBackend
from specdec.kv_memory import BlockPool, PoolModel, pair_pool_blocks
from specdec.runtime.base import ForwardItem
from specdec.runtime.torch_llama import TorchLlamaRuntime
from transformers import LlamaForCausalLM

BLOCK = 4


def hf_logits(model_dir, ids: list[int]) -> np.ndarray:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_block_tables_grow_shrink_and_refuse_past_the_pool():
    pool = BlockPool(num_blocks=5, block_size=BLOCK, num_slots=3)
    pool.resize(0, 9)  # 3 blocks
    pool.resize(1, 4)  # 1 block
    assert pool.blocks_in_use == 4 and pool.rows_held(0) == 12
    with pytest.raises(CapacityError, match="KV memory full"):
        pool.resize(2, 8)  # 2 blocks, 1 free
    assert pool.rows_held(2) == 0 and pool.blocks_in_use == 4  # a refused resize changes nothing
    pool.resize(0, 5)  # rollback by length gives a block back
    assert pool.blocks_in_use == 3
    pool.resize(2, 8)
    rows = pool.physical_rows(2, np.arange(8))
    assert len(set(rows.tolist()) & set(pool.physical_rows(0, np.arange(5)).tolist())) == 0
    gathered = pool.gather_rows([2, 1], 8)
    assert gathered[0].tolist() == rows.tolist() and gathered[1, 4:].tolist() == [0] * 4  # unheld rows: padding
    for slot in range(3):
        pool.release(slot)
    assert pool.blocks_in_use == 0 and pool.blocks_free == 5


def test_a_pair_budget_gives_both_pools_the_same_blocks():
    target = PoolModel(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4)  # SmolLM2-135M, fp32
    draft = PoolModel(num_layers=1, num_kv_heads=3, head_dim=64, dtype_bytes=4)
    assert target.bytes_per_token == 46_080
    blocks = pair_pool_blocks(16_384 * (46_080 + 1_536), 16, [target, draft])
    assert blocks * 16 == 16_384  # exactly 2 x 8192 or 64 x 256 tokens
    with pytest.raises(ValueError, match="holds no block"):
        pair_pool_blocks(1000, 16, [target, draft])


def fragment(runtime) -> None:
    """Leave the pool's free list interleaved, so later sequences get non-contiguous blocks."""
    for blocks in (1, 2, 3):  # grown in turns: the tables interleave
        for slot in range(runtime.num_slots):
            runtime.resize_rows(slot, BLOCK * blocks)
    for slot in range(runtime.num_slots):
        runtime.resize_rows(slot, BLOCK if slot % 2 else 0)


@pytest.mark.parametrize("kind", ["torch", "onnxruntime"])
def test_runtimes_over_a_fragmented_pool_match_hf_with_rollback_and_tree_commit(tiny_pair, kind, tmp_path):
    target_dir, _ = tiny_pair
    if kind == "torch":
        runtime = TorchLlamaRuntime(target_dir, num_slots=3, max_length=64, num_blocks=24, block_size=BLOCK)
    else:
        from specdec.runtime.onnx_llama import OnnxLlamaRuntime

        runtime = OnnxLlamaRuntime(target_dir, num_slots=3, max_length=64, num_blocks=24, block_size=BLOCK,
                                   engine_dir=tmp_path / "onnx")
    fragment(runtime)
    a, b = [4, 9, 33, 21, 80, 11, 6, 50, 51, 52, 53], [70, 2, 15, 8, 19]
    out = runtime.forward([ForwardItem(0, 0, np.array(a), num_logits=len(a)), ForwardItem(2, 0, np.array(b))])
    assert np.any(np.diff(runtime.kv.tables[0]) != 1) and np.any(np.diff(runtime.kv.tables[2]) != 1)
    np.testing.assert_allclose(out[0], hf_logits(target_dir, a), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out[1], hf_logits(target_dir, b)[-1:], atol=1e-4, rtol=1e-4)
    # Rollback by length across a block boundary: rows 7.. of slot 0 are dropped and rewritten.
    runtime.resize_rows(0, 7 + 3)
    out = runtime.forward([ForwardItem(0, 7, np.array([60, 61, 62]), num_logits=3)])[0]
    np.testing.assert_allclose(out, hf_logits(target_dir, a[:7] + [60, 61, 62])[-3:], atol=1e-4, rtol=1e-4)
    # A tree after b: root 20 with children 30 (-> 40) and 31; keep the path 20, 31 with a commit.
    tree = runtime.forward([ForwardItem(2, len(b), np.array([20, 30, 31, 40]), num_logits=4,
                                        tree_parents=np.array([-1, 0, 0, 1]))])[0]
    np.testing.assert_allclose(tree[2], hf_logits(target_dir, b + [20, 31])[-1], atol=1e-4, rtol=1e-4)
    runtime.move_rows(2, np.array([len(b), len(b) + 2]), len(b))
    out = runtime.forward([ForwardItem(2, len(b) + 2, np.array([77]))])[0]
    np.testing.assert_allclose(out[0], hf_logits(target_dir, b + [20, 31, 77])[-1], atol=1e-4, rtol=1e-4)


def engines(pair, num_blocks: int, num_slots: int = 4):
    target_dir, draft_dir = pair
    make = lambda path: TorchLlamaRuntime(path, num_slots=num_slots, max_length=64,  # noqa: E731
                                          num_blocks=num_blocks, block_size=BLOCK)
    return TargetEngine(make(target_dir), idle_timeout_s=60), DraftEngine(make(draft_dir), idle_timeout_s=60)


def test_engines_hold_blocks_for_the_rows_in_use_and_free_them(tiny_pair):
    target, draft = engines(tiny_pair, num_blocks=8)
    target.step([StepRequest(1, input_ids=np.arange(3, 13), start=True)])  # 10 rows: 3 blocks
    assert target.kv_blocks_in_use == 3
    assert target.kv_bytes_in_use == 3 * target.runtime.kv_bytes_per_block
    target.step([StepRequest(1, past_length=10, input_ids=np.arange(20, 26), num_logits=6)])  # verify 6: 4 blocks
    assert target.kv_blocks_in_use == 4
    target.step([StepRequest(1, past_length=11, input_ids=np.array([40]))])  # 5 rejected: back to 3 blocks
    assert target.kv_blocks_in_use == 3
    # Past the pool: this request fails alone, the others are served.
    results = target.step([StepRequest(2, input_ids=np.arange(3, 27), start=True),
                           StepRequest(1, past_length=12, input_ids=np.array([41]))])
    assert isinstance(results[0].error, CapacityError) and "KV memory full" in str(results[0].error)
    assert results[1].error is None
    target.step([StepRequest(1, end=True), StepRequest(2, end=True)])
    assert target.kv_blocks_in_use == 0 and target.slots_in_use == 0
    # A draft's tree scratch rows are held during the call, given back by the next one.
    draft.step([StepRequest(5, input_ids=np.arange(3, 9), start=True, num_draft_tokens=3, num_candidates=2)])
    assert draft.kv_blocks_in_use == 3  # 6 + 2 x 3 - 1 = 11 rows
    draft.step([StepRequest(5, past_length=6, input_ids=np.array([7]), num_draft_tokens=1)])
    assert draft.kv_blocks_in_use == 2
    draft.slots.idle_timeout_s = -1  # an idle sequence's blocks go with its slot
    draft.slots.evict_idle()
    assert draft.kv_blocks_in_use == 0


def test_admission_fits_many_short_or_few_long_generations_in_one_budget():
    async def scenario():
        admission = Admission(capacity=64, max_waiting=1, timeout_s=0.2, poll_s=0.01, kv_blocks=1024,
                              block_size=16)  # 16,384 tokens
        async with contextlib_all([admission.slot(rows=256) for _ in range(64)]):
            assert admission.running == 64 and admission.blocks_reserved == 1024
        async with contextlib_all([admission.slot(rows=8192) for _ in range(2)]):
            assert admission.blocks_reserved == 1024
            with pytest.raises(CapacityError, match="within 0.2 s"):  # a third long one waits, then gives up
                async with admission.slot(rows=8192):
                    pass
        assert admission.running == 0 and admission.blocks_reserved == 0
        with pytest.raises(InvalidRequestError, match="whole budget"):
            async with admission.slot(rows=16_385):
                pass

    asyncio.run(scenario())


def contextlib_all(managers):
    import contextlib

    stack = contextlib.AsyncExitStack()

    class _All:
        async def __aenter__(self):
            for manager in managers:
                await stack.enter_async_context(manager)

        async def __aexit__(self, *exc):
            await stack.aclose()

    return _All()


def test_a_waiting_generation_starts_when_memory_frees_in_arrival_order():
    async def scenario():
        admission = Admission(capacity=8, max_waiting=4, timeout_s=5, poll_s=0.01, kv_blocks=10, block_size=16)
        order: list[str] = []
        release = asyncio.Event()

        async def job(name: str, rows: int, hold: asyncio.Event | None = None) -> None:
            async with admission.slot(rows=rows):
                order.append(name)
                if hold is not None:
                    await hold.wait()

        first = asyncio.create_task(job("long-1", 128, release))  # 8 blocks
        await asyncio.sleep(0.02)
        later = [asyncio.create_task(job("long-2", 96)), asyncio.create_task(job("short", 16))]
        await asyncio.sleep(0.05)
        assert order == ["long-1"] and admission.waiting == 2  # "short" fits but does not overtake
        release.set()
        await asyncio.gather(first, *later)
        assert order == ["long-1", "long-2", "short"] and admission.blocks_reserved == 0

    asyncio.run(scenario())


def test_cancelled_and_finished_generations_leave_no_kv_memory(tiny_pair):
    target, draft = engines(tiny_pair, num_blocks=64)
    generator = SpeculativeGenerator(BatchingBackend(target, draft), max_context_length=64, prefill_chunk=8)

    async def run(request: GenerationRequest, sequence_id: int, cancel_after: int | None = None) -> int:
        seen = [0]
        cancelled = lambda: cancel_after is not None and seen[0] >= cancel_after  # noqa: E731
        async for update in generator.generate(request, sequence_id, is_cancelled=cancelled):
            seen[0] += len(update.token_ids)
        return seen[0]

    async def scenario():
        return await asyncio.gather(
            run(GenerationRequest(list(range(3, 30)), 20, num_draft_tokens=3), 1),
            run(GenerationRequest(list(range(5, 25)), 30, num_draft_tokens=2), 2, cancel_after=2),
            run(GenerationRequest(list(range(3, 40)), 10, num_draft_tokens=2), 3, cancel_after=0),  # in prefill
        )

    finished, cancelled, cancelled_in_prefill = asyncio.run(scenario())
    assert finished == 20 and 2 <= cancelled < 30 and cancelled_in_prefill == 0
    assert target.kv_blocks_in_use == 0 and draft.kv_blocks_in_use == 0
    assert target.slots_in_use == 0 and draft.slots_in_use == 0


def test_the_deployment_budget_reaches_every_model_and_caps_the_context(tmp_path):
    """cpu.yaml's budget, rendered as `kv_pool`, gives SmolLM2-135M and its 1-layer draft 16,912 tokens."""
    import json
    import sys
    from pathlib import Path

    import yaml
    from specdec.kv_memory import KVPoolConfig

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "build"))
    import render_configs

    configs = render_configs.render(yaml.safe_load((repo / "build/deployments/cpu.yaml").read_text()))
    pools = {name: configs[name].parameters["kv_pool"].string_value
             for name in ("target_model", "draft_model", "speculative_decoding")}
    assert len(set(pools.values())) == 1
    smollm2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "max_position_embeddings": 8192}
    for name, layers in (("target_model", 30), ("draft_model", 1)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "config.json").write_text(json.dumps({**smollm2, "num_hidden_layers": layers}))
    (tmp_path / "speculative_decoding").mkdir()  # the drafter models are optional: found from a model's folder
    pool = KVPoolConfig.from_json(pools["target_model"], tmp_path / "speculative_decoding")
    assert pool.num_blocks() * pool.block_size == 16_912
    assert pool.served_context(8192) == 8192 and pool.served_context(None) == 8192
    small = KVPoolConfig(pool.num_blocks() // 4 * pool.budget_bytes // pool.num_blocks(), pool.block_size,
                         pool.model_dirs, pool.dtypes)
    assert small.served_context(8192) == small.num_blocks() * pool.block_size < 8192  # the pool caps it
