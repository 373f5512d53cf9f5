"""`serve --leave-out`: a repository of links without the drafter models a deployment does not use."""

from __future__ import annotations

from pathlib import Path

import pytest
from specdec_client.server import drafter_models_unused, repository_without

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_lean_repository_links_every_model_but_the_left_out_drafter(tmp_path: Path):
    lean = repository_without(REPO_ROOT / "model_repository", ["draft_model"], tmp_path / "repo")
    names = sorted(p.name for p in lean.iterdir())
    assert names == ["eagle_draft", "ensemble", "postprocessing", "preprocessing", "speculative_decoding",
                     "target_model"]
    assert (lean / "target_model").resolve() == (REPO_ROOT / "model_repository" / "target_model").resolve()
    assert (lean / "eagle_draft" / "config.pbtxt").is_file()  # the links reach the models' files


@pytest.mark.parametrize("name", ["target_model", "speculative_decoding", "ensemble"])
def test_only_a_drafter_model_can_be_left_out(tmp_path: Path, name: str):
    with pytest.raises(ValueError, match="only drafter models"):
        repository_without(REPO_ROOT / "model_repository", [name], tmp_path / "repo")


def _repository(root: Path, drafters: str, models: tuple[str, ...]) -> Path:
    stage = root / "speculative_decoding" / "1"
    stage.mkdir(parents=True)
    (stage / "profiles.yaml").write_text(f"speculative_decoding:\n  drafter: {drafters}\n")
    for model in models:
        (root / model / "1").mkdir(parents=True)
        (root / model / "1" / "config.json").write_text("{}")
    return root


def test_lean_leaves_out_the_drafter_models_no_profile_uses(tmp_path: Path):
    assert drafter_models_unused(REPO_ROOT / "model_repository") == ["draft_model"]  # the profiles use the head
    both = ("draft_model", "eagle_draft")
    assert drafter_models_unused(_repository(tmp_path / "a", "{json: model+ngram, code: eagle, text: ngram}",
                                             both)) == []
    assert drafter_models_unused(_repository(tmp_path / "b", "ngram", both)) == list(both)
    # An imported pair has no head: its profiles' eagle+ngram drafts with the draft model, which stays.
    assert drafter_models_unused(_repository(tmp_path / "c", "eagle+ngram", ("draft_model",))) == []
