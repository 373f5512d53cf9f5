"""specdec.sampling: the nucleus (top_p) found among the most probable tokens equals the one a stable sort of the
whole row gives, bit for bit, including ties and rows whose nucleus is larger than the candidates."""

from __future__ import annotations

import numpy as np
import pytest
from specdec.sampling import NUCLEUS_CANDIDATES, SamplingParams, probabilities


def reference(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Top-p by a stable sort of the whole row (what `probabilities` computed before candidates)."""
    probs = probabilities(logits, SamplingParams(params.temperature, params.top_k, 1.0))
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    drop_sorted = np.cumsum(sorted_probs, axis=-1) - sorted_probs >= params.top_p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    probs = np.where(drop, 0.0, probs)
    return probs / probs.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999999])
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 5.0])
def test_the_nucleus_equals_a_full_sorts(top_p, temperature):
    rng = np.random.default_rng(int(top_p * 1000) + int(temperature * 10))
    logits = rng.normal(scale=3.0, size=(4, 49_152)).astype(np.float32)
    logits[1, :5000] = 2.0  # a large tie (the boundary inside it)
    logits[2] = 0.0  # a flat row: the nucleus is far larger than the candidates
    logits[3, rng.integers(0, 49_152, 3000)] = logits[3].max()  # ties at the top, spread over the row
    params = SamplingParams(temperature, 0, top_p)
    assert np.array_equal(probabilities(logits, params), reference(logits, params))


def test_small_vocabularies_and_top_k_together():
    rng = np.random.default_rng(5)
    for size in (3, 100, NUCLEUS_CANDIDATES, NUCLEUS_CANDIDATES + 1):
        logits = rng.normal(size=(2, size)).astype(np.float32)
        for params in (SamplingParams(0.8, 0, 0.9), SamplingParams(1.0, 50, 0.7)):
            assert np.array_equal(probabilities(logits, params), reference(logits, params))
