"""Turning logits into the distribution a request samples from, identically for draft and target.

Rejection sampling is lossless only when the draft's q and the target's p are processed by the same
temperature / top-k / top-p rules, so both sides call `probabilities` here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Row-wise sampling distribution (float64) after temperature, top-k and top-p; greedy = one-hot."""
    logits = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    if params.greedy:
        probs = np.zeros_like(logits)
        probs[np.arange(len(logits)), logits.argmax(axis=-1)] = 1.0
        return probs
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # Keep the smallest set whose mass reaches top_p (the token crossing the line is kept).
        drop_sorted = np.cumsum(sorted_probs, axis=-1) - sorted_probs >= params.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def make_rng(seed: int | None, *stream: int) -> np.random.Generator:
    """A generator for (seed, stream...), e.g. (request seed, iteration): reproducible, independent streams."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, *stream])
