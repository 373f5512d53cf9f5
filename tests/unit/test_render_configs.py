"""Every config.pbtxt is a rendering of a deployment YAML: the committed CPU repository is cpu.yaml's, and
the GPU deployment renders to valid Triton model configs with the placement it states."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "build"))

import render_configs  # noqa: E402

CPU = REPO / "build" / "deployments" / "cpu.yaml"
GPU = REPO / "build" / "deployments" / "gpu.yaml"


def parse(text: str) -> mc.ModelConfig:
    """Triton's own schema: text_format rejects unknown fields, wrong types and bad enum names."""
    return text_format.Parse(text, mc.ModelConfig())


def render(deployment: dict) -> dict[str, mc.ModelConfig]:
    return {name: parse(text_format.MessageToString(cfg)) for name, cfg in render_configs.render(deployment).items()}


def kind(config: mc.ModelConfig) -> str:
    return mc.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind)


def test_committed_cpu_repository_is_the_rendering_of_cpu_yaml():
    rendered = render_configs.render_text(CPU)
    assert set(rendered) == {p.parent.name for p in (REPO / "model_repository").glob("*/config.pbtxt")}
    for name, text in rendered.items():
        assert (REPO / "model_repository" / name / "config.pbtxt").read_text() == text, f"{name}: run make configs"
        parse(text)


def test_gpu_deployment_is_valid_and_places_the_decoders_on_the_gpu():
    deployment = yaml.safe_load(GPU.read_text())
    configs = {name: parse(text.split("\n", 1)[1]) for name, text in render_configs.render_text(GPU).items()}
    target, draft = configs["target_model"], configs["draft_model"]
    assert (target.instance_group[0].count, draft.instance_group[0].count) == (1, 3)  # the article's 1:3
    slots_of = {"target_model": deployment["kv_cache"]["num_slots"],
                "draft_model": deployment["models"]["draft_model"]["num_slots"]}
    for config in (target, draft):
        slots = slots_of[config.name]
        assert kind(config) == "KIND_GPU" and list(config.instance_group[0].gpus) == [0]
        params = {key: value.string_value for key, value in config.parameters.items()}
        assert params["runtime"] == "tensorrt" and params["device"] == "cuda"
        assert params["engine_dir"] == "${SPECDEC_ENGINE_DIR}/" + config.name
        assert config.max_batch_size == slots == int(params["num_slots"])
        assert config.sequence_batching.oldest.max_candidate_sequences == slots
        assert params["max_length"] == str(deployment["kv_cache"]["max_length"])
    assert target.sequence_batching.oldest.max_queue_delay_microseconds == 200
    for name in ("preprocessing", "postprocessing", "speculative_decoding"):
        assert kind(configs[name]) == "KIND_CPU", name
    assert configs["speculative_decoding"].model_transaction_policy.decoupled


def test_two_gpu_placement():
    deployment = yaml.safe_load(GPU.read_text())
    deployment["models"]["target_model"].update(gpus=[0], instances=2)
    deployment["models"]["draft_model"].update(gpus=[1], instances=3)
    configs = render(deployment)
    assert list(configs["target_model"].instance_group[0].gpus) == [0]
    assert configs["target_model"].instance_group[0].count == 2
    assert list(configs["draft_model"].instance_group[0].gpus) == [1]


def test_torch_on_gpu_and_explicit_engine_dir():
    deployment = yaml.safe_load(GPU.read_text())
    deployment["runtime"] = "torch"
    deployment["models"]["draft_model"]["engine_dir"] = "/engines/draft"
    configs = render(deployment)
    assert "engine_dir" not in configs["target_model"].parameters
    assert configs["target_model"].parameters["device"].string_value == "cuda"
    assert configs["draft_model"].parameters["engine_dir"].string_value == "/engines/draft"


@pytest.mark.parametrize(("runtime", "instance_kind"), [("onnxruntime", "KIND_GPU"), ("tensorrt", "KIND_CPU")])
def test_runtime_and_device_kind_must_agree(runtime, instance_kind):
    deployment = copy.deepcopy(yaml.safe_load(CPU.read_text()))
    deployment["models"]["target_model"].update(runtime=runtime, kind=instance_kind)
    with pytest.raises(ValueError, match=f"cannot run on {instance_kind}"):
        render_configs.render(deployment)


def test_check_mode_reports_stale_files(tmp_path, capsys):
    assert render_configs.main([str(GPU), "--out", str(tmp_path)]) == 0
    assert render_configs.main([str(GPU), "--out", str(tmp_path), "--check"]) == 0
    assert render_configs.main([str(CPU), "--out", str(tmp_path), "--check"]) == 1
    assert "out of date" in capsys.readouterr().err
