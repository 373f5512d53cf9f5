"""Profiles, task detection, n-gram lookup, adaptive length and automatic fallback."""

from __future__ import annotations

import pytest
from specdec.adaptive import AcceptanceEstimate, CostModel, choose_length, expected_tokens
from specdec.config import FallbackConfig, SpeculationConfig, detect_task, resolve
from specdec.drafting.ngram import lookup
from specdec.errors import InvalidRequestError
from specdec.fallback import FallbackMonitor

PROFILES = """
speculative_decoding:
  base_length: {json: 8, code: 6, text: [4, 12]}
  candidate_num: {default: 3}
  verify_threshold: 0.7
  fallback: {min_acceptance_rate: 0.40, window_s: 300}
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "profiles.yaml"
    path.write_text(PROFILES)
    return SpeculationConfig.load(path)


def resolve_default(config, task, prompt="", **overrides):
    args = {"num_draft_tokens": None, "num_candidates": None, "acceptance": None, "verify_threshold": None,
            "drafter": None, "sampling": False}
    args.update(overrides)
    return resolve(config, task, prompt, **args)


def test_profiles_follow_the_yaml(config):
    assert (config.profiles["json"].min_length, config.profiles["json"].max_length) == (8, 8)
    assert (config.profiles["code"].min_length, config.profiles["code"].max_length) == (6, 6)
    text = config.profiles["text"]
    assert text.adaptive and (text.min_length, text.max_length) == (4, 12)
    assert config.profiles["json"].num_candidates == 3
    assert config.verify_threshold == 0.7
    assert config.fallback.min_acceptance_rate == 0.40 and config.fallback.window_s == 300


def test_request_overrides_win_over_the_profile(config):
    s = resolve_default(config, "json", num_draft_tokens=3, num_candidates=5, acceptance="typical",
                        verify_threshold=0.9)
    assert (s.min_length, s.max_length, s.num_candidates, s.acceptance, s.verify_threshold) == (3, 3, 5, "typical", 0.9)
    assert resolve_default(config, "text", num_draft_tokens=0).enabled is False
    assert resolve_default(config, "code", sampling=True).acceptance == "rejection"
    with pytest.raises(InvalidRequestError, match="acceptance"):
        resolve_default(config, "code", sampling=True, acceptance="greedy")
    with pytest.raises(InvalidRequestError, match="verify_threshold"):
        resolve_default(config, "code", verify_threshold=1.5)
    assert resolve_default(config, "code", drafter="ngram").num_candidates == 1


def test_a_profiles_file_with_an_unknown_or_removed_key_is_refused_by_name():
    with pytest.raises(ValueError, match=r"draft_confidence \(removed: stopping a chain"):
        SpeculationConfig.from_dict({"speculative_decoding": {"draft_confidence": {"json": 0.5}}})
    with pytest.raises(ValueError, match="unknown speculation profile keys: base_lenght; known: acceptance"):
        SpeculationConfig.from_dict({"base_lenght": 3})


@pytest.mark.parametrize(("prompt", "task"), [
    ('{"id": 3, "name": "', "json"), ('[1, 2, 3', "json"), ('name": "Bob", "age": ', "json"),
    ("def main():\n", "code"), ("import os\nimport sys", "code"), ("for (int i = 0; i < n; i++) {", "code"),
    ("In the beginning God created", "text"), ("The quick brown fox", "text"),
    # chat requests name their task in words (the system prompt of a chat template names none)
    ("<|im_start|>user\nGive me a JSON object describing a car.<|im_end|>", "json"),
    ("<|im_start|>user\nWrite a Python function that sorts a list.<|im_end|>", "code"),
    ("<|im_start|>user\nWrite a short paragraph about the sea.<|im_end|>", "text"),
])
def test_auto_task_detection(config, prompt, task):
    assert detect_task(prompt) == task
    assert resolve_default(config, "auto", prompt).task == task


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup(tokens, 2) == [7, 8]  # the latest earlier "1 2 3" was followed by 7 8
    assert lookup([5, 6, 7], 3) == []
    assert lookup([4, 4, 4, 4], 5) == [4]


def test_adaptive_length_rises_on_easy_text_and_falls_on_hard_text():
    costs = CostModel()
    for _ in range(5):  # measured: target pass = 10 ms + 0.5 ms per scored token, draft = 1 ms + 1.2 ms per token
        for n in (1, 5, 9, 13):
            costs.target.observe(n, 0.010 + 0.0005 * n)
        for k in (2, 4, 8):
            costs.draft.observe(k, 0.001 + 0.0012 * k)
    easy, hard = AcceptanceEstimate(), AcceptanceEstimate()
    for _ in range(20):
        easy.observe(accepted=8, proposed_depth=8)
        hard.observe(accepted=0, proposed_depth=8)
    k_easy = choose_length(easy.rate, 4, 12, 1, costs)
    k_hard = choose_length(hard.rate, 4, 12, 1, costs)
    assert easy.rate > 0.9 and hard.rate < 0.1
    assert k_easy > k_hard and k_easy >= 10 and k_hard == 4
    assert expected_tokens(0.0, 5) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fallback_triggers_after_the_window_and_recovers_through_probes():
    clock = FakeClock()
    monitor = FallbackMonitor("json", FallbackConfig(0.40, window_s=5, min_draft_tokens=16, probe_interval_s=1),
                              clock)
    for _ in range(8):  # low acceptance, but the window has not been observed for 5 s yet
        monitor.record(8, 1)
        clock.now += 0.5
    assert not monitor.active
    for _ in range(4):
        monitor.record(8, 1)
        clock.now += 0.5
    assert monitor.active  # 0.125 < 0.40 for the whole 5 s window
    grants = 0
    for _ in range(20):  # fallen back: only probe iterations may speculate
        grants += monitor.allow_speculation()
    assert 0 < grants <= 8
    clock.now += 1.0
    assert monitor.allow_speculation()  # a new probe after probe_interval_s
    for _ in range(3):  # probes see good acceptance again
        monitor.record(8, 7)
    assert not monitor.active and monitor.transitions == 2
    assert all(monitor.allow_speculation() for _ in range(10))
