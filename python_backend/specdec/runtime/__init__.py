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
    `weight_quantization` (onnxruntime only: `check_weight_quantization`): "int8" (drafters), "gguf"."""
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


AUTO, NO_QUANTIZATION = "auto", "none"  # weight_quantization: the checkpoint's own precision; the fp32 export


def check_weight_quantization(role: str, runtime: str, weight_quantization: str | None) -> None:
    """Refuse a quantization a decoder cannot have: a drafter's (role draft or eagle) weights may be quantized
    ("int8"), whose proposals the target checks; the target's logits are the output, so it is served at its
    checkpoint's own precision only ("gguf": the blocks of the GGUF file it was converted from; "auto" picks
    that where there is one). The onnxruntime runtime only."""
    if not weight_quantization or weight_quantization in (AUTO, NO_QUANTIZATION):
        return
    from specdec.runtime.onnx_llama import GGUF, require_known

    if role == "target" and weight_quantization != GGUF:
        raise ValueError(f"weight_quantization {weight_quantization!r} applies to drafters only: the target's "
                         f"weights define the output (it may be served from its own GGUF blocks: {GGUF!r})")
    if runtime != "onnxruntime":
        raise ValueError(f"weight_quantization is an onnxruntime option, not {runtime}'s")
    require_known(weight_quantization)


def choose_weights(role: str, runtime: str, weight_quantization: str | None,
                   model_dir: str | Path) -> tuple[str | None, str]:
    """The weight quantization a decoder is served with (None: its export as it is) and why, from the
    deployment's setting (absent: "auto") and the checkpoint."""
    from specdec.runtime.gguf_blocks import gguf_source
    from specdec.runtime.onnx_llama import GGUF

    check_weight_quantization(role, runtime, weight_quantization)
    setting = weight_quantization or AUTO
    if setting == NO_QUANTIZATION:
        return None, "weight_quantization none: the export as it is"
    source = gguf_source(model_dir) if runtime == "onnxruntime" else None
    if setting == AUTO:
        if source is None:
            return None, f"auto: the checkpoint's own weights ({runtime}), no GGUF file behind it"
        return GGUF, f"auto: the checkpoint was converted from {source[0]}, served from that file's blocks"
    if setting == GGUF and source is None:
        raise ValueError(f"weight_quantization {GGUF}: {model_dir} was not converted from a GGUF file that is still "
                         "there (build/gguf_convert.py records it in gguf_source.json)")
    return setting, f"weight_quantization {setting}, set by the deployment"


def build_served_runtime(kind: str, model_dir: str | Path, role: str, weight_quantization: str | None,
                         **options) -> tuple[DecoderRuntime, str | None, str]:
    """`build_runtime` with the weights `choose_weights` picks; (runtime, quantization, why). Where `auto` picked a
    GGUF file's blocks and that graph cannot be made or loaded (a file the block reader does not know, a damaged
    file), the decoder is served from its export as it is, and `why` says so: `auto` never costs a deployment."""
    quantization, why = choose_weights(role, kind, weight_quantization, model_dir)
    try:
        return build_runtime(kind, model_dir, weight_quantization=quantization, **options), quantization, why
    except Exception as exc:
        if (weight_quantization or AUTO) != AUTO or quantization is None:
            raise
        why = f"auto: the GGUF file's blocks failed ({type(exc).__name__}: {exc}), so the export as it is"
        return build_runtime(kind, model_dir, **options), None, why

