"""The real default pair through a real tritonserver: SmolLM2-135M-Instruct and the draft trained for it.

Chat requests (the target's own chat template) in the three domains, none of them a training request:
speculative greedy decoding equals plain greedy decoding token for token, streaming too; plain decoding is the
served graph's (the target's own GGUF blocks) decoded in process, and the conversion's fp32 export equals
Hugging Face ``generate(do_sample=False)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from specdec_client.api import generate_grpc
from specdec_client.server import start_on_free_ports
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"
TARGET_DIR = DEFAULT_REPOSITORY / "target_model" / "1"
MAX_TOKENS = 40
TREE_NODES = 6  # the dynamic tree of tree_server's profiles
CHAT_REQUESTS = {
    "json": ["Return a JSON object for a library member with the keys name, member_id and books_borrowed.",
             "Write a JSON array with two planets, each with name and moons.",
             "Give me a JSON object describing a bicycle: brand, gears, weight_kg.",
             "Convert to JSON: the city Lyon has 522000 inhabitants and is in France."],
    "code": ["Write a Python function that returns the factorial of n.",
             "Write a Python function `is_palindrome(s)` that ignores case.",
             "Write Python code that reads a CSV file and prints the number of rows.",
             "Write a Python function that merges two sorted lists."],
    "prose": ["Write a short paragraph about autumn leaves.",
              "Explain in a few sentences why the sky is blue.",
              "Describe a quiet harbour at sunrise.",
              "What makes a good teacher? Answer in a few sentences."],
}


@pytest.fixture(scope="module")
def tokenizer():
    if not (TARGET_DIR / "model.safetensors").is_file():
        pytest.fail("the default target is not installed: run `make setup` (build/default_model.py)")
    return AutoTokenizer.from_pretrained(TARGET_DIR)


@pytest.fixture(scope="module")
def chat_prompts(tokenizer) -> list[tuple[str, str]]:
    return [(domain, tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True))
            for domain, texts in CHAT_REQUESTS.items() for text in texts]


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory):
    server = start_on_free_ports(DEFAULT_REPOSITORY, tmp_path_factory.mktemp("default_model") / "server.log",
                                 timeout_s=400)
    yield server
    server.stop()


def _generate(server, prompt: str, on_text=None, **params):
    return generate_grpc(server.grpc_url, {"text_input": prompt, "max_tokens": MAX_TOKENS,
                                           "exclude_input_in_output": True, **params}, on_text=on_text)


@pytest.fixture(scope="module")
def plain(default_server, chat_prompts):
    return {prompt: _generate(default_server, prompt, num_draft_tokens=0) for _, prompt in chat_prompts}


def test_chat_template_text_tokenizes_like_the_template(tokenizer, chat_prompts) -> None:
    """The text the client sends becomes exactly the template's token ids on the server side."""
    from specdec.tokenizer import TextTokenizer

    served = TextTokenizer(TARGET_DIR)
    for domain, texts in CHAT_REQUESTS.items():
        for text, (_, prompt) in zip(texts, [p for p in chat_prompts if p[0] == domain], strict=True):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                add_generation_prompt=True, return_dict=True)["input_ids"]
            assert served.encode(prompt) == list(ids)


def _greedy_in_process(runtime, ids: list[int], end_ids: frozenset[int]) -> list[int]:
    """Plain greedy decoding on one slot of an onnxruntime runtime, in this process."""
    from specdec.runtime.base import ForwardItem

    logits, out = runtime.forward([ForwardItem(0, 0, np.asarray(ids))])[0], []
    while len(out) < MAX_TOKENS:
        out.append(int(logits[-1].argmax()))
        if out[-1] in end_ids:
            break
        logits = runtime.forward([ForwardItem(0, len(ids) + len(out) - 1, np.asarray(out[-1:]))])[0]
    return out


def test_the_target_is_served_from_its_gguf_blocks_and_plain_greedy_is_that_graphs(tokenizer, chat_prompts,
                                                                                     plain) -> None:
    """The default target came from a Q4_1 GGUF file, so it is served from that file's blocks (weight_quantization
    auto); the server's plain greedy answers are that graph's, decoded in this process."""
    from specdec.checkpoint import read_end_ids
    from specdec.runtime import choose_weights
    from specdec.runtime.onnx_llama import OnnxLlamaRuntime

    assert choose_weights("target", "onnxruntime", "auto", TARGET_DIR)[0] == "gguf"
    runtime = OnnxLlamaRuntime(TARGET_DIR, num_slots=1, num_threads=2, weight_quantization="gguf")
    end_ids = read_end_ids(TARGET_DIR)
    for _, prompt in chat_prompts:
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        expected = tokenizer.decode(_greedy_in_process(runtime, ids, end_ids), skip_special_tokens=True)
        assert plain[prompt].text == expected, prompt
        assert plain[prompt].text.strip(), f"empty answer to {prompt!r}"


