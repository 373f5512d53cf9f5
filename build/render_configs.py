"""Render every config.pbtxt of the model repository from one deployment YAML.

Configs are built as Triton ModelConfig protobufs (tritonclient's model_config_pb2) and written in text
format, so whatever this writes is schema-valid by construction. Usage:

    python build/render_configs.py build/deployments/cpu.yaml [--out model_repository] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import text_format
from specdec.generation import DEFAULT_PREFILL_CHUNK
from specdec.kv_memory import DEFAULT_BLOCK_SIZE
from specdec.runtime import check_weight_quantization
from specdec.runtime.graph_contract import DEFAULT_PRECISION, PRECISIONS
from specdec_triton import contract as c
from tritonclient.grpc import model_config_pb2 as mc

REPO_ROOT = Path(__file__).resolve().parents[1]
# decoder model name -> role. The drafter models are optional: a repository without eagle_draft (made by
# build/import_checkpoint.py for other checkpoints) serves the other drafters, and one without draft_model
# (a deployment that drafts only with the EAGLE head, to save that process's memory) serves the head's.
DECODERS = {"target_model": "target", "draft_model": "draft", "eagle_draft": "eagle"}
OPTIONAL_DECODERS = ("draft_model", "eagle_draft")
DECODER_INPUTS = {"target": c.TARGET_INPUTS, "draft": c.DRAFT_INPUTS, "eagle": c.EAGLE_INPUTS}
RUNTIME_KINDS = {"torch": ("KIND_CPU", "KIND_GPU"), "onnxruntime": ("KIND_CPU",), "tensorrt": ("KIND_GPU",)}
HEADER = "# Rendered by build/render_configs.py from {source}; edit that file, not this one.\n"


def _tensor(msg_list: Any, spec: c.TensorSpec, is_input: bool) -> None:
    item = msg_list.add()
    item.name = spec.name
    item.data_type = mc.DataType.Value(f"TYPE_{spec.dtype}")
    item.dims.extend(spec.dims)
    if is_input:
        item.optional = spec.optional
        item.allow_ragged_batch = spec.ragged


def _base(name: str, max_batch_size: int, inputs, outputs, instances: dict, backend: str = "python") -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=name, backend=backend, max_batch_size=max_batch_size)
    for spec in inputs:
        _tensor(cfg.input, spec, True)
    for spec in outputs:
        _tensor(cfg.output, spec, False)
    group = cfg.instance_group.add()
    group.count = int(instances.get("instances", 1))
    group.kind = mc.ModelInstanceGroup.Kind.Value(instances.get("kind", "KIND_CPU"))
    group.gpus.extend(instances.get("gpus", []))
    return cfg


def _params(cfg: mc.ModelConfig, **values: Any) -> None:
    for key, value in values.items():
        cfg.parameters[key].string_value = str(value)


def _runtime_of(name: str, dep: dict) -> str:
    return dep["models"][name].get("runtime", dep.get("runtime", "torch"))


def kv_dtype(name: str, dep: dict) -> str:
    """The KV cache's element type in decoder `name`: fp32 in the CPU runtimes, the engine's precision in
    TensorRT."""
    if _runtime_of(name, dep) != "tensorrt":
        return "float32"
    settings = {**dep.get("tensorrt", {}), **dep["models"][name].get("tensorrt", {})}
    return PRECISIONS[settings.get("precision", DEFAULT_PRECISION)]


def kv_pool(dep: dict) -> str:
    """The `kv_pool` parameter (specdec.kv_memory.KVPoolConfig): the pair's budget, its block size and each
    decoder's folder (relative to a model's folder of the repository) and KV dtype."""
    kv = dep["kv_cache"]
    return json.dumps({
        "budget_bytes": int(kv["budget_bytes"]),
        "block_size": int(kv.get("block_size", DEFAULT_BLOCK_SIZE)),
        "models": [{"dir": f"../{name}/1", "dtype": kv_dtype(name, dep), **({"optional": True} if name in
                                                                           OPTIONAL_DECODERS else {})}
                   for name in DECODERS if name in dep["models"]],
    }, separators=(",", ":"))


def decoder_config(name: str, role: str, dep: dict) -> mc.ModelConfig:
    model = dep["models"][name]
    kv = dep["kv_cache"]
    runtime = _runtime_of(name, dep)
    instance_kind = model.get("kind", "KIND_CPU")
    if instance_kind not in RUNTIME_KINDS.get(runtime, ()):
        raise ValueError(f"{name}: runtime {runtime!r} cannot run on {instance_kind} (runtimes: {RUNTIME_KINDS})")
    num_slots = int(model.get("num_slots", kv["num_slots"]))  # KV slots per instance = max batch
    cfg = _base(name, num_slots, DECODER_INPUTS[role], c.TARGET_OUTPUTS if role == "target" else c.DRAFT_OUTPUTS,
                model)
    seq = cfg.sequence_batching
    # Generous: the speculative loop never idles; our own slot timeout frees abandoned slots.
    seq.max_sequence_idle_microseconds = int(kv["idle_timeout_s"] * 1_000_000)
    seq.oldest.max_candidate_sequences = int(model.get("max_candidate_sequences", num_slots))
    seq.oldest.max_queue_delay_microseconds = int(model.get("max_queue_delay_us", 100))
    seq.oldest.preserve_ordering = False
    for control_name, kind in ((c.CONTROL_START, "CONTROL_SEQUENCE_START"), (c.CONTROL_END, "CONTROL_SEQUENCE_END")):
        control_input = seq.control_input.add(name=control_name)
        control = control_input.control.add(kind=mc.ModelSequenceBatching.Control.Kind.Value(kind))
        control.fp32_false_true.extend([0.0, 1.0])
    corr = seq.control_input.add(name=c.CONTROL_CORRID)
    corr.control.add(kind=mc.ModelSequenceBatching.Control.Kind.Value("CONTROL_SEQUENCE_CORRID"),
                     data_type=mc.DataType.Value("TYPE_UINT64"))
    _params(
        cfg,
        role=role,
        runtime=runtime,
        device=model.get("device", "cuda" if instance_kind == "KIND_GPU" else "cpu"),
        num_slots=num_slots,
        max_length=kv["max_length"],
        kv_pool=kv_pool(dep),
        idle_timeout_s=kv["idle_timeout_s"],
        num_threads=model.get("num_threads", 1),
    )
    if model.get("weight_quantization"):  # a drafter's 8-bit weights, the target's GGUF blocks (auto)
        check_weight_quantization(role, runtime, model["weight_quantization"])
        _params(cfg, weight_quantization=model["weight_quantization"])
    if runtime == "tensorrt" or "engine_dir" in model:  # tensorrt: where docker/entrypoint.sh puts the engines
        _params(cfg, engine_dir=model.get("engine_dir", "${SPECDEC_ENGINE_DIR}/" + name))
    return cfg


def single_instance(model: dict) -> bool:
    """Whether a decoder's instance_group makes one instance (KIND_GPU without `gpus` makes one per GPU)."""
    return int(model.get("instances", 1)) == 1 and (model.get("kind", "KIND_CPU") == "KIND_CPU"
                                                   or len(model.get("gpus", [])) == 1)


