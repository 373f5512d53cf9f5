"""build/measure_proposals.py: the parts that are arithmetic (settings, cost fit, stopping policies)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))

import measure_proposals  # noqa: E402
from specdec.config import SpeculationConfig  # noqa: E402


def test_settings_take_the_profile_length_or_a_given_one() -> None:
    profiles = SpeculationConfig.load(measure_proposals.PROFILES).profiles
    json_settings = measure_proposals.settings_of("eagle+ngram:profile:6:3", "json")
    assert json_settings.min_length == json_settings.max_length == profiles["json"].min_length
    assert (json_settings.prompt_lookup.length, json_settings.prompt_lookup.min_ngram) == (6, 3)
    fixed = measure_proposals.settings_of("eagle:4")
    assert fixed.drafter == "eagle" and fixed.min_length == 4 and fixed.explicit_length
    assert fixed.tree is None
    tree = measure_proposals.settings_of("eagle+ngram@6x2:4:12:2:0.1").tree
    assert (tree.nodes, tree.depth, tree.width, tree.min_probability) == (6, 4, 2, 0.1)
    with pytest.raises(SystemExit, match="not a chain"):  # a confidence floors a tree's nodes only
        measure_proposals.settings_of("eagle+ngram:4:12:2:0.5")


def test_fit_recovers_a_line() -> None:
    fixed, per_unit = measure_proposals.fit([(1, 0.05), (3, 0.06), (5, 0.07), (9, 0.09)])
    assert fixed == pytest.approx(0.045) and per_unit == pytest.approx(0.005)


def test_stopping_policies_keep_tokens_while_the_head_is_confident() -> None:
    iterations = [([0.9, 0.8, 0.2, 0.9], 4), ([0.1, 0.95, 0.95, 0.95], 0), ([0.6, 0.4, 0.9, 0.9], 1)]
    out = measure_proposals.stopping_policies(iterations, 4, t_fixed=0.05, t_row=0.0, head_token=0.0)
    # k=1 keeps one token each: accepted 1, 0, 1.
    assert out["k=1"]["accepted_per_iteration"] == pytest.approx(2 / 3, abs=1e-3)
    # p>=0.5 keeps [0.9, 0.8] (stops at 0.2), all four of the second (the first is always kept), and [0.6].
    assert out["p>=0.5"]["drafted_per_iteration"] == pytest.approx((2 + 4 + 1) / 3, abs=1e-3)
    assert out["p>=0.5"]["accepted_per_iteration"] == pytest.approx((2 + 0 + 1) / 3, abs=1e-3)
    assert out["k=4"]["accepted_per_iteration"] == pytest.approx(5 / 3, abs=1e-3)
    # With free drafting and verification, more accepted tokens is simply faster.
    assert out["k=4"]["estimated_speedup"] == pytest.approx(1 + 5 / 3, abs=1e-3)


def test_a_floor_pays_for_the_forward_that_scored_the_token_it_dropped() -> None:
    iterations = [([0.9, 0.8, 0.2, 0.9], 4), ([0.1, 0.95, 0.95, 0.95], 0), ([0.6, 0.4, 0.9, 0.9], 1)]
    out = measure_proposals.stopping_policies(iterations, 4, t_fixed=0.05, t_row=0.0, head_token=0.01)
    # p>=0.5 keeps 2 + 4 + 1 tokens; the first and third chains stopped early: 3 forwards per iteration.
    assert out["p>=0.5"]["estimated_speedup"] == pytest.approx((1 + 1.0) * 0.05 / (0.05 + 0.01 * 3), abs=1e-3)
    # k=2 accepts min(accepted, 2) = 2, 0, 1 for two forwards each.
    assert out["k=2"]["estimated_speedup"] == pytest.approx((1 + 1.0) * 0.05 / (0.05 + 0.01 * 2), abs=1e-3)


def test_an_unknown_domain_is_refused_before_any_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        measure_proposals.main(["--domains", "json,jsn", "eagle+ngram:profile", "--repository", "/nonexistent"])
    assert exit_info.value.code == 2
    assert "no scenario jsn" in capsys.readouterr().err
