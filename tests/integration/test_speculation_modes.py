"""Speculation modes through the real server: trees, n-gram drafting, sampling with seeds, typical, profiles."""

from __future__ import annotations

import pytest
from specdec_client.api import GenerationError, generate_grpc

pytestmark = pytest.mark.integration
MAX_TOKENS = 32


def text(server, prompt: str, **params) -> str:
    return generate_grpc(server.grpc_url, {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                           "exclude_input_in_output": True, **params})


@pytest.mark.parametrize("candidates", [2, 3, 5])
def test_greedy_trees_are_lossless(server, all_prompts, candidates):
    drafted = 0
    for _, prompt in all_prompts[::3]:
        plain = text(server, prompt, num_draft_tokens=0)
        tree = text(server, prompt, num_draft_tokens=4, num_candidates=candidates)
        assert tree.text == plain.text, prompt
        assert tree.stats["total_draft_tokens"] > 0 or tree.num_output_tokens < 2
        drafted += tree.stats["total_draft_tokens"]
    assert drafted > 0


def test_ngram_drafting_is_lossless(server, all_prompts):
    for _, prompt in all_prompts[::4]:
        plain = text(server, prompt, num_draft_tokens=0)
        assert text(server, prompt, num_draft_tokens=4, drafter="ngram").text == plain.text


def test_profiles_and_auto_task_give_the_lossless_default(server, all_prompts):
    for _, prompt in all_prompts[::4]:
        plain = text(server, prompt, num_draft_tokens=0)
        for task in ("auto", "json", "code", "text"):
            assert text(server, prompt, task=task).text == plain.text, (task, prompt)


def test_sampling_with_a_seed_repeats_and_rejection_is_the_default(server):
    prompt = "The quick brown fox"
    params = {"temperature": 0.9, "top_k": 40, "seed": 7, "num_draft_tokens": 4}
    first, second = text(server, prompt, **params), text(server, prompt, **params)
    assert first.text == second.text and first.num_output_tokens > 0
    assert text(server, prompt, **{**params, "seed": 8}).text != first.text
    plain_sampled = text(server, prompt, **{**params, "num_draft_tokens": 0})
    assert plain_sampled.num_output_tokens > 0
    with pytest.raises(GenerationError, match="acceptance"):
        text(server, prompt, **params, acceptance="greedy")


def test_typical_acceptance_runs_and_reports_statistics(server, all_prompts):
    result = text(server, all_prompts[0][1], acceptance="typical", verify_threshold=0.7, num_draft_tokens=6)
    assert result.num_output_tokens > 0
    assert result.stats["total_accepted_draft_tokens"] <= result.stats["total_draft_tokens"]
    assert result.stats["fallback_active"] == 0.0
    with pytest.raises(GenerationError, match="verify_threshold"):
        text(server, "x", acceptance="typical", verify_threshold=1.5)
