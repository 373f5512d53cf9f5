"""The torch runtime matches Hugging Face's LlamaForCausalLM, batched, cached, and with tree masks."""

from __future__ import annotations

import numpy as np
import torch
from specdec.runtime.base import ForwardItem
from specdec.runtime.torch_llama import TorchLlamaRuntime
from transformers import LlamaForCausalLM


def hf_logits(model_dir, ids: list[int]) -> np.ndarray:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_prefill_and_incremental_match_hf(tiny_pair):
    target_dir, _ = tiny_pair
    ids = [5, 17, 42, 8, 66, 3, 91, 12, 7]
    expected = hf_logits(target_dir, ids)
    runtime = TorchLlamaRuntime(target_dir, num_slots=2, max_length=64)
    full = runtime.forward([ForwardItem(slot=1, past_length=0, input_ids=np.array(ids), num_logits=len(ids))])[0]
    np.testing.assert_allclose(full, expected, atol=1e-4, rtol=1e-4)
    # Prefill 5 tokens, then one token at a time, in the other slot.
    runtime.forward([ForwardItem(slot=0, past_length=0, input_ids=np.array(ids[:5]))])
    for pos in range(5, len(ids)):
        step = runtime.forward([ForwardItem(slot=0, past_length=pos, input_ids=np.array([ids[pos]]))])[0]
        np.testing.assert_allclose(step[0], expected[pos], atol=1e-4, rtol=1e-4)


def test_batched_sequences_of_different_lengths_match_single(tiny_pair):
    target_dir, _ = tiny_pair
    a, b = [4, 9, 33, 21, 80, 11, 6], [70, 2, 15]
    runtime = TorchLlamaRuntime(target_dir, num_slots=3, max_length=64)
    out = runtime.forward(
        [ForwardItem(slot=2, past_length=0, input_ids=np.array(a), num_logits=2),
         ForwardItem(slot=0, past_length=0, input_ids=np.array(b), num_logits=1)]
    )
    np.testing.assert_allclose(out[0], hf_logits(target_dir, a)[-2:], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out[1], hf_logits(target_dir, b)[-1:], atol=1e-4, rtol=1e-4)


def test_rollback_by_length_overwrites_rejected_rows(tiny_pair):
    target_dir, _ = tiny_pair
    runtime = TorchLlamaRuntime(target_dir, num_slots=1, max_length=64)
    runtime.forward([ForwardItem(slot=0, past_length=0, input_ids=np.array([5, 6, 7, 50, 51, 52]))])
    # Reject the last three rows: continue from length 3 with other tokens.
    out = runtime.forward([ForwardItem(slot=0, past_length=3, input_ids=np.array([9, 10]), num_logits=2)])[0]
    np.testing.assert_allclose(out, hf_logits(target_dir, [5, 6, 7, 9, 10])[-2:], atol=1e-4, rtol=1e-4)


def test_tree_mask_scores_each_branch_like_its_own_chain(tiny_pair):
    target_dir, _ = tiny_pair
    prefix = [3, 14, 15, 9]
    # Tree: root r=20 with two children (30, 31); child 30 has child 40.
    tokens = np.array([20, 30, 31, 40])
    parents = np.array([-1, 0, 0, 1])
    runtime = TorchLlamaRuntime(target_dir, num_slots=1, max_length=64)
    runtime.forward([ForwardItem(slot=0, past_length=0, input_ids=np.array(prefix))])
    out = runtime.forward(
        [ForwardItem(slot=0, past_length=4, input_ids=tokens, num_logits=4, tree_parents=parents)]
    )[0]
    np.testing.assert_allclose(out[3], hf_logits(target_dir, prefix + [20, 30, 40])[-1], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out[2], hf_logits(target_dir, prefix + [20, 31])[-1], atol=1e-4, rtol=1e-4)
    # Keep the path 20 -> 30 -> 40 (rows 4, 5, 7) and continue from it.
    runtime.move_rows(0, np.array([4, 5, 7]), dst_start=4)
    nxt = runtime.forward([ForwardItem(slot=0, past_length=7, input_ids=np.array([60]))])[0]
    np.testing.assert_allclose(nxt[0], hf_logits(target_dir, prefix + [20, 30, 40, 60])[-1], atol=1e-4, rtol=1e-4)
