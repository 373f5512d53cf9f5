"""specdec.drafting.spec: drafter names parsed once into (model drafter, prompt lookup), and the one map from a
model drafter to its Triton model."""

from __future__ import annotations

import pytest
from specdec.config import drafters_served
from specdec.drafting.spec import DRAFTER_MODELS, DRAFTERS, DrafterSpec


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