def test_the_fp32_export_equals_hugging_face_generate(tokenizer, chat_prompts) -> None:
    """weight_quantization none serves the conversion's fp32 export: Hugging Face's greedy answers."""
    from specdec.checkpoint import read_end_ids
    from specdec.runtime.onnx_llama import OnnxLlamaRuntime

    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    runtime = OnnxLlamaRuntime(TARGET_DIR, num_slots=1, num_threads=2)
    end_ids = read_end_ids(TARGET_DIR)
    for _, prompt in chat_prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=sorted(end_ids), pad_token_id=tokenizer.pad_token_id)
        assert _greedy_in_process(runtime, ids[0].tolist(), end_ids) == out[0, ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("num_draft_tokens", [None, 4])
def test_speculative_greedy_equals_plain(default_server, chat_prompts, plain, num_draft_tokens) -> None:
    """None: the task profile's own speculation length and tree; 4: a chain-length override."""
    accepted = 0
    for domain, prompt in chat_prompts:
        params = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
        result = _generate(default_server, prompt, **params)
        assert result.text == plain[prompt].text, (domain, prompt)
        accepted += result.stats["total_accepted_draft_tokens"]
    assert accepted > 0, "the trained draft never had a token accepted"


def test_streaming_speculation_equals_plain(default_server, chat_prompts, plain) -> None:
    for _, prompt in chat_prompts:
        chunks: list[str] = []
        result = _generate(default_server, prompt, stream=True, on_text=chunks.append)
        assert len(chunks) > 1, "a streamed answer arrives in several responses"
        assert "".join(chunks) == plain[prompt].text == result.text


def test_profiles_name_this_draft() -> None:
    """The draft in the repository is the one trained for this target (same vocabulary, fewer layers)."""
    target = json.loads((TARGET_DIR / "config.json").read_text())
    draft = json.loads((DEFAULT_REPOSITORY / "draft_model" / "1" / "config.json").read_text())
    assert draft["vocab_size"] == target["vocab_size"] and draft["hidden_size"] == target["hidden_size"]
    assert draft["num_hidden_layers"] < target["num_hidden_layers"]


EAGLE_DIR = DEFAULT_REPOSITORY / "eagle_draft" / "1"


@pytest.mark.parametrize(("num_draft_tokens", "num_candidates"), [(1, 1), (3, 1), (5, 1), (3, 2), (2, 3)])
def test_eagle_greedy_equals_plain(default_server, chat_prompts, plain, num_draft_tokens, num_candidates) -> None:
    """The EAGLE head (reading the target's features) through the server, chains and trees of several k."""
    accepted = 0
    for domain, prompt in chat_prompts[::2]:
        result = _generate(default_server, prompt, drafter="eagle", num_draft_tokens=num_draft_tokens,
                           num_candidates=num_candidates)
        assert result.text == plain[prompt].text, (domain, prompt, num_draft_tokens, num_candidates)
        assert result.drafter_used == "eagle" and not result.stats["fallback_active"]
        accepted += result.stats["total_accepted_draft_tokens"]
    assert accepted > 0, "the EAGLE head never had a token accepted"


def test_eagle_streaming_and_sampling(default_server, chat_prompts, plain) -> None:
    """Streaming with the head equals plain; a sampled request with rejection sampling runs on the head's q."""
    _, prompt = chat_prompts[0]
    chunks: list[str] = []
    result = _generate(default_server, prompt, drafter="eagle", stream=True, on_text=chunks.append)
    assert len(chunks) > 1 and "".join(chunks) == plain[prompt].text == result.text
    sampled = _generate(default_server, prompt, drafter="eagle", temperature=0.8, top_p=0.95, seed=11,
                        acceptance="rejection")
    again = _generate(default_server, prompt, drafter="eagle", temperature=0.8, top_p=0.95, seed=11,
                      acceptance="rejection")
    assert sampled.text == again.text and sampled.text.strip()
    assert sampled.stats["total_draft_tokens"] > 0 and sampled.drafter_used == "eagle"


@pytest.mark.parametrize("drafter", ["eagle+ngram", "model+ngram"])
def test_prompt_lookup_in_front_of_each_model_drafter_equals_plain(default_server, chat_prompts, plain,
                                                                   drafter) -> None:
    """Prompt lookup first, the model drafter where it finds nothing: greedy equals plain, streaming too, and
    a sampled request (rejection sampling on lookup's one-hot q and the model's q) is reproducible by seed."""
    for domain, prompt in chat_prompts[1::2]:
        result = _generate(default_server, prompt, drafter=drafter)
        assert result.text == plain[prompt].text, (domain, prompt, drafter)
        assert result.drafter_used == drafter and not result.stats["fallback_active"]
    _, prompt = chat_prompts[4]
    chunks: list[str] = []
    streamed = _generate(default_server, prompt, drafter=drafter, stream=True, on_text=chunks.append)
    assert len(chunks) > 1 and "".join(chunks) == plain[prompt].text == streamed.text
    sampled = [_generate(default_server, prompt, drafter=drafter, temperature=0.8, top_p=0.95, seed=5,
                         acceptance="rejection") for _ in range(2)]
    assert sampled[0].text == sampled[1].text and sampled[0].text.strip()
    assert sampled[0].stats["total_draft_tokens"] > 0


def _server_with_profiles(root: Path, changes: dict):
    """The default repository (files linked) with `changes` made to its speculation profiles."""
    for model in DEFAULT_REPOSITORY.iterdir():
        if not (model / "config.pbtxt").is_file():
            continue
        version = root / model.name / "1"
        version.mkdir(parents=True)
        (root / model.name / "config.pbtxt").symlink_to(model / "config.pbtxt")
        for item in (model / "1").iterdir():
            if item.name not in ("__pycache__", "profiles.yaml"):
                (version / item.name).symlink_to(item)
    profiles = DEFAULT_REPOSITORY / "speculative_decoding" / "1" / "profiles.yaml"
    raw = yaml.safe_load(profiles.read_text(encoding="utf-8"))
    raw["speculative_decoding"].update(changes)
    (root / "speculative_decoding" / "1" / "profiles.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    return start_on_free_ports(root, root.parent / "server.log", timeout_s=400)


@pytest.fixture(scope="module")
def tree_server(tmp_path_factory: pytest.TempPathFactory):
    """The default repository with dynamic EAGLE trees in every task profile (TREE_NODES nodes, 2 per level)."""
    server = _server_with_profiles(tmp_path_factory.mktemp("tree") / "repository",
                                   {"dynamic_tree": {"nodes": TREE_NODES, "depth": 4, "width": 2}})
    yield server
    server.stop()


def test_dynamic_trees_through_the_server_stay_lossless(tree_server, chat_prompts, plain) -> None:
    """dynamic_tree through the server (tree_nodes in, draft_parents out of eagle_draft's BLS calls, the
    target verifying the tree): greedy equals plain in every domain, streaming too."""
    for domain, prompt in chat_prompts[::2]:
        result = _generate(tree_server, prompt, drafter="eagle", num_draft_tokens=4)
        assert result.text == plain[prompt].text, (domain, prompt)
        assert result.drafter_used == "eagle" and result.stats["total_draft_tokens"] > 0
    pieces: list[str] = []
    domain, prompt = chat_prompts[1]
    streamed = _generate(tree_server, prompt, stream=True, on_text=pieces.append, drafter="eagle+ngram")
    assert len(pieces) > 1 and "".join(pieces) == streamed.text == plain[prompt].text, (domain, prompt)


def test_eagle_head_is_trained_for_this_target() -> None:
    target = json.loads((TARGET_DIR / "config.json").read_text())
    head = json.loads((EAGLE_DIR / "config.json").read_text())
    assert head["vocab_size"] == target["vocab_size"] and head["hidden_size"] == target["hidden_size"]
    # Its feature: the target's final one and the layers it fuses (EAGLE-3), which the target returns (setup).
    fused = head["specdec_eagle"].get("aux_layers", [])
    assert target.get("specdec_feature_layers", []) == fused
    assert head["num_hidden_layers"] == 1 and head["specdec_eagle"]["feature_size"] == target["hidden_size"] * (
        1 + len(fused))
