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
    # vLLM's min_p: after the temperature, tokens less probable than min_p x the most probable one's are dropped
    # (0 = off). Applied where speculative_decoding chooses from the target's rows (`probabilities`); the target's
    # own draw (`sample_rows`) and a drafter's proposals are never asked for it.
    min_p: float = 0.0

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
    if params.min_p > 0:  # p < min_p * max p  <=>  scaled < max + log(min_p)
        floor = scaled.max(axis=-1, keepdims=True) + np.log(params.min_p)
        scaled = np.where(scaled < floor, -np.inf, scaled)
    if 0 < params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[:, -params.top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        probs = np.stack([_nucleus(row, params.top_p) for row in probs])
    return probs


NUCLEUS_CANDIDATES = 1024  # top_p first looks among this many most probable tokens (a full sort only if needed)


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """`probs` (one row) restricted to its nucleus: the most probable tokens, in order of probability then id,
    up to and including the one whose cumulative mass reaches `top_p`; renormalized. Sorting a whole 49,152-token
    row took ~3 ms, a tenth of a target step: the nucleus is looked for among the NUCLEUS_CANDIDATES most probable
    tokens first (the same set: the order is that of a stable sort of the whole row), sorting the whole row only
    when their mass falls short or a tie at the boundary could reach outside them."""
    count = min(NUCLEUS_CANDIDATES, probs.shape[-1])
    candidates = np.sort(np.argpartition(-probs, count - 1)[:count]) if count < probs.shape[-1] else np.arange(count)
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    sorted_probs = probs[order]
    reached = np.nonzero(np.cumsum(sorted_probs) - sorted_probs >= top_p)[0]
    if not len(reached) or (count < probs.shape[-1] and sorted_probs[reached[0] - 1] == sorted_probs[-1]):
        order = np.argsort(-probs, kind="stable")  # the whole row
        sorted_probs = probs[order]
        reached = np.nonzero(np.cumsum(sorted_probs) - sorted_probs >= top_p)[0]
    kept = order[: reached[0]] if len(reached) else order
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


def make_rng(seed: int | None, *stream: int) -> np.random.Generator:
    """A generator for (seed, stream...), e.g. (request seed, iteration): reproducible, independent streams."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, *stream])


def step_seed(seed: int | None, step: int) -> int | None:
    """The seed of a multi-step call's draw `step` (0 first): the call's seed itself, then seeds derived from it,
    so a call of k steps draws what the same k calls of one step with these seeds would."""
    if seed is None or step == 0:
        return seed
    return (seed * 1_000_003 + step) & 0x7FFFFFFFFFFFFFFF


def sample_rows(logits: np.ndarray, params: list[SamplingParams]) -> np.ndarray:
    """One draw per row of `logits` [rows, vocab] from its row's temperature / top-k / top-p, in float32, with
    `make_rng(params.seed)` per row: the softmax and the nucleus candidates of every row in a few array
    operations, and each row's draw the same whatever else is in the batch (every reduction runs along its own
    row). The law is `probabilities`' to float32 rounding. A plain step's token is drawn here, beside the
    logits, instead of shipping a 49,152-float row per sequence to be sampled one at a time."""
    scaled = np.asarray(logits, np.float32) / np.asarray([[p.temperature] for p in params], np.float32)
    for top_k in {p.top_k for p in params if 0 < p.top_k < scaled.shape[-1]}:
        rows = np.asarray([i for i, p in enumerate(params) if p.top_k == top_k])
        kth = np.partition(scaled[rows], -top_k, axis=-1)[:, -top_k][:, None]
        scaled[rows] = np.where(scaled[rows] < kth, -np.inf, scaled[rows])
    scaled -= scaled.max(axis=-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(axis=-1, keepdims=True)
    vocab = probs.shape[-1]
    count = min(NUCLEUS_CANDIDATES, vocab)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:  # the top `count` of those rows in order of probability then id (as a stable sort of the row)
        top = np.sort(np.argpartition(-probs[nucleus], count - 1, axis=-1)[:, :count], axis=-1)
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(probs[nucleus], top, -1), axis=-1,
                                                 kind="stable"), -1)
        candidates = dict(zip(nucleus, top, strict=True))
    draws = np.empty(len(params), np.int64)
    for i, p in enumerate(params):
        order = None  # token ids of the kept probabilities (None: the whole row in id order)
        kept = probs[i]
        if p.top_p < 1.0:
            order = candidates[i]
            ranked = probs[i][order]
            reached = np.nonzero(np.cumsum(ranked) - ranked >= np.float32(p.top_p))[0]
            if count < vocab and (not len(reached) or ranked[reached[0] - 1] == ranked[-1]):
                order = np.argsort(-probs[i], kind="stable")  # the nucleus may reach past the candidates
                ranked = probs[i][order]
                reached = np.nonzero(np.cumsum(ranked) - ranked >= np.float32(p.top_p))[0]
            end = int(reached[0]) if len(reached) else len(ranked)
            order, kept = order[:end], ranked[:end]
        cdf = np.cumsum(kept)
        at = min(int(np.searchsorted(cdf, make_rng(p.seed).random() * cdf[-1], side="right")), len(kept) - 1)
        draws[i] = at if order is None else order[at]
    return draws
