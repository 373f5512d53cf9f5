"""Tiny random checkpoints of every supported model family (specdec.families), built from transformers configs.

Every weight a family adds is randomized away from its neutral value (biases far from 0, q/k norms far from
1, a rope scaling that moves frequencies, a window shorter than the prompts), so a runtime that ignores one
of them disagrees with Hugging Face. Also a small word-level tokenizer, so a pair can be imported into a
model repository (build/import_checkpoint.py needs tokenizer.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 96
SLIDING_WINDOW = 8
SPECIAL_TOKENS = {"<s>": 0, "</s>": 1, "<pad>": 2}
BOS, EOS, PAD = 0, 1, 2
EXTRA_EOS = 3  # Llama 3.x style: more than one end-of-sequence id
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, bos_token_id=BOS, pad_token_id=PAD, eos_token_id=EOS,
)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = ("llama3", "qwen2", "qwen3", "mistral")


def family_config(family: str, num_layers: int, **overrides: Any):
    """The transformers config of a tiny model of `family` (llama3 | qwen2 | qwen3 | mistral)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    args = {**COMMON, "num_hidden_layers": num_layers}
    if family == "llama3":  # untied embeddings, several EOS ids, llama3 rope scaling
        config = LlamaConfig(**{**args, "eos_token_id": [EOS, EXTRA_EOS], "tie_word_embeddings": False,
                                "rope_parameters": dict(LLAMA3_ROPE), **overrides})
    elif family == "qwen2":
        config = Qwen2Config(**{**args, "tie_word_embeddings": True, **overrides})
    elif family == "qwen3":  # head_dim 32, not hidden / heads = 16
        config = Qwen3Config(**{**args, "head_dim": 32, "tie_word_embeddings": True, **overrides})
    elif family == "mistral":
        config = MistralConfig(**{**args, "sliding_window": SLIDING_WINDOW, "tie_word_embeddings": False,
                                  **overrides})
    else:
        raise ValueError(f"unknown family {family!r}")
    return config


def randomize(model, seed: int) -> None:
    """Peaked, input-dependent distributions, and every bias and norm far from its neutral value."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def make_family_checkpoint(path: Path, family: str, num_layers: int, seed: int, tokenizer: bool = False,
                           **overrides: Any) -> Path:
    """Save a random fp32 checkpoint of `family` in Hugging Face format (and a tokenizer if asked)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, num_layers, **overrides), dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path)
    if tokenizer:
        write_word_tokenizer(path)
    return path


def hf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], new_tokens: int, stop_at_eos: bool = False) -> list[int]:
    """Hugging Face `generate(do_sample=False)`: the reference every runtime must equal."""
    import torch

    model = hf_model(path)
    eos = model.config.eos_token_id if stop_at_eos else None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def word_vocab() -> dict[str, int]:
    """Special tokens, then short lowercase words: every token decodes to plain ASCII."""
    words = [f"{a}{b}" for a in "abcdefghijklmnopqrstuvwxyz" for b in "aeiou"]
    vocab = dict(SPECIAL_TOKENS)
    for word in words[: VOCAB_SIZE - len(vocab)]:
        vocab[word] = len(vocab)
    return vocab


def write_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer.json of exactly VOCAB_SIZE tokens (the `tokenizers` library), with <s> prepended
    to every encoding, plus the config files transformers' AutoTokenizer reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel(word_vocab(), unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<pad>", "add_bos_token": False,
    }))
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "pad_token": "<pad>"}))
