"""The onnxruntime runtime behaves like the torch runtime behind the engines and the speculative loop, and
the shared batch layout (specdec.runtime.layout) splits and chunks batches without changing results."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from specdec.engines import DraftEngine, TargetEngine  # noqa: E402
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator  # noqa: E402
from specdec.inprocess import InProcessBackend  # noqa: E402
from specdec.runtime import build_runtime  # noqa: E402
from specdec.runtime.base import ForwardItem  # noqa: E402
from specdec.runtime.graph_contract import ONNX_FILE  # noqa: E402
from specdec.runtime.layout import key_rows, plan_batch, split_for_limits  # noqa: E402
from specdec.runtime.onnx_llama import OnnxLlamaRuntime, resolve_onnx  # noqa: E402
from specdec.runtime.torch_llama import TorchLlamaRuntime  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "tests" / "fixtures" / "pair_12m" / "target"
DRAFT = REPO / "tests" / "fixtures" / "pair_12m" / "draft"
PROMPTS = [[5, 17, 42], [8, 66, 3, 91, 12, 7, 30], [44], [10, 20, 30, 40, 50, 60, 70, 80]]


def generate_all(backend: InProcessBackend, k: int, max_tokens: int = 48) -> list[list[int]]:
    generator = SpeculativeGenerator(backend, max_context_length=128)

    async def one(prompt: list[int], sequence_id: int) -> list[int]:
        out: list[int] = []
        async for update in generator.generate(GenerationRequest(prompt, max_tokens, num_draft_tokens=k),
                                               sequence_id, GenerationStats()):
            out.extend(update.token_ids)
        return out

    async def together() -> list[list[int]]:  # concurrent sequences: batched engine steps
        return await asyncio.gather(*[one(p, 10 + i) for i, p in enumerate(PROMPTS)])

    return asyncio.run(together())


def backend_of(kind: str, target_dir: Path, draft_dir: Path, engine_root: Path) -> InProcessBackend:
    def runtime(folder: Path, name: str):
        return build_runtime(kind, folder, num_slots=4, max_length=128, num_threads=1,
                             engine_dir=engine_root / name if kind == "onnxruntime" else None)

    return InProcessBackend(TargetEngine(runtime(target_dir, "target"), idle_timeout_s=60),
                            DraftEngine(runtime(draft_dir, "draft"), idle_timeout_s=60))


@pytest.mark.parametrize("pair", ["tiny", "committed"])
def test_speculative_generation_identical_to_torch(tiny_pair, tmp_path, pair):
    target_dir, draft_dir = tiny_pair if pair == "tiny" else (TARGET, DRAFT)
    torch_backend = backend_of("torch", target_dir, draft_dir, tmp_path)
    onnx_backend = backend_of("onnxruntime", target_dir, draft_dir, tmp_path)
    assert isinstance(onnx_backend.target.runtime, OnnxLlamaRuntime)
    for k in (0, 4):
        expected = generate_all(torch_backend, k)
        assert generate_all(onnx_backend, k) == expected
        assert all(len(out) == 48 for out in expected)
    assert onnx_backend.target.slots_in_use == 0 and onnx_backend.draft.slots_in_use == 0


def test_split_and_chunked_batches_equal_one_batch(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    whole = OnnxLlamaRuntime(target_dir, num_slots=3, max_length=64, engine_dir=tmp_path)
    limited = OnnxLlamaRuntime(target_dir, num_slots=3, max_length=64, engine_dir=tmp_path, max_batch=2,
                               max_step_tokens=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, n) for n in (11, 4, 7)]
    first = [ForwardItem(i, 0, p, num_logits=min(5, len(p))) for i, p in enumerate(prompts)]
    for a, b in zip(whole.forward(first), limited.forward(first), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    tree = ForwardItem(1, 4, np.array([9, 10, 11]), num_logits=3, tree_parents=np.array([-1, 0, 0]))
    chain = ForwardItem(0, 11, np.array([12, 13, 14, 15, 16]), num_logits=5)  # chunked: 3 + 2 tokens
    for a, b in zip(whole.forward([tree, chain]), limited.forward([tree, chain]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    too_big = ForwardItem(2, 7, np.arange(4), num_logits=1, tree_parents=np.array([-1, 0, 1, 2]))
    with pytest.raises(ValueError, match="tree of 4 tokens"):
        limited.forward([too_big])


def test_split_for_limits_keeps_the_wanted_logits():
    items = [ForwardItem(0, 0, np.arange(7), num_logits=4), ForwardItem(1, 2, np.arange(2), num_logits=1)]
    rounds = split_for_limits(items, max_batch=1, max_tokens=3)
    shapes = [[(p.item_index, p.item.past_length, p.item.num_tokens, p.keep) for p in batch] for batch in rounds]
    # item 0: chunks of 3, 3, 1 tokens in three rounds; its last 4 logits: all 3 of chunk 2, 1 of chunk 3
    assert shapes == [[(0, 0, 3, 0)], [(1, 2, 2, 1)], [(0, 3, 3, 3)], [(0, 6, 1, 1)]]


@pytest.mark.parametrize("kind", ["torch", "onnxruntime"])
def test_tree_with_cached_nodes_scores_like_the_whole_tree(tiny_pair, tmp_path, kind):
    """A tree grown over two calls (the first nodes cached) scores like the whole tree in one call."""
    target_dir, _ = tiny_pair
    runtime = (TorchLlamaRuntime(target_dir, num_slots=2, max_length=64, num_threads=1) if kind == "torch"
               else OnnxLlamaRuntime(target_dir, num_slots=2, max_length=64, engine_dir=tmp_path))
    prefix = np.array([3, 14, 15, 9, 26])
    parents = np.array([-1, -1, 0, 1, 2, 3])  # two chains of depth 3, depth-major
    tokens = np.array([40, 41, 50, 51, 60, 61])
    for slot in (0, 1):
        runtime.forward([ForwardItem(slot, 0, prefix)])
    whole = runtime.forward([ForwardItem(0, 5, tokens, num_logits=6, tree_parents=parents)])[0]
    runtime.forward([ForwardItem(1, 5, tokens[:2], num_logits=2, tree_parents=parents[:2])])
    grown = runtime.forward([ForwardItem(1, 5, tokens[2:], num_logits=4, tree_parents=parents,
                                         num_cached_nodes=2)])[0]
    np.testing.assert_allclose(grown, whole[2:], atol=1e-4, rtol=1e-4)


def test_layout_mask_puts_new_tokens_at_their_rows(tiny_pair):
    items = [ForwardItem(0, 3, np.array([1, 2]), num_logits=2),
             ForwardItem(1, 1, np.array([4, 5, 6]), num_logits=1, tree_parents=np.array([-1, 0, 0]))]
    plan = plan_batch(items, max_length=16)
    assert key_rows(items) == 6  # item 0's first new row 3 + the padded width 3
    assert plan.new_rows().tolist() == [[3, 4, 5], [1, 2, 3]]  # item 0's padding token at row 5
    cache, wide = plan.cache_mask(), plan.cache_mask(8)
    assert cache.shape == (2, 3, 5) and wide.shape == (2, 3, 8)
    # item 0: prefix rows 0..2, then causal; item 1: row 0, then its ancestors.
    assert cache[0, :2].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert cache[1].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0]]
    assert np.array_equal(wide[:, :, :5], cache) and not wide[:, :, 5:].any()  # rows past the batch: unseen
    assert plan.logit_rows.tolist() == [0, 1, 5]
    assert plan.write_row.tolist() == [3, 4, 1, 2, 3]
    with pytest.raises(ValueError, match="fewer than"):
        plan.cache_mask(4)


def test_export_is_made_once_and_reused(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    path = resolve_onnx(target_dir, tmp_path / "cache")
    assert path == tmp_path / "cache" / ONNX_FILE
    stamp = path.stat().st_mtime_ns
    assert resolve_onnx(target_dir, tmp_path / "cache") == path and path.stat().st_mtime_ns == stamp
    path.write_bytes(b"truncated")  # a broken file is rebuilt, never loaded
    assert resolve_onnx(target_dir, tmp_path / "cache") == path and path.stat().st_size > 1000


def test_unwritable_model_folder_falls_back_to_the_user_cache(tiny_pair, tmp_path, monkeypatch):
    import shutil

    source, _ = tiny_pair
    model = tmp_path / "model"
    shutil.copytree(source, model)
    (model / "onnx").write_text("not a folder")  # <model>/onnx cannot be created (even by root)
    monkeypatch.setenv("SPECDEC_ONNX_CACHE", str(tmp_path / "user_cache"))
    path = resolve_onnx(model)
    assert path.parent.parent == tmp_path / "user_cache" and path.is_file()


def test_runtime_names_and_devices(tiny_pair):
    with pytest.raises(ValueError, match="runs on the CPU"):
        build_runtime("onnxruntime", tiny_pair[0], num_slots=1, max_length=8, device="cuda")
    with pytest.raises(ValueError, match="unknown runtime"):
        build_runtime("tvm", tiny_pair[0], num_slots=1, max_length=8)


def test_serving_on_onnxruntime_never_imports_torch(tiny_pair, tmp_path):
    """A model process on the CPU default loads an existing export and decodes without torch (~135 MiB of
    private memory per process saved); torch comes in only to make a missing export."""
    import subprocess
    import sys

    resolve_onnx(tiny_pair[1], tmp_path)  # the export exists beforehand, as `make onnx-exports` leaves it
    script = (
        "import sys, numpy as np\n"
        "from specdec.runtime import build_runtime\n"
        "from specdec.runtime.base import ForwardItem\n"
        f"rt = build_runtime('onnxruntime', {str(tiny_pair[1])!r}, num_slots=2, max_length=64, num_threads=1,"
        f" engine_dir={str(tmp_path)!r})\n"
        "logits = rt.forward([ForwardItem(0, 0, np.array([5, 17, 42]), num_logits=2)])[0]\n"
        "rt.move_rows(0, np.array([0, 2]), 0)\n"
        "assert logits.shape == (2, rt.vocab_size) and np.isfinite(logits).all()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "python_backend")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


PAST = 40  # the prefix every slot of the bit-for-bit tests holds


def _prefilled(engine_dir, threads: int, slots: int, seed: int) -> tuple[OnnxLlamaRuntime, np.ndarray]:
    """A runtime over the target whose `slots` hold the same PAST random tokens, and 20 more tokens to go on."""
    runtime = OnnxLlamaRuntime(TARGET, num_slots=slots, max_length=128, num_threads=threads, engine_dir=engine_dir)
    ids = np.random.default_rng(seed).integers(3, runtime.vocab_size, PAST + 20)
    for slot in range(slots):
        runtime.forward([ForwardItem(slot, 0, ids[:PAST])])
    return runtime, ids


@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_step_gives_the_logits_of_a_verification_pass_bit_for_bit(tmp_path, threads):
    """Greedy speculation equals plain greedy decoding exactly only where a one-token step and a (k+1)-token
    verification compute a position's logits identically: onnxruntime's single-row products round
    differently, so the step graph keeps every product at two rows or more (docs/SPECULATION.md)."""
    runtime, ids = _prefilled(tmp_path, threads, 3, seed=1)
    past = PAST
    verify = runtime.forward([ForwardItem(0, past, ids[past:past + 9], num_logits=9)])[0]
    steps = np.stack([runtime.forward([ForwardItem(0, past + j, ids[past + j:past + j + 1])])[0][0]
                      for j in range(9)])
    assert np.array_equal(steps, verify), f"max |diff| {np.abs(steps - verify).max()}"
    batched = runtime.forward([ForwardItem(slot, past, ids[past:past + 1]) for slot in (1, 2)])
    assert all(np.array_equal(out[0], verify[0]) for out in batched)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_tree_node_gets_the_logits_of_the_same_tokens_in_a_chain_bit_for_bit(tmp_path, threads):
    """A tree node's ancestors sit at other cache rows than in a chain (siblings between them): the graph's softmax
    sums by a matrix product, in key order, so the masked rows between change nothing (docs/SPECULATION.md)."""
    runtime, ids = _prefilled(tmp_path, threads, 2, seed=2)
    past = PAST
    chain = runtime.forward([ForwardItem(0, past, ids[past:past + 3], num_logits=3)])[0]
    # node 0 = ids[40], node 1 a sibling, node 2 = ids[41] under node 0, node 3 a sibling of it, node 4 = ids[42]
    nodes = np.array([ids[past], 7, ids[past + 1], 11, ids[past + 2]])
    tree = runtime.forward([ForwardItem(1, past, nodes, num_logits=5, tree_parents=np.array([-1, -1, 0, 0, 2]))])[0]
    np.testing.assert_array_equal(tree[[0, 2, 4]], chain)
