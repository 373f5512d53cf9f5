"""specdec.config: the dataclasses' defaults are the shipped profile's values, and a profiles file that leaves a
key out gets them (one source of defaults)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specdec.config import DynamicTree, FallbackConfig, SpeculationConfig, TaskProfile
from specdec.drafting.ngram import PromptLookup

SHIPPED = Path(__file__).resolve().parents[2] / "model_repository" / "speculative_decoding" / "1" / "profiles.yaml"


def test_the_shipped_profiles_file_states_the_defaults():
    assert SpeculationConfig.load(SHIPPED) == SpeculationConfig() == SpeculationConfig.from_dict({})


def test_the_defaults_are_the_shipped_deployment():
    config = SpeculationConfig()
    tree = DynamicTree(8, depth=5, width=2, min_probability=0.1, max_sequences=2)
    assert config.profiles == {"json": TaskProfile(4, 4, 1, "eagle+ngram", "greedy", None),
                               "code": TaskProfile(3, 3, 1, "eagle+ngram", "greedy", tree),
                               "text": TaskProfile(1, 1, 1, "eagle+ngram", "greedy", tree)}
    assert config.fallback == FallbackConfig(min_acceptance_rate=0.20, window_s=300, min_draft_tokens=256,
                                             probe_interval_s=30)
    assert config.prompt_lookup == PromptLookup(length=12, min_ngram=2, max_ngram=3, adaptive=True)
    assert (config.max_sequences, config.speculate_sampled, config.grammar_drafting, config.constrained_drafter,
            config.verify_threshold) == (2, False, True, "ngram", 0.7)


def test_a_file_that_sets_some_keys_keeps_the_other_defaults():
    config = SpeculationConfig.from_dict({"speculative_decoding": {
        "base_length": {"json": [2, 6]}, "drafter": {"text": "model"}, "fallback": {"window_s": 50}}})
    default = SpeculationConfig()
    assert config.profiles["json"] == replace(default.profiles["json"], min_length=2, max_length=6)
    assert config.profiles["text"] == replace(default.profiles["text"], drafter="model")
    assert config.profiles["code"] == default.profiles["code"]
    # a short window probes a tenth as often as it lasts, at most every 30 s
    assert config.fallback == replace(default.fallback, window_s=50, probe_interval_s=5)
    assert replace(config, profiles=default.profiles, fallback=default.fallback) == default
    assert SpeculationConfig.from_dict({"dynamic_tree": None}).profiles["code"].tree is None  # trees off
