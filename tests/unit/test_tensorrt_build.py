"""The TensorRT path: what runs on a CPU (profiles, build plans, engine metadata and its checks, argument
handling) always; engine build and parity with torch only where `tensorrt` and a CUDA GPU are present."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "build"))

import build_engines  # noqa: E402
from specdec.checkpoint import read_spec  # noqa: E402
from specdec.runtime import build_runtime  # noqa: E402
from specdec.runtime.graph_contract import checkpoint_fingerprint, graph_inputs  # noqa: E402
from specdec.runtime.tensorrt_llama import (  # noqa: E402
    EngineMetadata,
    ProfileRange,
    compute_profiles,
    spec_dict,
    step_tokens,
)

GPU_YAML = REPO / "build" / "deployments" / "gpu.yaml"
CPU_YAML = REPO / "build" / "deployments" / "cpu.yaml"


def have_tensorrt_gpu() -> str | None:
    """Why the engine tests cannot run here, or None."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "the `tensorrt` package is not installed (optional extra: pip install -e .[tensorrt])"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    return None


needs_gpu = pytest.mark.skipif(have_tensorrt_gpu() is not None, reason=str(have_tensorrt_gpu()))


def test_profiles_cover_every_call_the_engines_make():
    target = compute_profiles("target", num_slots=16, max_length=1024, max_draft_tokens=16, max_candidates=8,
                              default_draft_tokens=6, max_prefill_tokens=256)
    decode, prefill = target
    assert decode.new_tokens == (1, 7, step_tokens(16, 8)) == (1, 7, 129)  # tuned for k+1, up to a full tree
    assert prefill.new_tokens[2] == 256
    for profile in target:
        # key rows: the context plus the call's new tokens, up to a full cache and the profile's widest call
        assert profile.batch[2] == 16 and profile.key_rows == (1, profile.key_rows[1], 1024 + profile.new_tokens[2])
    draft = compute_profiles("draft", 4, 64, 16, 8, 6, 512)
    assert draft[0].new_tokens == (1, 1, 64)  # opt: the draft's one-token steps; capped by the cache length
    assert draft[1].new_tokens[2] == 64
    with pytest.raises(ValueError, match="role"):
        compute_profiles("verifier", 4, 64, 4, 1, 4)


def test_profile_shapes_follow_the_graph_inputs(tiny_pair):
    spec = read_spec(tiny_pair[0])
    profile = ProfileRange("decode", (1, 2, 8), (1, 3, 10), (1, 20, 100))
    shapes = profile.shapes(spec)
    assert list(shapes) == list(graph_inputs(spec))
    low, opt, high = shapes["attention_mask"]
    assert (low, opt, high) == ((1, 1, 1), (2, 3, 20), (8, 10, 100))  # key rows: the new tokens' among them
    assert shapes["new_rows"] == ((1, 1), (2, 3), (8, 10))
    last_layer = spec.num_layers - 1
    for name in ("past_keys_0", f"past_values_{last_layer}"):
        assert shapes[name][2] == (spec.num_kv_heads, 8, 100, spec.head_dim)
    assert shapes["logit_rows"] == ((1,), (6,), (80,))
    with pytest.raises(ValueError, match="min <= opt <= max"):
        ProfileRange("bad", (1, 9, 8), (1, 1, 1), (1, 1, 1))


def test_an_eagle_heads_profiles_shape_its_features(tiny_eagle):
    spec = read_spec(tiny_eagle)
    shapes = ProfileRange("decode", (1, 2, 8), (1, 3, 10), (1, 20, 100)).shapes(spec)
    assert list(shapes) == list(graph_inputs(spec)) and list(shapes)[-1] == "features"
    assert shapes["features"] == ((1, 1, spec.hidden_size), (2, 3, spec.hidden_size), (8, 10, spec.hidden_size))
    head = compute_profiles("eagle", 4, 64, 16, 8, 6, 512)
    assert head[0].new_tokens == (1, 1, 64)  # like the draft: one token a step after the catch-up