def speculative_config(dep: dict) -> mc.ModelConfig:
    model = dep["models"]["speculative_decoding"]
    cfg = _base("speculative_decoding", 64, c.GENERATION_INPUTS, c.GENERATION_OUTPUTS, model)
    cfg.model_transaction_policy.decoupled = True
    limits, kv = dep["limits"], dep["kv_cache"]
    _params(
        cfg,
        tokenizer_dir="../target_model/1",
        # Capped at load by both models' context and the KV pool (specdec.kv_memory.KVPoolConfig).
        max_context_length=kv["max_length"],
        kv_pool=kv_pool(dep),
        max_concurrent_sequences=kv["num_slots"],
        max_tokens_limit=limits["max_tokens"],
        prefill_chunk_tokens=limits.get("prefill_chunk_tokens", DEFAULT_PREFILL_CHUNK),
        max_draft_tokens=limits["max_draft_tokens"],
        max_candidates=limits["max_candidates"],
        profiles_file=dep["speculation"]["profiles_file"],
        # A wave of target steps goes as one request (specdec.packing) where one target instance holds every
        # sequence's cache: the sequence batcher routes the request by one sequence's id.
        pack_target_waves=str(single_instance(dep["models"]["target_model"])).lower(),
        # request_defaults (optional): what a request that leaves a field out gets (docs/OPENAI.md).
        default_exclude_input_in_output=str(bool(
            (dep.get("request_defaults") or {}).get("exclude_input_in_output", False))).lower(),
    )
    admission = dep["admission"]
    _queue_policy(cfg, admission)
    _params(
        cfg,
        max_queued_generations=admission["max_queued_generations"],
        queue_timeout_s=admission["queue_timeout_s"],
        max_generation_s=admission["max_generation_s"],
    )
    return cfg


