"""Runtime selection: one name per runtime, all behind specdec.runtime.base.DecoderRuntime."""

from __future__ import annotations

from pathlib import Path

from specdec.runtime.base import DecoderRuntime

RUNTIMES = ("torch", "onnxruntime", "tensorrt")


def build_runtime(kind: str, model_dir: str | Path, num_slots: int, max_length: int, device: str = "cpu",
                  num_threads: int | None = None, engine_dir: str | Path | None = None,
                  num_blocks: int | None = None, block_size: int | None = None) -> DecoderRuntime:
    """`engine_dir`: the runtime's compiled artefact (onnxruntime: where the ONNX export is kept, default
    beside the checkpoint; tensorrt: the folder build/build_engines.py wrote the plan to; required).
    `num_blocks` x `block_size` rows: the KV pool (specdec.kv_memory; None: every slot at full length)."""
    pool = {"num_blocks": num_blocks, "block_size": block_size}
    if kind == "torch":
        from specdec.runtime.torch_llama import TorchLlamaRuntime

        return TorchLlamaRuntime(model_dir, num_slots=num_slots, max_length=max_length, device=device,
                                 num_threads=num_threads, **pool)
    if kind == "onnxruntime":
        if device != "cpu":
            raise ValueError(f"the onnxruntime runtime runs on the CPU, not {device!r} (use tensorrt on GPUs)")
        from specdec.runtime.onnx_llama import OnnxLlamaRuntime

        return OnnxLlamaRuntime(model_dir, num_slots=num_slots, max_length=max_length, num_threads=num_threads,
                                engine_dir=engine_dir, **pool)
    if kind == "tensorrt":
        if engine_dir is None:
            raise ValueError("the tensorrt runtime needs engine_dir: the folder build/build_engines.py wrote")
        from specdec.runtime.tensorrt_llama import TensorRTLlamaRuntime

        return TensorRTLlamaRuntime(model_dir, engine_dir, num_slots=num_slots, max_length=max_length,
                                    device=device, **pool)
    raise ValueError(f"unknown runtime {kind!r}; choose one of {', '.join(RUNTIMES)}")