def test_build_plan_from_the_gpu_deployment(tmp_path):
    deployment = yaml.safe_load(GPU_YAML.read_text())
    plans = build_engines.plan_engines(deployment, REPO / "model_repository", tmp_path)
    # The EAGLE head is built when the repository holds it (the default one does, an imported one not).
    head = [("eagle_draft", "eagle")] if (REPO / "model_repository/eagle_draft/1/config.json").is_file() else []
    assert [(p.model, p.role) for p in plans] == [("target_model", "target"), ("draft_model", "draft"), *head]
    target, draft = plans[:2]
    assert target.precision == deployment["tensorrt"]["precision"]
    assert target.profiles[0].batch[2] == deployment["kv_cache"]["num_slots"]
    assert draft.profiles[0].batch[2] == deployment["models"]["draft_model"]["num_slots"]
    assert target.output == tmp_path / "target_model" and target.checkpoint == REPO / "model_repository/target_model/1"
    only = build_engines.plan_engines(deployment, REPO / "model_repository", tmp_path, ["draft_model"],
                                      {"precision": "bf16", "max_prefill_tokens": 64})
    assert [p.model for p in only] == ["draft_model"] and only[0].precision == "bf16"
    assert only[0].profiles[1].new_tokens[2] == max(64, step_tokens(16, 8))  # a prefill chunk fits a tree
    with pytest.raises(ValueError, match="not decoder models"):
        build_engines.plan_engines(deployment, REPO / "model_repository", tmp_path, ["ensemble"])
    with pytest.raises(ValueError, match="precision"):
        build_engines.plan_engines(deployment, REPO / "model_repository", tmp_path, None, {"precision": "int3"})
    # A deployment without tensorrt models (SPECDEC_BUILD_ENGINES=1 on the CPU file): build both decoders.
    cpu = build_engines.plan_engines(yaml.safe_load(CPU_YAML.read_text()), REPO / "model_repository", tmp_path)
    assert [p.model for p in cpu] == ["target_model", "draft_model", *[name for name, _ in head]]


def test_dry_run_prints_the_plan_without_tensorrt(tmp_path, capsys):
    code = build_engines.main(["--deployment", str(GPU_YAML), "--output-dir", str(tmp_path), "--dry-run",
                               "--precision", "fp32", "--models", "target_model"])
    assert code == 0
    described = json.loads(capsys.readouterr().out)
    assert [d["model"] for d in described] == ["target_model"] and described[0]["precision"] == "fp32"
    assert [p["name"] for p in described[0]["profiles"]] == ["decode", "prefill"]
    assert not any(tmp_path.iterdir())  # nothing exported or built
    with pytest.raises(SystemExit, match="no checkpoint"):
        build_engines.main(["--deployment", str(GPU_YAML), "--output-dir", str(tmp_path), "--dry-run",
                            "--model-repository", str(tmp_path)])


def metadata_for(model_dir: Path, **changes) -> EngineMetadata:
    profiles = compute_profiles("target", 4, 128, 4, 2, 3, 64)
    meta = EngineMetadata(
        model="target_model", role="target", precision="fp16", checkpoint_fingerprint=checkpoint_fingerprint(model_dir),
        spec=spec_dict(read_spec(model_dir)), max_length=128, num_slots=4,
        profiles=[{"name": p.name, "batch": p.batch, "new_tokens": p.new_tokens, "key_rows": p.key_rows}
                  for p in profiles],
        inputs=list(graph_inputs(read_spec(model_dir))), tensorrt_version="10.5.0", device_name="NVIDIA H200",
        compute_capability="9.0",
    )
    return replace(meta, **changes)


def test_metadata_round_trip_and_checks(tiny_pair, tmp_path):
    target_dir, draft_dir = tiny_pair
    meta = metadata_for(target_dir)
    meta.save(tmp_path)
    loaded = EngineMetadata.load(tmp_path)
    assert asdict(loaded) == json.loads(json.dumps(asdict(meta)))
    assert loaded.dtype == torch.float16 and loaded.limits == (4, 64)
    loaded.check(target_dir, max_length=128, tensorrt_version="10.5.0", compute_capability="9.0")
    problems = {
        "other weights": dict(model_dir=draft_dir),
        "cache length 128": dict(max_length=256),
        "TensorRT 10.5.0": dict(tensorrt_version="10.6.0"),
        "compute capability 9.0": dict(compute_capability="8.0"),
    }
    for message, changed in problems.items():
        args = {"model_dir": target_dir, "max_length": 128, "tensorrt_version": "10.5.0",
                "compute_capability": "9.0", **changed}
        with pytest.raises(ValueError, match=message):
            loaded.check(**args)
    bad = tmp_path / "old"
    bad.mkdir()
    (bad / "model.json").write_text(json.dumps({**json.loads((tmp_path / "model.json").read_text()), "format": 0}))
    with pytest.raises(ValueError, match="metadata format"):
        EngineMetadata.load(bad)


