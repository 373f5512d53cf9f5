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


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.95), (1.3, 0.8)])
def test_a_sampled_trees_first_two_tokens_follow_the_targets_joint_law(temperature, top_p):
    """A tree of two chains, two levels deep, each node drawn from the draft's law given its parent (the first
    level's two drawn independently, as engines draft them): the first two tokens emitted follow the target's
    p(x1) p(x2 | x1) under the request's temperature and top_p, chi-square over the pairs (a second token not
    emitted by this verification is drawn from p(. | x1), as the next one would)."""
    vocab, draws = 6, 60_000
    params = SamplingParams(temperature, top_p=top_p)
    gen = np.random.default_rng(7)
    law = lambda logits: probabilities(logits, params)  # noqa: E731
    p1, q1 = law(gen.normal(size=(1, vocab)) * 2)[0], law(gen.normal(size=(1, vocab)) * 2)[0]
    p2, q2 = law(gen.normal(size=(vocab, vocab)) * 2), law(gen.normal(size=(vocab, vocab)) * 2)
    p3 = law(gen.normal(size=(1, vocab)))[0]
    parents = [-1, -1, 0, 1]
    rng = np.random.default_rng(11)
    counts = np.zeros((vocab, vocab))
    for _ in range(draws):
        first = [sample(q1, rng), sample(q1, rng)]
        tokens = first + [sample(q2[t], rng) for t in first]
        draft = np.stack([q1, q1, q2[first[0]], q2[first[1]]])
        target = np.stack([p1, p2[first[0]], p2[first[1]], p3, p3])
        verdict = rejection_verify(tokens, parents, target, draft, rng)
        emitted = [tokens[node] for node in verdict.path] + [verdict.next_token]
        if len(emitted) == 1:
            emitted.append(sample(p2[emitted[0]], rng))
        counts[emitted[0], emitted[1]] += 1
    expected = (p1[:, None] * p2).reshape(-1) * draws
    observed = counts.reshape(-1)
    big = expected > 50
    assert observed[expected == 0].sum() == 0  # nothing outside the nucleus
    pooled = expected[~big].sum() > 0  # the unlikely pairs, as one cell (where the nucleus leaves any)
    result = chisquare(np.append(observed[big], observed[~big].sum()) if pooled else observed[big],
                       np.append(expected[big], expected[~big].sum()) if pooled else expected[big])
    assert result.pvalue > 1e-3, result
    wrong = (q1[:, None] * q2).reshape(-1) * draws  # and it is not the draft's law
    some = big & (wrong > 0)
    assert chisquare(observed[some], wrong[some] * observed[some].sum() / wrong[some].sum()).pvalue < 1e-12
