"""Triton entry point; the adapter lives in specdec_triton.decoder (shared by target_model and draft_model)."""

from specdec_triton.decoder import DecoderModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
