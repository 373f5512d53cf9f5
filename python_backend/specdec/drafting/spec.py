"""Drafter names, parsed once: what requests and profiles say (`drafter: eagle+ngram`) as a typed spec.

A drafter is a model drafter (the standalone draft model, `model`, or the EAGLE head, `eagle`), prompt lookup
alone (`ngram`), or prompt lookup in front of a model drafter (`model+ngram`, `eagle+ngram`: the model drafts only
where the context's suffix has no earlier match). `DRAFTER_MODELS` is the one map from a model drafter to the
Triton model that serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

ModelDrafterName = Literal["model", "eagle"]
MODEL_DRAFTERS: tuple[ModelDrafterName, ...] = ("model", "eagle")
DRAFTER_MODELS: dict[ModelDrafterName, str] = {"model": "draft_model", "eagle": "eagle_draft"}
LOOKUP = "ngram"
LOOKUP_SUFFIX = "+" + LOOKUP


@dataclass(frozen=True)
class DrafterSpec:
    """`model`: the model drafter (None: prompt lookup alone); `lookup`: prompt lookup proposes first."""

    model: ModelDrafterName | None
    lookup: bool

    def __post_init__(self) -> None:
        if self.model is None and not self.lookup:
            raise ValueError("a drafter needs a model drafter, prompt lookup, or both")

    @classmethod
    def parse(cls, name: str) -> DrafterSpec:
        """The spec of a drafter name; ValueError for a name that is none of DRAFTERS."""
        if name == LOOKUP:
            return cls(None, True)
        model = name.removesuffix(LOOKUP_SUFFIX)
        if model not in MODEL_DRAFTERS:
            raise ValueError(f"{name!r} is not a drafter (one of {', '.join(DRAFTERS)})")
        return cls(model, name != model)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        if self.model is None:
            return LOOKUP
        return self.model + (LOOKUP_SUFFIX if self.lookup else "")

    @property
    def triton_model(self) -> str | None:
        """The Triton model the model drafter runs in (None: prompt lookup alone, no model)."""
        return DRAFTER_MODELS[self.model] if self.model is not None else None

    def with_model(self, model: ModelDrafterName) -> DrafterSpec:
        """This drafter with its model drafter replaced by `model`, prompt lookup kept (lookup alone: itself)."""
        return replace(self, model=model) if self.model is not None else self


DRAFTERS: tuple[str, ...] = ("model", "eagle", LOOKUP, "model" + LOOKUP_SUFFIX, "eagle" + LOOKUP_SUFFIX)
