"""specdec.drafting.spec: drafter names parsed once into (model drafter, prompt lookup), and the one map from a
model drafter to its Triton model."""

from __future__ import annotations

import asyncio

import pytest
from specdec.config import drafters_served
from specdec.drafting.models import MODEL_DRAFTER_CLASSES, build_model_drafter
from specdec.drafting.spec import DRAFTER_MODELS, DRAFTERS, MODEL_DRAFTERS, DrafterSpec
from specdec.sampling import SamplingParams


@pytest.mark.parametrize("name, model, lookup, triton_model", [
    ("model", "model", False, "draft_model"),
    ("eagle", "eagle", False, "eagle_draft"),
    ("ngram", None, True, None),
    ("model+ngram", "model", True, "draft_model"),
    ("eagle+ngram", "eagle", True, "eagle_draft"),
])
def test_every_drafter_name_parses_and_names_itself_back(name, model, lookup, triton_model):
    spec = DrafterSpec.parse(name)
    assert (spec.model, spec.lookup, spec.triton_model, spec.name) == (model, lookup, triton_model, name)


def test_unknown_names_and_an_empty_spec_are_refused():
    for name in ("", "draft", "ngram+eagle", "eagle+", "EAGLE"):
        with pytest.raises(ValueError, match="not a drafter"):
            DrafterSpec.parse(name)
    with pytest.raises(ValueError):
        DrafterSpec(None, False)


def test_swapping_the_model_drafter_keeps_prompt_lookup():
    assert DrafterSpec.parse("eagle+ngram").with_model("model").name == "model+ngram"
    assert DrafterSpec.parse("eagle").with_model("model").name == "model"
    assert DrafterSpec.parse("ngram").with_model("eagle").name == "ngram"  # lookup alone has no model to swap


def test_a_deployment_serves_the_drafters_of_the_models_it_loads():
    assert set(DRAFTER_MODELS.values()) == {"draft_model", "eagle_draft"}
    assert drafters_served(eagle_head=True) == DRAFTERS
    assert drafters_served(eagle_head=False) == ("model", "ngram", "model+ngram")
    assert drafters_served(eagle_head=True, draft_model=False) == ("eagle", "ngram", "eagle+ngram")
    assert drafters_served(eagle_head=False, draft_model=False) == ("ngram",)


def test_every_model_drafter_is_built_by_name_behind_one_interface():
    assert set(MODEL_DRAFTER_CLASSES) == set(MODEL_DRAFTERS) == set(DRAFTER_MODELS)
    for name in MODEL_DRAFTERS:
        drafter = build_model_drafter(name, backend=None, sequence_id=7)
        assert drafter.name == name and drafter.sequence_id == 7 and not drafter.started
        for method in ("propose", "prefill", "add_features", "verified", "release"):
            assert callable(getattr(drafter, method))
    # What the loop asks instead of which drafter runs: the head reads the target's features and drafts trees.
    assert MODEL_DRAFTER_CLASSES["eagle"].reads_target_features and MODEL_DRAFTER_CLASSES["eagle"].drafts_trees
    assert not MODEL_DRAFTER_CLASSES["model"].reads_target_features
    assert not MODEL_DRAFTER_CLASSES["model"].drafts_trees


def test_the_draft_model_refuses_a_dynamic_tree():
    drafter = build_model_drafter("model", backend=None, sequence_id=1)
    with pytest.raises(ValueError, match="dynamic trees"):
        asyncio.run(drafter.propose([1, 2, 3], 2, 1, SamplingParams(), want_probs=False, tree_nodes=4))
