"""The model drafters by name (`model`, `eagle`: specdec.drafting.spec), so the generation loop builds a
sequence's drafter from its spec without knowing which one runs."""

from __future__ import annotations

from typing import Any

from specdec.drafting.base import ModelDrafter
from specdec.drafting.draft_model import DraftModelDrafter
from specdec.drafting.eagle import EagleDrafter
from specdec.drafting.spec import ModelDrafterName

MODEL_DRAFTER_CLASSES: dict[str, type[DraftModelDrafter] | type[EagleDrafter]] = {
    cls.name: cls for cls in (DraftModelDrafter, EagleDrafter)
}


def build_model_drafter(name: ModelDrafterName, backend: Any, sequence_id: int) -> ModelDrafter:
    """The per-sequence state of model drafter `name`, calling its model through `backend`."""
    return MODEL_DRAFTER_CLASSES[name](backend, sequence_id)
