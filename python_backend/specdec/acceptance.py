"""Verification of a proposal (a chain or a tree of draft tokens) against the target's logits.

A proposal's nodes are listed parents-first; `parents[i]` is node i's parent (-1: the root, i.e. the last
committed token). Target logits row 0 is the distribution after the root, row 1 + i after node i. Every
rule walks from the root, keeps the longest accepted path, and adds one token from the target at the
first rejected position (or after the last accepted node): the bonus token.

- greedy: a node is accepted when it is the target's argmax (exact match; lossless for greedy decoding).
- typical: accepted when p(x) >= verify_threshold * max p (lossy; threshold 1 is exact match).
- rejection: speculative sampling (see rejection_sampler.py; lossless for sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specdec.sampling import SamplingParams, probabilities, sample

ACCEPTANCE_MODES = ("greedy", "typical", "rejection")


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root to leaf
    next_token: int  # the bonus token from the target

    @property
    def accepted(self) -> int:
        return len(self.path)


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(int(parent), []).append(node)
    return children


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def _walk(parents: Sequence[int], accept: Callable[[int, int], bool]) -> list[int]:
    """Longest path from the root whose every node passes accept(node, logits_row)."""
    children = children_of(parents)
    path, current = [], -1
    while True:
        row = current + 1
        chosen = next((child for child in children.get(current, []) if accept(child, row)), None)
        if chosen is None:
            return path
        path.append(chosen)
        current = chosen


def greedy_verify(tokens: Sequence[int], parents: Sequence[int], target_argmax: np.ndarray) -> Verdict:
    """`target_argmax[r]` is the target's greedy token at logits row r."""
    path = _walk(parents, lambda node, row: int(tokens[node]) == int(target_argmax[row]))
    return Verdict(path, int(target_argmax[path[-1] + 1 if path else 0]))


def typical_verify(tokens: Sequence[int], parents: Sequence[int], target_logits: np.ndarray, threshold: float,
                   sampling: SamplingParams, rng: np.random.Generator) -> Verdict:
    """Accept near-top tokens: p(x) >= threshold * max_y p(y), with p the target's softmax at temperature 1
    (sampling temperature, when set). The bonus token follows the request's sampling rule."""
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    scaled = target_logits / temperature
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    path = _walk(parents, lambda node, row: probs[row, int(tokens[node])] >= threshold * probs[row].max())
    last_row = target_logits[path[-1] + 1 if path else 0]
    next_token = sample(probabilities(last_row, sampling)[0], rng) if not sampling.greedy else int(last_row.argmax())
    return Verdict(path, next_token)


def greedy_accept(draft_tokens: Sequence[int], target_argmax: Sequence[int] | np.ndarray) -> tuple[int, int]:
    """Chain form of greedy_verify: (number of accepted draft tokens, bonus token)."""
    verdict = greedy_verify(draft_tokens, chain_parents(len(draft_tokens)), np.asarray(target_argmax))
    return verdict.accepted, verdict.next_token