def test_profile_selection(tiny_pair):
    meta = metadata_for(tiny_pair[0])
    assert meta.select_profile(batch=4, new_tokens=4, key_rows=100) == 0  # decode
    assert meta.select_profile(batch=1, new_tokens=60, key_rows=1) == 1  # prefill
    with pytest.raises(ValueError, match="no optimization profile"):
        meta.select_profile(batch=5, new_tokens=1, key_rows=1)


def test_runtime_refuses_clearly_without_an_engine(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="needs engine_dir"):
        build_runtime("tensorrt", tiny_pair[0], num_slots=1, max_length=16, device="cuda")
    with pytest.raises(FileNotFoundError, match="build_engines.py"):
        build_runtime("tensorrt", tiny_pair[0], num_slots=1, max_length=16, device="cuda", engine_dir=tmp_path)


# --- on a GPU with TensorRT ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_pair, tmp_path_factory):
    """fp32 and fp16 engines of the tiny target, small profiles."""
    out = {}
    for precision in ("fp32", "fp16"):
        root = tmp_path_factory.mktemp(f"engine_{precision}")
        plan = build_engines.EnginePlan(
            model="target_model", role="target", checkpoint=tiny_pair[0], output=root, precision=precision,
            num_slots=4, max_length=128, profiles=compute_profiles("target", 4, 128, 4, 2, 3, 64),
            workspace_gib=1.0, optimization_level=2,
        )
        build_engines.build_one(plan)
        out[precision] = root
    return out


@needs_gpu
def test_engine_logits_match_torch_on_cuda(tiny_pair, engines):
    from specdec.runtime.base import ForwardItem
    from specdec.runtime.torch_llama import TorchLlamaRuntime

    reference = TorchLlamaRuntime(tiny_pair[0], num_slots=4, max_length=128, device="cuda")
    prompt = np.array([5, 17, 42, 8, 66, 3, 91, 12, 7])
    tree = ForwardItem(0, 9, np.array([20, 30, 31, 40]), num_logits=4, tree_parents=np.array([-1, 0, 0, 1]))
    for precision, tolerance, agreement in (("fp32", 1e-3, 1.0), ("fp16", 0.05, 0.9)):
        runtime = build_runtime("tensorrt", tiny_pair[0], num_slots=4, max_length=128, device="cuda",
                                engine_dir=engines[precision])
        for items in ([ForwardItem(0, 0, prompt, num_logits=9), ForwardItem(2, 0, prompt[:4], num_logits=2)], [tree]):
            expected, got = reference.forward(items), runtime.forward(items)
            a, b = np.concatenate(expected), np.concatenate(got)
            scale = np.abs(a).max()
            assert np.abs(a - b).max() <= tolerance * scale, precision
            assert (a.argmax(-1) == b.argmax(-1)).mean() >= agreement, precision


@needs_gpu
def test_engine_greedy_generation_equals_torch(tiny_pair, engines, tmp_path):
    from specdec.engines import DraftEngine, TargetEngine
    from specdec.generation import GenerationRequest, SpeculativeGenerator
    from specdec.inprocess import InProcessBackend

    def run(target_runtime) -> list[int]:
        draft = build_runtime("torch", tiny_pair[1], num_slots=4, max_length=128, device="cuda")
        backend = InProcessBackend(TargetEngine(target_runtime, 60), DraftEngine(draft, 60))
        generator = SpeculativeGenerator(backend, 128)

        async def collect() -> list[int]:
            out: list[int] = []
            async for update in generator.generate(GenerationRequest([5, 17, 42], 64, num_draft_tokens=4), 1):
                out.extend(update.token_ids)
            return out

        return asyncio.run(collect())

    expected = run(build_runtime("torch", tiny_pair[0], num_slots=4, max_length=128, device="cuda"))
    got = run(build_runtime("tensorrt", tiny_pair[0], num_slots=4, max_length=128, device="cuda",
                            engine_dir=engines["fp32"]))
    assert got == expected and len(got) == 64
