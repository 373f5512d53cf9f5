"""Triton-facing helpers shared by the model.py adapters (the core library `specdec` knows nothing of Triton)."""
