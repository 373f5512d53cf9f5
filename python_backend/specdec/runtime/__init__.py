"""Runtime selection: one name per runtime, all behind specdec.runtime.base.DecoderRuntime."""

from __future__ import annotations

from pathlib import Path

from specdec.runtime.base import DecoderRuntime

RUNTIMES = ("torch", "onnxruntime", "tensorrt")


def build_runtime(kind: str, model_dir: str | Path, num_slots: int, max_length: int, device: str = "cpu",
                  num_threads: int | None = None, engine_dir: str | Path | None = None,
                  num_blocks: int | None = None, block_size: int | None = None,
                  weight_quantization: str | None = None) -> DecoderRuntime:
    """`engine_dir`: the runtime's compiled artefact (onnxruntime: where the ONNX export is kept, default
    beside the checkpoint; tensorrt: the folder build/build_engines.py wrote the plan to; required).
    `num_blocks` x `block_size` rows: the KV pool (specdec.kv_memory; None: every slot at full length).
    `weight_quantization` (onnxruntime only, drafters only: `check_weight_quantization`): e.g. "int8"."""
    pool = {"num_blocks": num_blocks, "block_size": block_size}
    if weight_quantization and kind != "onnxruntime":
        raise ValueError(f"weight_quantization is an onnxruntime option; the {kind} runtime serves the "
                         "checkpoint's own precision")
    if kind == "torch":
        from specdec.runtime.torch_llama import TorchLlamaRuntime

        return TorchLlamaRuntime(model_dir, num_slots=num_slots, max_length=max_length, device=device,
                                 num_threads=num_threads, **pool)
    if kind == "onnxruntime":
        if device != "cpu":
            raise ValueError(f"the onnxruntime runtime runs on the CPU, not {device!r} (use tensorrt on GPUs)")
        from specdec.runtime.onnx_llama import OnnxLlamaRuntime

        return OnnxLlamaRuntime(model_dir, num_slots=num_slots, max_length=max_length, num_threads=num_threads,
                                engine_dir=engine_dir, weight_quantization=weight_quantization, **pool)
    if kind == "tensorrt":
        if engine_dir is None:
            raise ValueError("the tensorrt runtime needs engine_dir: the folder build/build_engines.py wrote")
        from specdec.runtime.tensorrt_llama import TensorRTLlamaRuntime

        return TensorRTLlamaRuntime(model_dir, engine_dir, num_slots=num_slots, max_length=max_length,
                                    device=device, **pool)
    raise ValueError(f"unknown runtime {kind!r}; choose one of {', '.join(RUNTIMES)}")


def check_weight_quantization(role: str, runtime: str, weight_quantization: str | None) -> None:
    """Refuse a quantization a decoder cannot have: only a drafter's (role draft or eagle) weights may be
    quantized, whose proposals the full-precision target checks; the target's logits are the output, and
    greedy speculation must equal plain decoding and Hugging Face's. The onnxruntime runtime only."""
    if not weight_quantization:
        return
    if role == "target":
        raise ValueError("weight_quantization applies to drafters only: the target's weights define the output")
    if runtime != "onnxruntime":
        raise ValueError(f"weight_quantization is an onnxruntime option, not {runtime}'s")
    from specdec.runtime.onnx_llama import require_known

    require_known(weight_quantization)
