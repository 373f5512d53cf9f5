"""Build TensorRT engines of the decoder models of a deployment (TensorRT Python API).

For every decoder that the deployment runs on `runtime: tensorrt` (or those named by --models): check that its
Hugging Face checkpoint is of a supported family (specdec.families: Llama 3.x, Qwen2/2.5, Qwen3, Mistral;
anything else stops here, naming the config field), export its decoder step to ONNX at the engine's precision
(specdec.runtime.step_graph; the family's biases, q/k norms and rotary tables are in the graph, a sliding
window in its attention mask input), parse it into a strongly typed TensorRT network, add one optimization
profile per shape regime (specdec.runtime.tensorrt_llama.compute_profiles: `decode` and `prefill`, over batch,
new tokens and cache length), build, and write

    <output-dir>/<model>/model.plan     the serialized engine (for this GPU type and TensorRT version)
    <output-dir>/<model>/model.json     its metadata: weights fingerprint, profiles, precision, GPU, versions
    <output-dir>/<model>/onnx/decoder.onnx

The models find them through the `engine_dir` parameter that build/render_configs.py renders
(`${SPECDEC_ENGINE_DIR}/<model>`; docker/entrypoint.sh sets SPECDEC_ENGINE_DIR). Usage:

    python build/build_engines.py --deployment build/deployments/gpu.yaml --output-dir engines
    python build/build_engines.py --deployment build/deployments/gpu.yaml --output-dir engines --dry-run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from render_configs import DECODERS, OPTIONAL_DECODERS
from specdec.checkpoint import UnsupportedCheckpoint, read_spec
from specdec.runtime.graph_contract import DEFAULT_PRECISION, ONNX_FILE, checkpoint_fingerprint, graph_inputs
from specdec.runtime.onnx_llama import export_is_current
from specdec.runtime.step_graph import export_decoder
from specdec.runtime.tensorrt_llama import (
    ENGINE_FILE,
    PRECISIONS,
    EngineMetadata,
    ProfileRange,
    compute_profiles,
    spec_dict,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"precision": DEFAULT_PRECISION, "max_prefill_tokens": 512, "workspace_gib": 4.0, "optimization_level": 3}


@dataclass
class EnginePlan:
    """What will be built for one model."""

    model: str
    role: str
    checkpoint: Path
    output: Path
    precision: str
    num_slots: int
    max_length: int
    profiles: list[ProfileRange]
    workspace_gib: float
    optimization_level: int

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model, "role": self.role, "checkpoint": str(self.checkpoint), "output": str(self.output),
            "precision": self.precision, "num_slots": self.num_slots, "max_length": self.max_length,
            "workspace_gib": self.workspace_gib, "optimization_level": self.optimization_level,
            "profiles": [
                {"name": p.name, "batch": p.batch, "new_tokens": p.new_tokens, "key_rows": p.key_rows}
                for p in self.profiles
            ],
        }


def plan_engines(deployment: dict, model_repository: Path, output_dir: Path, models: list[str] | None = None,
                 overrides: dict[str, Any] | None = None) -> list[EnginePlan]:
    """The engines to build: `models`, else the decoders on runtime tensorrt, else (none) every decoder.
    Settings: DEFAULTS < the deployment's `tensorrt:` < the model's `tensorrt:` < `overrides`."""
    default_runtime = deployment.get("runtime", "torch")
    entries = deployment.get("models", {})
    if models:
        unknown = sorted(set(models) - set(DECODERS))
        if unknown:
            raise ValueError(f"not decoder models: {', '.join(unknown)} (decoders: {', '.join(DECODERS)})")
        chosen = models
    else:
        chosen = [name for name in DECODERS if entries.get(name, {}).get("runtime", default_runtime) == "tensorrt"]
        chosen = chosen or list(DECODERS)
        # An optional decoder (the EAGLE head) is built when the repository holds its checkpoint.
        chosen = [name for name in chosen if name not in OPTIONAL_DECODERS
                  or (model_repository / name / "1" / "config.json").is_file()]
    kv, limits, speculation = deployment["kv_cache"], deployment["limits"], deployment.get("speculation", {})
    plans = []
    for name in chosen:
        entry = entries.get(name, {})
        settings = {**DEFAULTS, **deployment.get("tensorrt", {}), **entry.get("tensorrt", {}), **(overrides or {})}
        if settings["precision"] not in PRECISIONS:
            raise ValueError(f"{name}: precision must be one of {', '.join(PRECISIONS)}, not {settings['precision']!r}")
        num_slots = int(entry.get("num_slots", kv["num_slots"]))
        profiles = compute_profiles(
            DECODERS[name], num_slots=num_slots, max_length=int(kv["max_length"]),
            max_draft_tokens=int(limits["max_draft_tokens"]), max_candidates=int(limits["max_candidates"]),
            default_draft_tokens=int(speculation.get("default_num_draft_tokens", 6)),
            max_prefill_tokens=int(settings["max_prefill_tokens"]),
        )
        plans.append(EnginePlan(
            model=name, role=DECODERS[name], checkpoint=model_repository / name / "1", output=output_dir / name,
            precision=settings["precision"], num_slots=num_slots, max_length=int(kv["max_length"]),
            profiles=profiles, workspace_gib=float(settings["workspace_gib"]),
            optimization_level=int(settings["optimization_level"]),
        ))
    return plans


def build_engine(onnx_path: Path, plan: EnginePlan, timing_cache: Path | None = None) -> tuple[bytes, dict[str, Any]]:
    """Parse `onnx_path` into a strongly typed network (precision = the graph's dtypes), add the profiles,
    build; returns the serialized engine and the builder settings used."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}:\n{errors}")
    spec = read_spec(plan.checkpoint)
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if names != list(graph_inputs(spec)):
        raise RuntimeError(f"{onnx_path}: inputs {names}, expected {list(graph_inputs(spec))}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(plan.workspace_gib * (1 << 30)))
    config.builder_optimization_level = plan.optimization_level
    if plan.precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32: parity with the torch runtime
    for profile_range in plan.profiles:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile_range.shapes(spec).items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    if timing_cache:
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    settings = {"workspace_gib": plan.workspace_gib, "optimization_level": plan.optimization_level,
                "strongly_typed": True, "tf32": plan.precision != "fp32"}
    return bytes(serialized), settings


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_one(plan: EnginePlan, timing_cache: Path | None = None) -> EngineMetadata:
    import tensorrt as trt
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("building a TensorRT engine needs a CUDA GPU; torch sees none")
    plan.output.mkdir(parents=True, exist_ok=True)
    dtype = PRECISIONS[plan.precision]
    onnx_path = plan.output / "onnx" / ONNX_FILE
    started = time.perf_counter()
    if not export_is_current(onnx_path, plan.checkpoint, dtype):
        export_decoder(plan.checkpoint, onnx_path, dtype=dtype)
    exported = time.perf_counter()
    engine, settings = build_engine(onnx_path, plan, timing_cache)
    (plan.output / ENGINE_FILE).write_bytes(engine)
    major, minor = torch.cuda.get_device_capability()
    meta = EngineMetadata(
        model=plan.model, role=plan.role, precision=plan.precision,
        checkpoint_fingerprint=checkpoint_fingerprint(plan.checkpoint), spec=spec_dict(read_spec(plan.checkpoint)),
        inputs=list(graph_inputs(read_spec(plan.checkpoint))),
        max_length=plan.max_length, num_slots=plan.num_slots, profiles=plan.describe()["profiles"],
        tensorrt_version=trt.__version__, device_name=torch.cuda.get_device_name(),
        compute_capability=f"{major}.{minor}", onnx_sha256=sha256_of(onnx_path),
        build_seconds=round(time.perf_counter() - exported, 2),
        builder={**settings, "export_seconds": round(exported - started, 2), "plan_bytes": len(engine)},
    )
    meta.save(plan.output)
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deployment", type=Path, required=True, help="deployment YAML (build/deployments/*.yaml)")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--output-dir", type=Path, required=True, help="engines go to <output-dir>/<model>/")
    parser.add_argument("--models", help="comma-separated decoder models (default: those on runtime tensorrt)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), help="override the deployment's precision")
    parser.add_argument("--max-prefill-tokens", type=int, help="override: longest prefill chunk of the profiles")
    parser.add_argument("--workspace-gib", type=float, help="override: builder workspace")
    parser.add_argument("--optimization-level", type=int, choices=range(6), help="override: builder effort 0-5")
    parser.add_argument("--timing-cache", type=Path, help="reuse and update a TensorRT timing cache file")
    parser.add_argument("--dry-run", action="store_true", help="print what would be built (no TensorRT needed)")
    args = parser.parse_args(argv)

    deployment = yaml.safe_load(args.deployment.read_text())
    overrides = {key: value for key, value in (
        ("precision", args.precision), ("max_prefill_tokens", args.max_prefill_tokens),
        ("workspace_gib", args.workspace_gib), ("optimization_level", args.optimization_level),
    ) if value is not None}
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    plans = plan_engines(deployment, args.model_repository, args.output_dir, models, overrides)
    families = {}
    for plan in plans:
        if not (plan.checkpoint / "config.json").is_file():
            raise SystemExit(f"{plan.model}: no checkpoint at {plan.checkpoint}")
        try:  # before any export or build: an unsupported checkpoint fails here, naming its config field
            families[plan.model] = read_spec(plan.checkpoint).family
        except UnsupportedCheckpoint as exc:
            raise SystemExit(f"{plan.model}: {plan.checkpoint}: {exc}") from exc
    if args.dry_run:
        print(json.dumps([{**plan.describe(), "family": families[plan.model]} for plan in plans], indent=2))
        return 0
    for plan in plans:
        print(f"[build_engines] {plan.model} ({families[plan.model]}): {plan.precision}, profiles "
              + ", ".join(f"{p.name} B{p.batch} W{p.new_tokens} P{p.key_rows}" for p in plan.profiles), flush=True)
        meta = build_one(plan, args.timing_cache)
        size_mib = meta.builder["plan_bytes"] / 2**20
        print(f"[build_engines] {plan.model}: {plan.output / ENGINE_FILE} ({size_mib:.1f} MiB)"
              f" on {meta.device_name} sm{meta.compute_capability}, TensorRT {meta.tensorrt_version}:"
              f" export {meta.builder['export_seconds']} s, build {meta.build_seconds} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