def _queue_policy(cfg: mc.ModelConfig, admission: dict) -> None:
    """A bounded Triton queue: past `max_queue_size` waiting requests, or `queue_timeout_s` waiting, reject."""
    policy = cfg.dynamic_batching.default_queue_policy
    policy.max_queue_size = int(admission["max_queue_size"])
    policy.default_timeout_microseconds = int(admission["queue_timeout_s"] * 1_000_000)
    policy.timeout_action = mc.ModelQueuePolicy.TimeoutAction.Value("REJECT")
    policy.allow_timeout_override = True  # a client's shorter request timeout applies


def text_config(name: str, inputs, outputs, dep: dict, queued: bool = True, **params: Any) -> mc.ModelConfig:
    cfg = _base(name, 64, inputs, outputs, dep["models"][name])
    if queued:
        _queue_policy(cfg, dep["admission"])
    _params(cfg, tokenizer_dir="../target_model/1", **params)
    return cfg


def ensemble_config() -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="ensemble", platform="ensemble", max_batch_size=64)
    for spec in c.PUBLIC_INPUTS:
        _tensor(cfg.input, spec, True)
    for spec in c.PUBLIC_OUTPUTS:
        _tensor(cfg.output, spec, False)
    steps = cfg.ensemble_scheduling.step
    pre = steps.add(model_name="preprocessing", model_version=-1)
    pre.input_map["text_input"] = "text_input"
    for spec in c.PREPROCESSING_OUTPUTS:
        pre.output_map[spec.name] = f"_{spec.name}"
    gen = steps.add(model_name="speculative_decoding", model_version=-1)
    for spec in c.GENERATION_INPUTS:
        gen.input_map[spec.name] = f"_{spec.name}" if spec in c.PREPROCESSING_OUTPUTS else spec.name
    for spec in c.GENERATION_OUTPUTS:
        gen.output_map[spec.name] = f"_{spec.name}"
    post = steps.add(model_name="postprocessing", model_version=-1)
    for spec in c.POSTPROCESSING_INPUTS:
        post.input_map[spec.name] = f"_{spec.name}"
    for spec in c.POSTPROCESSING_OUTPUTS:
        post.output_map[spec.name] = spec.name
    return cfg


def render(deployment: dict) -> dict[str, mc.ModelConfig]:
    return {
        "preprocessing": text_config("preprocessing", c.PREPROCESSING_INPUTS, c.PREPROCESSING_OUTPUTS, deployment,
                                     max_input_bytes=deployment["limits"]["max_input_bytes"]),
        **{name: decoder_config(name, role, deployment) for name, role in DECODERS.items()
           if name in deployment["models"]},
        "speculative_decoding": speculative_config(deployment),
        # No dynamic batcher in front of postprocessing: it would drop the chunks of a cancelled ensemble
        # request unseen, and postprocessing is where that cancellation becomes visible (docs/RELIABILITY.md).
        "postprocessing": text_config("postprocessing", c.POSTPROCESSING_INPUTS, c.POSTPROCESSING_OUTPUTS, deployment,
                                      queued=False),
        "ensemble": ensemble_config(),
    }


def render_text(deployment_path: Path) -> dict[str, str]:
    deployment = yaml.safe_load(deployment_path.read_text())
    try:
        source = deployment_path.resolve().relative_to(REPO_ROOT)
    except ValueError:
        source = deployment_path
    return {name: HEADER.format(source=source) + text_format.MessageToString(cfg)
            for name, cfg in render(deployment).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("deployment", type=Path)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--check", action="store_true", help="fail if the files on disk differ")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_text(args.deployment).items():
        path = args.out / name / "config.pbtxt"
        if name in OPTIONAL_DECODERS and not (args.out / name / "1" / "model.py").is_file():
            print(f"skipped {name}: {args.out / name} holds no model (optional)")
            continue  # a drafter model left out of this repository: Triton must not load one
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "1").mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    if stale:
        print("out of date (run build/render_configs.py):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
