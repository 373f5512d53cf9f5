"""Speculative sampling: lossless for sampled decoding (Leviathan et al.; Chen et al.; multi-candidate
form of SpecInfer).

At a node with target distribution p, its children x_1..x_m were drawn independently from the draft's q
at that node (a deterministic drafter such as n-gram lookup has q = one-hot). Child j is accepted with
probability min(1, p(x_j) / q(x_j)); after a rejection, p becomes the residual norm(max(0, p - q)) for the
next child. When every child is rejected the bonus token is drawn from the last residual; after the last
accepted leaf it is drawn from p. The output is then distributed exactly as sampling from the target.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec.acceptance import Verdict, children_of
from specdec.sampling import sample


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    diff = np.maximum(p - q, 0.0)
    total = diff.sum()
    # p == q exactly: nothing left to correct; any draw from p is right.
    return diff / total if total > 0 else p


def rejection_verify(tokens: Sequence[int], parents: Sequence[int], target_probs: np.ndarray,
                     draft_probs: np.ndarray | None, rng: np.random.Generator) -> Verdict:
    """`target_probs[r]`: the target's sampling distribution at logits row r (0 = root, 1 + i = node i).
    `draft_probs[i]`: the q node i was drawn from (None: one-hot on each node's token)."""
    children = children_of(parents)
    path: list[int] = []
    current = -1
    while True:
        p = target_probs[current + 1].copy()
        kids = children.get(current, [])
        accepted = None
        for child in kids:
            token = int(tokens[child])
            if draft_probs is None:
                q = np.zeros_like(p)
                q[token] = 1.0
            else:
                q = draft_probs[child]
            if q[token] > 0 and rng.random() < min(1.0, p[token] / q[token]):
                accepted = child
                break
            p = residual(p, q)
        if accepted is None:
            return Verdict(path, sample(p, rng))
        path.append(accepted)
        current = accepted
