"""The 12M fixture pair (tests/fixtures/pair_12m) loads offline and the draft shares the target's tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "pair_12m"
TARGET = PAIR / "target"
DRAFT = PAIR / "draft"
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def pair():
    """The committed target and draft models with their tokenizers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = {}
    for name, path in (("target", TARGET), ("draft", DRAFT)):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        out[name] = (model, AutoTokenizer.from_pretrained(str(path)))
    return out


@pytest.mark.parametrize("folder", [TARGET, DRAFT], ids=["target", "draft"])
def test_hf_files_present(folder: Path) -> None:
    for name in HF_FILES:
        assert (folder / name).is_file(), f"{folder / name} missing"


def test_weights_are_bf16_and_small() -> None:
    from safetensors import safe_open

    total = 0
    for folder in (TARGET, DRAFT):
        path = folder / "model.safetensors"
        total += path.stat().st_size
        with safe_open(str(path), "pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
        assert dtypes == {"BF16"}, f"{path}: {dtypes}"
    assert total <= 40 * 1024 * 1024, f"committed weights {total / 2**20:.1f} MiB > 40 MiB"


def test_architecture() -> None:
    t = json.loads((TARGET / "config.json").read_text())
    d = json.loads((DRAFT / "config.json").read_text())
    assert t["model_type"] == d["model_type"] == "llama"
    assert d["num_hidden_layers"] == 1
    assert t["num_hidden_layers"] > d["num_hidden_layers"]
    for cfg in (t, d):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            assert isinstance(cfg.get(key), int), f"{key} not set"


def test_same_tokenizer_and_vocab(pair) -> None:
    (tm, tt), (dm, dt) = pair["target"], pair["draft"]
    assert (TARGET / "tokenizer.json").read_bytes() == (DRAFT / "tokenizer.json").read_bytes()
    assert tt.get_vocab() == dt.get_vocab()
    assert tm.config.vocab_size == dm.config.vocab_size == len(tt)
    assert tm.get_output_embeddings().weight.shape[0] == dm.get_output_embeddings().weight.shape[0]
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(tt, attr) == getattr(dt, attr) == getattr(tm.config, attr) == getattr(dm.config, attr)


@pytest.mark.parametrize("text", ['{"id": 12, "tags": ["a", "b"]}\n', "def f(x):\n    return x  # é\n",
                                  "In the beginning \u201cGod\u201d created\u2014the heavens.\n\n\t"])
def test_tokenizer_round_trips_bytes(pair, text: str) -> None:
    tok = pair["target"][1]
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_forward_shapes_and_finite(pair) -> None:
    tok = pair["target"][1]
    ids = torch.tensor([tok('{"name": "x", "items": [1, 2')["input_ids"]])
    with torch.no_grad():
        for name in ("target", "draft"):
            logits = pair[name][0](input_ids=ids).logits
            assert logits.shape == (1, ids.shape[1], len(tok)), name
            assert torch.isfinite(logits).all(), name
