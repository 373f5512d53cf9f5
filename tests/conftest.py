"""Shared fixtures: tiny random Llama checkpoints made on the fly (no hub, seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The 12M pair trained here: a fast fixture for tests that need a real pipeline but not the real model.
PAIR_12M = REPO_ROOT / "tests" / "fixtures" / "pair_12m"
TEST_REPOSITORY_ENV = "SPECDEC_TEST_MODEL_REPOSITORY"


_made_repository: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    """Before collection (some test modules read it at import): the model repository the integration tests
    serve, the project's configs and model.py files with the 12M fixture pair, unless
    SPECDEC_TEST_MODEL_REPOSITORY names one. The real default model has tests of its own
    (tests/integration/test_default_model.py)."""
    if os.environ.get(TEST_REPOSITORY_ENV):
        return
    import sys
    import tempfile

    sys.path.insert(0, str(REPO_ROOT / "build"))
    from import_checkpoint import import_pair

    repo = Path(tempfile.mkdtemp(prefix="specdec-fixture-repo-")) / "model_repository"
    import_pair(PAIR_12M / "target", PAIR_12M / "draft", repo)
    os.environ[TEST_REPOSITORY_ENV] = str(repo)
    _made_repository.append(repo.parent)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    for folder in _made_repository:
        shutil.rmtree(folder, ignore_errors=True)


def make_tiny_llama(path: Path, num_layers: int, seed: int, vocab_size: int = 96, hidden: int = 64,
                    kv_heads: int = 2, intermediate: int | None = None) -> Path:
    """Save a random Llama checkpoint in Hugging Face format (fp32, so parity checks are tight)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
        tie_word_embeddings=True, eos_token_id=1, bos_token_id=0, pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    # Larger weights than the default init give peaked, input-dependent distributions.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a 3-layer target and a 1-layer draft with the same vocabulary."""
    root = tmp_path_factory.mktemp("tiny_pair")
    return (make_tiny_llama(root / "target", 3, seed=1), make_tiny_llama(root / "draft", 1, seed=2))


def _inprocess_backend(pair: tuple[Path, Path], max_length: int, num_slots: int = 4):
    """Target and draft engines over the torch runtime, called in this process (no server)."""
    from specdec.engines import DraftEngine, TargetEngine
    from specdec.inprocess import InProcessBackend
    from specdec.runtime.torch_llama import TorchLlamaRuntime

    target_dir, draft_dir = pair
    return InProcessBackend(
        TargetEngine(TorchLlamaRuntime(target_dir, num_slots=num_slots, max_length=max_length), idle_timeout_s=60),
        DraftEngine(TorchLlamaRuntime(draft_dir, num_slots=num_slots, max_length=max_length), idle_timeout_s=60),
    )


@pytest.fixture(scope="session")
def make_eagle_head():
    """Factory of random EAGLE heads for a target folder: `make_eagle_head(path, target_dir, seed)`."""
    return make_tiny_eagle


@pytest.fixture(scope="session")
def make_inprocess_backend():
    """Factory of in-process backends: `make_inprocess_backend(pair, max_length)`."""
    return _inprocess_backend


def make_tiny_eagle(path: Path, target_dir: Path, seed: int, aux_layers: tuple[int, ...] = ()) -> Path:
    """A random EAGLE head for `target_dir` (specdec.checkpoint.EAGLE_CONFIG_KEY): one layer of the target's
    shape, its own final norm, `eagle.fc` [hidden, hidden + feature], the target's embeddings (shared). With
    `aux_layers` (EAGLE-3 fusion), its feature is (1 + len(aux_layers)) x hidden wide."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from specdec.checkpoint import EAGLE_CONFIG_KEY, EAGLE_FC_WEIGHT

    config = json.loads((target_dir / "config.json").read_text())
    layer = make_tiny_llama(path.parent / f".{path.name}-layer", 1, seed=seed, vocab_size=config["vocab_size"],
                            hidden=config["hidden_size"], kv_heads=config["num_key_value_heads"],
                            intermediate=config["intermediate_size"])
    hidden = int(config["hidden_size"])
    feature = hidden * (1 + len(aux_layers))
    eagle = {"feature_size": feature, "feature": "final_norm"}
    if aux_layers:
        eagle["aux_layers"] = list(aux_layers)
    config.pop("specdec_feature_layers", None)
    config.update(num_hidden_layers=1, **{EAGLE_CONFIG_KEY: eagle})
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    state = {k: v for k, v in load_file(str(layer / "model.safetensors")).items() if k.startswith("model.layers.")}
    state["model.norm.weight"] = torch.ones(hidden)
    state["model.embed_tokens.weight"] = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    generator = torch.Generator().manual_seed(seed)
    state[EAGLE_FC_WEIGHT] = torch.randn(hidden, hidden + feature, generator=generator) * 0.2
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="session")
def fused_eagle(tiny_pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target_dir, head_dir) for EAGLE-3 fusion: tiny_pair's target emitting layers 0 and 1 beside its final
    feature (specdec.checkpoint.FEATURE_LAYERS_KEY) and a random head reading them."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("fused_eagle")
    target = root / "target"
    shutil.copytree(tiny_pair[0], target)
    config = json.loads((target / "config.json").read_text())
    config["specdec_feature_layers"] = [1, 0]  # any order: the head reads the blocks in this order
    (target / "config.json").write_text(json.dumps(config))
    return target, make_tiny_eagle(root / "eagle", target, seed=4, aux_layers=(1, 0))


@pytest.fixture(scope="session")
def tiny_eagle(tiny_pair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE head for tiny_pair's target."""
    return make_tiny_eagle(tmp_path_factory.mktemp("tiny_eagle") / "eagle", tiny_pair[0], seed=3)
