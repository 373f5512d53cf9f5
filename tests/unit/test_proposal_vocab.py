"""A draft restricted to a proposal vocabulary (FR-Spec): same logits on the subset, -inf elsewhere, in torch
and in the ONNX export; speculation with it stays lossless (greedy == plain, rejection sampling keeps the
target's law when q is zero outside the subset); the build script picks the most frequent tokens."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chisquare
from specdec.checkpoint import PROPOSAL_VOCAB_FILE, read_proposal_vocab
from specdec.engines import DraftEngine, StepRequest, TargetEngine
from specdec.inprocess import InProcessBackend
from specdec.rejection_sampler import rejection_verify
from specdec.runtime.base import ForwardItem, ForwardOutput, expand_to_vocab
from specdec.runtime.parity import logit_parity
from specdec.runtime.torch_llama import TorchLlamaRuntime
from specdec.sampling import SamplingParams, sample
from test_speculation_engine import (  # tests/unit is on sys.path (rootdir import)
    PROMPTS,
    assert_greedy_speculation_equals_plain,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "build"))

SUBSET = sorted({0, 1, 2, *range(3, 96, 2)})  # specials + odd ids: 50 of 96 tokens


@pytest.fixture(scope="module")
def pruned_draft(tiny_pair, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pruned") / "draft"
    shutil.copytree(tiny_pair[1], folder)
    (folder / PROPOSAL_VOCAB_FILE).write_text(json.dumps({"token_ids": SUBSET}))
    return folder


def test_reading_validates_the_file(tmp_path):
    assert read_proposal_vocab(tmp_path, 96) is None
    for bad in ({"token_ids": []}, {"token_ids": [1, 1]}, {"token_ids": [5, 96]}, {"token_ids": "12"},
                {"ids": [1]}):
        (tmp_path / PROPOSAL_VOCAB_FILE).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="token"):
            read_proposal_vocab(tmp_path, 96)
    (tmp_path / PROPOSAL_VOCAB_FILE).write_text(json.dumps({"token_ids": [7, 3]}))
    assert read_proposal_vocab(tmp_path, 96) == [7, 3]


def test_torch_logits_equal_the_full_model_on_the_subset(tiny_pair, pruned_draft):
    full = TorchLlamaRuntime(tiny_pair[1], num_slots=1, max_length=64)
    pruned = TorchLlamaRuntime(pruned_draft, num_slots=1, max_length=64)
    item = [ForwardItem(0, 0, np.array(PROMPTS[1]), num_logits=4)]
    expected, got = full.forward(item)[0], pruned.forward(item)[0]
    outside = np.setdiff1d(np.arange(96), SUBSET)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got[:, SUBSET], expected[:, SUBSET], rtol=1e-5, atol=1e-5)
    assert np.isneginf(got[:, outside]).all()
    assert set(got.argmax(-1).tolist()) <= set(SUBSET)


def test_onnx_export_matches_torch(pruned_draft, tmp_path):
    pytest.importorskip("onnxruntime")
    from specdec.runtime.graph_contract import checkpoint_fingerprint, read_graph_metadata
    from specdec.runtime.onnx_llama import OnnxLlamaRuntime

    onnx_rt = OnnxLlamaRuntime(pruned_draft, num_slots=2, max_length=64, engine_dir=tmp_path)
    torch_rt = TorchLlamaRuntime(pruned_draft, num_slots=2, max_length=64)
    items = [ForwardItem(0, 0, np.array(PROMPTS[0]), num_logits=2), ForwardItem(1, 0, np.array(PROMPTS[2]))]
    for a, b in zip(torch_rt.forward(items), onnx_rt.forward(items), strict=True):
        assert np.isfinite(a).sum() == len(a) * len(SUBSET)
        max_diff, agreement = logit_parity(a, b)  # also checks that the -inf are at the same places
        assert max_diff < 1e-3 and agreement == 1.0
    meta = read_graph_metadata(tmp_path / "decoder.onnx")
    assert meta["proposal_vocab_size"] == str(len(SUBSET))
    assert meta["checkpoint_fingerprint"] == checkpoint_fingerprint(pruned_draft)


def test_fingerprint_changes_with_the_subset(tiny_pair, pruned_draft):
    from specdec.runtime.graph_contract import checkpoint_fingerprint

    assert checkpoint_fingerprint(tiny_pair[1]) != checkpoint_fingerprint(pruned_draft)


@pytest.fixture(scope="module")
def pruned_backend(tiny_pair, pruned_draft) -> InProcessBackend:
    return InProcessBackend(
        TargetEngine(TorchLlamaRuntime(tiny_pair[0], num_slots=4, max_length=160), idle_timeout_s=60),
        DraftEngine(TorchLlamaRuntime(pruned_draft, num_slots=4, max_length=160), idle_timeout_s=60),
    )


@pytest.mark.parametrize(("k", "candidates"), [(4, 1), (3, 3)])
def test_greedy_speculation_with_a_pruned_draft_equals_plain(pruned_backend, k, candidates):
    assert_greedy_speculation_equals_plain(pruned_backend, k, candidates)


def test_a_pruned_draft_only_proposes_subset_tokens(pruned_draft):
    draft = DraftEngine(TorchLlamaRuntime(pruned_draft, num_slots=1, max_length=64), idle_timeout_s=60)
    for prompt in PROMPTS:
        proposal = draft.step([StepRequest(1, 0, np.array(prompt), start=True, num_draft_tokens=4,
                                           num_candidates=3)])[0]
        assert set(np.asarray(proposal.token_ids).tolist()) <= set(SUBSET)
        draft.step([StepRequest(1, end=True)])
    assert draft.slots_in_use == 0


class _VocabWide:
    """A runtime's forwards with its logits spread over the vocabulary (the engine's path before it kept a
    drafter's proposal-vocabulary columns), for comparing proposals."""

    def __init__(self, runtime: TorchLlamaRuntime) -> None:
        self.runtime = runtime
        self.logit_ids = None

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def forward_outputs(self, items):
        return [ForwardOutput(expand_to_vocab(out.logits, self.runtime.logit_ids, self.runtime.vocab_size),
                              out.hidden) for out in self.runtime.forward_outputs(items)]


