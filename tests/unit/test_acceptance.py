"""Acceptance rules: greedy and typical walk trees as defined; rejection sampling keeps the target's law."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare
from specdec.acceptance import chain_parents, greedy_verify, typical_verify
from specdec.rejection_sampler import rejection_verify
from specdec.sampling import SamplingParams, make_rng, probabilities, sample


def test_greedy_walks_the_matching_branch_of_a_tree():
    # root -> {5, 7}; 5 -> 6; 7 -> 8 -> 9  (depth-major order)
    tokens = [5, 7, 6, 8, 9]
    parents = [-1, -1, 0, 1, 3]
    # Target argmax per logits row (root, then after each node): 7 after the root, 8 after node 1 (7),
    # 9 after node 3 (8), 42 after node 4 (9).
    argmax = np.array([7, 99, 8, 99, 9, 42])
    verdict = greedy_verify(tokens, parents, argmax)
    assert verdict.path == [1, 3, 4] and verdict.next_token == 42


def test_greedy_rejects_at_the_first_mismatch_and_takes_the_target_token():
    verdict = greedy_verify([3, 4, 5], chain_parents(3), np.array([3, 4, 9, 1]))
    assert verdict.path == [0, 1] and verdict.next_token == 9


def test_typical_accepts_tokens_near_the_top_and_threshold_one_is_exact_match():
    logits = np.log(np.array([[0.5, 0.4, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]))
    rng = make_rng(0)
    # token 1 has p = 0.4 >= 0.7 * 0.5; then token 0 has p = 0.2 < 0.7 * 0.6: rejected, bonus = argmax = 2.
    verdict = typical_verify([1, 0], chain_parents(2), logits, 0.7, SamplingParams(), rng)
    assert verdict.path == [0] and verdict.next_token == 2
    strict = typical_verify([1, 0], chain_parents(2), logits, 1.0, SamplingParams(), rng)
    assert strict.path == [] and strict.next_token == 0
    loose = typical_verify([1, 0], chain_parents(2), logits, 0.3, SamplingParams(), rng)
    assert loose.path == [0, 1] and loose.next_token == 2


P = np.array([0.30, 0.05, 0.20, 0.02, 0.18, 0.10, 0.08, 0.07])
Q = np.array([0.10, 0.30, 0.05, 0.20, 0.05, 0.05, 0.20, 0.05])
DRAWS = 100_000


def first_token_counts(candidates: int, deterministic: bool = False) -> np.ndarray:
    rng = np.random.default_rng(1234)
    counts = np.zeros(len(P), dtype=np.int64)
    target = np.stack([P] * (1 + candidates))  # rows after the root and after each candidate
    for _ in range(DRAWS):
        if deterministic:
            tokens, draft = [int(np.argmax(Q))], None
        else:
            tokens = [sample(Q, rng) for _ in range(candidates)]
            draft = np.stack([Q] * candidates)
        verdict = rejection_verify(tokens, [-1] * len(tokens), target[: 1 + len(tokens)], draft, rng)
        first = tokens[verdict.path[0]] if verdict.path else verdict.next_token
        counts[first] += 1
    return counts


@pytest.mark.parametrize(("candidates", "deterministic"), [(1, False), (3, False), (1, True)])
def test_rejection_sampling_matches_the_target_distribution(candidates, deterministic):
    counts = first_token_counts(candidates, deterministic)
    assert counts.sum() == DRAWS
    result = chisquare(counts, P * DRAWS)
    assert result.pvalue > 1e-3, (counts / DRAWS, result)
    # And it is not trivially the draft's law.
    assert chisquare(counts, Q * DRAWS).pvalue < 1e-12


def test_sampling_rules_are_applied_like_the_reference():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert np.allclose(probabilities(logits, SamplingParams(1.0, top_k=2))[0], [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(probabilities(logits, SamplingParams(1.0, top_p=0.65))[0], [4 / 7, 3 / 7, 0, 0])
    assert np.allclose(probabilities(logits, SamplingParams(0.0))[0], [1, 0, 0, 0])
    hot = probabilities(logits, SamplingParams(2.0))[0]
    expected = np.sqrt([0.4, 0.3, 0.2, 0.1])
    assert np.allclose(hot, expected / expected.sum())


def test_seeded_draws_repeat():
    probs = np.full(50, 1 / 50)
    a = [sample(probs, make_rng(7, i)) for i in range(20)]
    b = [sample(probs, make_rng(7, i)) for i in range(20)]
    assert a == b and len(set(a)) > 5
