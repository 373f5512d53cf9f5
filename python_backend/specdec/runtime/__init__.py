"""Runtime selection: one name per runtime, all behind specdec.runtime.base.DecoderRuntime."""

from __future__ import annotations

from pathlib import Path

from specdec.runtime.base import DecoderRuntime

RUNTIMES = ("torch",)


def build_runtime(kind: str, model_dir: str | Path, num_slots: int, max_length: int, device: str = "cpu",
                  num_threads: int | None = None) -> DecoderRuntime:
    if kind == "torch":
        from specdec.runtime.torch_llama import TorchLlamaRuntime

        return TorchLlamaRuntime(model_dir, num_slots=num_slots, max_length=max_length, device=device,
                                 num_threads=num_threads)
    raise ValueError(f"unknown runtime {kind!r}; choose one of {', '.join(RUNTIMES)}")
