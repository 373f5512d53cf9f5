"""The check behind the rejection-sampling tests of real pairs: the first token of a verification that
proposed from q is distributed as the target's p (chi-square over p's likely tokens plus the rest)."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare
from specdec.rejection_sampler import rejection_verify
from specdec.sampling import sample


def first_token_law_pvalue(p: np.ndarray, q: np.ndarray, draws: int, seed: int = 5) -> float:
    """Propose one token from q `draws` times, verify it against p; the chi-square p-value of the outcomes
    against p (tokens with p > 0.01 each, the others pooled). Needs at least 3 such tokens."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(p))
    for _ in range(draws):
        token = sample(q, rng)
        verdict = rejection_verify([token], [-1], np.stack([p, p]), q[None], rng)
        counts[token if verdict.path else verdict.next_token] += 1
    big = p > 0.01
    assert big.sum() >= 3, "too peaked a target distribution for a chi-square test"
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(p[big], p[~big].sum()) * draws
    return float(chisquare(observed, expected).pvalue)
