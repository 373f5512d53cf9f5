"""specdec.sampling: the nucleus (top_p) found among the most probable tokens equals the one a stable sort of the
whole row gives, bit for bit, including ties and rows whose nucleus is larger than the candidates; the batched
float32 draws of plain steps follow the same law, and a row's draw does not depend on its batch."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare
from specdec.sampling import NUCLEUS_CANDIDATES, SamplingParams, probabilities, sample_rows


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


def drawn_law(logits: np.ndarray, params: SamplingParams, draws: int) -> np.ndarray:
    """Frequencies of `sample_rows`' draws from one row, each draw with its own seed, in one batch."""
    batch = np.repeat(logits[None], draws, axis=0)
    tokens = sample_rows(batch, [SamplingParams(params.temperature, params.top_k, params.top_p, seed)
                                 for seed in range(draws)])
    return np.bincount(tokens, minlength=logits.shape[-1]) / draws


@pytest.mark.parametrize("params", [SamplingParams(0.7, 0, 0.95), SamplingParams(1.0, 0, 1.0),
                                    SamplingParams(1.3, 20, 0.8), SamplingParams(0.5, 0, 0.5)],
                         ids=["t0.7-p0.95", "t1", "t1.3-k20-p0.8", "t0.5-p0.5"])
def test_batched_draws_follow_probabilities(params):
    """sample_rows draws from the law `probabilities` computes (chi-square over the tokens it gives mass)."""
    rng = np.random.default_rng(7)
    logits = rng.normal(scale=2.0, size=400).astype(np.float32)
    expected = probabilities(logits, params)[0]
    observed = drawn_law(logits, params, 20_000)
    assert observed[expected == 0].sum() == 0  # nothing outside top-k / the nucleus
    likely = expected * 20_000 >= 5
    counts = np.append(observed[likely] * 20_000, observed[~likely].sum() * 20_000)
    wanted = np.append(expected[likely] * 20_000, expected[~likely].sum() * 20_000)
    keep = wanted > 0
    assert chisquare(counts[keep], wanted[keep] * counts.sum() / wanted[keep].sum()).pvalue > 1e-4


def test_a_rows_draw_does_not_depend_on_its_batch():
    """Each row's draw is the same alone and beside other rows with other settings (full-size rows, ties)."""
    rng = np.random.default_rng(11)
    logits = rng.normal(scale=3.0, size=(6, 49_152)).astype(np.float32)
    logits[2] = 0.0  # flat: the nucleus is larger than the candidates
    logits[4, :3000] = logits[4].max()  # a tie reaching past the candidates
    params = [SamplingParams(0.7, 0, 0.95, 1), SamplingParams(1.0, 0, 1.0, 2), SamplingParams(0.7, 0, 0.95, 3),
              SamplingParams(1.3, 50, 0.9, 4), SamplingParams(0.9, 0, 0.99, 5), SamplingParams(0.6, 0, 0.3, 6)]
    together = sample_rows(logits, params)
    alone = [int(sample_rows(logits[i:i + 1], [p])[0]) for i, p in enumerate(params)]
    assert together.tolist() == alone
    assert sample_rows(logits, params).tolist() == together.tolist()  # seeded: reproducible
    assert logits[4, together[4]] == logits[4].max()  # the nucleus of a 3,000-way tie stays inside it


def test_min_p_drops_tokens_less_probable_than_its_share_of_the_most_probable():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    probs = probabilities(logits, SamplingParams(1.0, min_p=0.4))[0]
    np.testing.assert_allclose(probs, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])  # 0.15 < 0.4 x 0.5
    hot = probabilities(logits, SamplingParams(2.0, min_p=0.4))[0]  # after the temperature: flatter, more kept
    assert (hot > 0).sum() == 3  # sqrt(0.15 / 0.5) = 0.55 >= 0.4, sqrt(0.05 / 0.5) = 0.32 < 0.4
    assert probabilities(logits, SamplingParams(0.0, min_p=0.9))[0].tolist() == [1.0, 0.0, 0.0, 0.0]  # greedy


def test_min_p_through_the_generator_with_speculation(make_inprocess_backend):
    """A sampled request with min_p, speculating with the draft model (rejection sampling): every token it emits
    is at least min_p as probable as its row's most probable one (read back from its log-probabilities, the
    processed row at temperature 1), and the answer is reproducible."""
    import asyncio
    from pathlib import Path

    from specdec.config import SpeculationSettings
    from specdec.generation import GenerationRequest, SpeculativeGenerator
    from specdec.tokenizer import TextTokenizer

    pair = Path(__file__).resolve().parents[1] / "fixtures" / "pair_12m"
    backend = make_inprocess_backend((pair / "target", pair / "draft"), max_length=160)
    tokenizer = TextTokenizer(pair / "target")
    settings = SpeculationSettings("text", "model", 3, 3, 1, "rejection", 0.7)

    def run(seed: int):
        async def collect():
            tokens, logprobs = [], []
            request = GenerationRequest(tokenizer.encode("The quick brown fox"), 40, tokenizer.end_ids,
                                        settings=settings, sampling=SamplingParams(1.0, seed=seed, min_p=0.2),
                                        logprobs=1)
            async for update in SpeculativeGenerator(backend, 160).generate(request, 1):
                tokens += update.token_ids
                logprobs += update.logprobs
            return tokens, logprobs

        return asyncio.run(collect())

    for seed in range(3):
        tokens, logprobs = run(seed)
        assert run(seed)[0] == tokens and len(tokens) > 3
        for entry in logprobs:
            assert entry.logprob >= entry.top[0][1] + np.log(0.2) - 1e-9


def test_min_p_is_parsed_from_the_ensembles_inputs():
    from specdec.errors import InvalidRequestError
    from specdec.params import parse_sampling

    sampled = {"top_p": np.array([[0.9]], np.float32), "temperature": np.array([[0.7]], np.float32)}
    assert parse_sampling({**sampled, "min_p": np.array([[0.1]], np.float32)}).min_p == pytest.approx(0.1)
    assert parse_sampling({"min_p": np.array([[0.1]], np.float32)}).greedy  # no top_k / top_p: greedy
    with pytest.raises(InvalidRequestError, match="min_p"):
        parse_sampling({**sampled, "min_p": np.array([[1.5]], np.float32)})
