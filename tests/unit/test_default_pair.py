"""The default pair as `make setup` installs it: SmolLM2-135M-Instruct converted from the wheel's GGUF file,
and the draft trained for it (only its own layers committed, completed with the target's embeddings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "build"))
sys.path.insert(0, str(REPO_ROOT / "tests"))  # tests/first_token_law.py

from default_model import default_gguf  # noqa: E402
from gguf_convert import is_converted  # noqa: E402
from train_draft import DRAFT_WEIGHTS, EMBED_KEY, INDEX_FILE, SHARED_WEIGHTS  # noqa: E402
from train_eagle import EAGLE_WEIGHTS  # noqa: E402

TARGET = REPO_ROOT / "model_repository" / "target_model" / "1"
DRAFT = REPO_ROOT / "model_repository" / "draft_model" / "1"
EAGLE = REPO_ROOT / "model_repository" / "eagle_draft" / "1"
COMMITTED_DRAFT_FILES = ("config.json", DRAFT_WEIGHTS, "proposal_vocab.json")
MAX_COMMITTED_BYTES = 40 * 1024 * 1024


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    if not is_converted(default_gguf(), TARGET, "bfloat16") or not (DRAFT / SHARED_WEIGHTS).is_file():
        pytest.fail("the default pair is not installed: run `make setup` (build/default_model.py)")


def test_target_is_smollm2_135m_instruct() -> None:
    config = json.loads((TARGET / "config.json").read_text())
    expected = {"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
                "tie_word_embeddings": True}
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    assert (TARGET / "chat_template.jinja").is_file()


def test_only_the_drafts_own_layers_are_committed() -> None:
    tracked = subprocess.run(["git", "ls-files", "model_repository"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    weights = [REPO_ROOT / p for p in tracked if p.endswith(".safetensors")]
    assert sorted(weights) == sorted([DRAFT / DRAFT_WEIGHTS, EAGLE / EAGLE_WEIGHTS])
    assert sum(w.stat().st_size for w in weights) <= MAX_COMMITTED_BYTES
    for name in COMMITTED_DRAFT_FILES:
        assert f"model_repository/draft_model/1/{name}" in tracked
    from safetensors import safe_open

    with safe_open(str(DRAFT / DRAFT_WEIGHTS), "pt") as f:
        keys = list(f.keys())  # noqa: SIM118
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
    assert EMBED_KEY not in keys and not any(k.startswith("lm_head") for k in keys)


def test_draft_shares_the_targets_embeddings_and_tokenizer() -> None:
    from import_checkpoint import check_compatible
    from specdec.checkpoint import load_state_dict

    target, draft = load_state_dict(TARGET), load_state_dict(DRAFT)
    assert torch.equal(draft[EMBED_KEY], target[EMBED_KEY])
    index = json.loads((DRAFT / INDEX_FILE).read_text())["weight_map"]
    assert set(index) == set(draft)
    check_compatible(TARGET, DRAFT)  # same vocabulary and special tokens: raises otherwise
    draft_config = json.loads((DRAFT / "config.json").read_text())
    assert draft_config["num_hidden_layers"] < 30 and draft_config["hidden_size"] == 576


def test_hugging_face_loads_the_assembled_draft() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DRAFT), dtype=torch.float32)
    assert model.get_output_embeddings().weight.shape == (49152, 576)
    ids = torch.tensor([[1, 4093, 314, 253, 2]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_proposal_vocabulary_is_a_real_subset() -> None:
    from specdec.checkpoint import read_proposal_vocab

    ids = read_proposal_vocab(DRAFT, 49152)
    assert ids is not None and 1000 < len(ids) < 49152
    for special in (1, 2):  # <|im_start|>, <|im_end|> (the end id)
        assert special in ids


def test_import_a_gguf_target_into_a_new_repository(tmp_path: Path) -> None:
    """`build/import_checkpoint.py --target FILE.gguf --draft DIR --repo NEW`: a repository of its own, made from
    the project's configs and model.py files, with the GGUF converted on the way and its blocks served."""
    from import_checkpoint import import_pair

    repo = tmp_path / "my_repository"
    done = import_pair(default_gguf(), DRAFT, repo)
    assert (repo / "ensemble" / "config.pbtxt").is_file() and (repo / "target_model" / "1" / "model.py").is_file()
    assert (repo / "target_model" / "1" / "model.safetensors") in done["target"]
    assert (repo / "draft_model" / "1" / DRAFT_WEIGHTS) in done["draft"]
    assert not list((repo / "target_model" / "1").glob("onnx"))
    converted = json.loads((repo / "target_model" / "1" / "config.json").read_text())
    installed = json.loads((TARGET / "config.json").read_text())
    installed.pop("specdec_feature_layers", None)  # written by build/default_model.py for the installed head
    assert converted == installed
    from specdec.runtime import choose_weights  # served from the file's own blocks, found through gguf_source.json

    assert choose_weights("target", "onnxruntime", "auto", repo / "target_model" / "1")[0] == "gguf"
    assert choose_weights("draft", "onnxruntime", "auto", repo / "draft_model" / "1")[0] is None
    with pytest.raises(FileExistsError):
        from import_checkpoint import new_repository

        new_repository(repo)