@pytest.mark.parametrize("shape", [
    {"num_draft_tokens": 4},  # a greedy chain: chosen among the columns
    {"num_draft_tokens": 3, "num_candidates": 3},  # a fixed tree
    {"num_draft_tokens": 3, "num_candidates": 2, "tree_nodes": 5},  # a dynamic tree
    {"num_draft_tokens": 3, "num_candidates": 2, "tree_nodes": 5, "min_confidence": 0.05},  # a floored tree
    {"num_draft_tokens": 3, "sampling": SamplingParams(temperature=0.8, seed=5), "want_logits": True},
])
def test_proposals_from_the_proposal_vocabulary_columns_equal_the_vocabulary_wide_ones(pruned_draft, shape):
    columns = DraftEngine(TorchLlamaRuntime(pruned_draft, num_slots=1, max_length=64), idle_timeout_s=60)
    wide = DraftEngine(_VocabWide(TorchLlamaRuntime(pruned_draft, num_slots=1, max_length=64)), idle_timeout_s=60)
    assert len(columns.runtime.logit_ids) == len(SUBSET)
    for prompt in PROMPTS:
        got, expected = (engine.step([StepRequest(1, 0, np.array(prompt), start=True, end=True, **shape)])[0]
                         for engine in (columns, wide))
        assert got.error is None and np.array_equal(got.token_ids, expected.token_ids)
        assert np.array_equal(got.parents, expected.parents)
        if shape.get("want_logits"):  # the rejection sampler reads q over the vocabulary, zero outside the subset
            assert got.logits.shape == (3, 96) and np.array_equal(got.logits, expected.logits)
            assert np.isneginf(np.delete(got.logits, SUBSET, axis=1)).all()


def test_rejection_sampling_keeps_the_target_law_when_q_is_zero_outside_the_subset():
    p = np.array([0.30, 0.05, 0.20, 0.02, 0.18, 0.10, 0.08, 0.07])
    q = np.array([0.25, 0.0, 0.05, 0.0, 0.30, 0.0, 0.40, 0.0])  # a draft restricted to tokens 0, 2, 4, 6
    rng = np.random.default_rng(7)
    draws = 100_000
    counts = np.zeros(len(p), dtype=np.int64)
    for _ in range(draws):
        token = sample(q, rng)
        verdict = rejection_verify([token], [-1], np.stack([p, p]), q[None], rng)
        counts[token if verdict.path else verdict.next_token] += 1
    assert chisquare(counts, p * draws).pvalue > 1e-3
    assert counts[[1, 3, 5, 7]].sum() > 0  # tokens the draft cannot propose still come out, from the residual


def test_build_script_ranks_by_domain_averaged_frequency():
    import draft_vocab

    freqs = {"a": np.array([0.5, 0.3, 0.2, 0.0, 0.0]), "b": np.array([0.0, 0.1, 0.0, 0.5, 0.4])}
    chosen = draft_vocab.choose(freqs, 3, always=[4])
    assert chosen == [0, 3, 4]  # 4 is forced; then the highest mean frequencies: 0 (0.25) and 3 (0.25)
    assert draft_vocab.coverage(freqs, chosen) == {"a": 0.5, "b": 0.9}
