"""A non-Llama pair through a real tritonserver: greedy output equals Hugging Face generate, plain and speculative.

The target is a tiny random Mistral with a sliding window of 8 (prompts are longer), the draft a Qwen2 with
q/k/v biases (tests/family_checkpoints.py), imported with build/import_checkpoint.py's import_pair into a
model repository copied to a tmp folder (the repository's configs and model.py files, not its checkpoints).
The decoders run the deployment's runtime (onnxruntime on the CPU default: the export happens at load).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from specdec_client.api import generate_grpc
from specdec_client.server import start_on_free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tests"))
sys.path.insert(0, str(REPO_ROOT / "build"))

from family_checkpoints import (  # noqa: E402
    family_config,
    hf_model,
    make_family_checkpoint,
    word_vocab,
    write_word_tokenizer,
)

pytestmark = pytest.mark.integration
MAX_TOKENS = 24


def prompts() -> list[str]:
    words = [w for w in word_vocab() if not w.startswith("<")]
    return [" ".join(words[(7 * i + 3 * j) % len(words)] for j in range(12 + 3 * i)) for i in range(4)]


def make_qwen2_draft(path: Path, target: Path) -> Path:
    """A Qwen2 draft close to the Mistral target (its weights, small q/k/v biases, no window), so most drafts
    are accepted and both acceptance and rejection paths run."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = family_config("qwen2", num_layers=2, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, _ = model.load_state_dict(load_file(str(target / "model.safetensors")), strict=False)
    assert missing and all(name.endswith("_proj.bias") for name in missing)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(path)
    write_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def family_server(tmp_path_factory):
    from import_checkpoint import import_pair

    root = tmp_path_factory.mktemp("family_pair")
    target = make_family_checkpoint(root / "mistral", "mistral", num_layers=2, seed=21, tokenizer=True)
    draft = make_qwen2_draft(root / "qwen2", target)
    repo = root / "model_repository"
    import_pair(target, draft, repo)  # a new repository from the project's configs and model.py files
    server = start_on_free_ports(repo, root / "server.log")
    yield server, target
    server.stop()


def hf_text(model_dir: Path, prompt: str) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = hf_model(model_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=model.config.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_mistral_target_with_qwen2_draft_equals_hugging_face(family_server):
    server, target = family_server
    drafted = accepted = 0
    for prompt in prompts():
        expected = hf_text(target, prompt)
        assert expected, prompt  # the reference generated something to compare
        for k in (0, 4):
            result = generate_grpc(server.grpc_url, {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                                     "num_draft_tokens": k, "exclude_input_in_output": True})
            assert result.text == expected, (k, prompt)
            if k:
                drafted += result.stats["total_draft_tokens"]
                accepted += result.stats["total_accepted_draft_tokens"]
    assert drafted > 0 and 0 < accepted < drafted  # speculation ran, accepting some drafts, rejecting others