def test_the_eagle_heads_own_tensors_are_committed_and_the_rest_shared() -> None:
    from safetensors import safe_open
    from specdec.checkpoint import EAGLE_FC_WEIGHT, read_spec

    tracked = subprocess.run(["git", "ls-files", "model_repository/eagle_draft"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    for name in ("config.json", EAGLE_WEIGHTS, "proposal_vocab.json", "model.py"):
        assert f"model_repository/eagle_draft/1/{name}" in tracked
    with safe_open(str(EAGLE / EAGLE_WEIGHTS), "pt") as f:
        keys = set(f.keys())  # noqa: SIM118
    assert EAGLE_FC_WEIGHT in keys and "model.norm.weight" in keys and EMBED_KEY not in keys
    assert {k.split(".")[2] for k in keys if k.startswith("model.layers.")} == {"0"}
    spec, target = read_spec(EAGLE), read_spec(TARGET)
    assert spec.is_eagle and spec.vocab_size == target.vocab_size
    # The target returns the feature the head reads: its final one and the layers the head fuses (EAGLE-3).
    assert spec.eagle_aux_layers == target.feature_layers and spec.eagle_feature_size == target.feature_width
    assert (EAGLE / SHARED_WEIGHTS).is_file()  # assembled by build/default_model.py


def test_rejection_sampling_with_the_real_eagle_head_keeps_the_targets_law() -> None:
    """The first token of a verification is distributed as the target's p when it was proposed from the real
    head's q (restricted to its proposal vocabulary), q computed from the target's real features."""
    import numpy as np
    from first_token_law import first_token_law_pvalue
    from specdec.runtime.base import ForwardItem, expand_to_vocab
    from specdec.runtime.torch_llama import TorchLlamaRuntime
    from specdec.sampling import SamplingParams, probabilities
    from specdec.tokenizer import TextTokenizer

    torch.set_num_threads(1)
    prompt = TextTokenizer(TARGET).encode("The three most useful Python data structures are")
    target = TorchLlamaRuntime(TARGET, num_slots=1, max_length=64)
    out = target.forward_outputs([ForwardItem(0, 0, np.asarray(prompt), num_hidden=len(prompt))])[0]
    head = TorchLlamaRuntime(EAGLE, num_slots=1, max_length=64)
    draft = head.forward_outputs([ForwardItem(0, 0, np.asarray(prompt[1:]), features=out.hidden[:-1])])[0]
    assert draft.logits.shape[-1] == len(head.logit_ids) == 4096  # the head's proposal vocabulary's columns
    params = SamplingParams(temperature=1.0)
    q_logits = expand_to_vocab(draft.logits, head.logit_ids, head.vocab_size)
    p, q = probabilities(out.logits[-1], params)[0], probabilities(q_logits[-1], params)[0]
    assert 0.1 < np.minimum(p, q).sum() < 1.0  # the head overlaps the target (0.19 here), and differs from it
    assert first_token_law_pvalue(p, q, draws=60_000) > 1e-3
