"""Train the byte-level BPE tokenizer of the default model pair and save it in Hugging Face format.

Special tokens: ``<pad>`` (0), ``<s>`` (1, BOS, prepended by the post-processor), ``</s>`` (2, EOS and
end id), ``<unk>`` (3, never produced: byte-level BPE covers every byte). The ByteLevel decoder makes
``decode(encode(text))`` return ``text`` exactly.

Usage: ``python build/tokenizer.py --corpora data/corpora --out checkpoints/tokenizer --vocab 8192``
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import DOMAINS, read_jsonl  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
PAD, BOS, EOS, UNK = SPECIAL_TOKENS


def sample_texts(corpora: Path, chars_per_domain: int, seed: int = 0) -> Iterator[str]:
    """Yield training documents, about ``chars_per_domain`` characters from each domain, in a seeded order."""
    rng = random.Random(seed)
    for dom in DOMAINS:
        docs = read_jsonl(corpora / dom / "train.jsonl")
        rng.shuffle(docs)
        taken = 0
        for d in docs:
            if taken >= chars_per_domain:
                break
            taken += len(d["text"])
            yield d["text"]


def train_tokenizer(texts: Iterator[str] | list[str], vocab_size: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return tok


def save_hf(tok, out: Path, model_max_length: int = 2048) -> None:
    """Save ``tok`` as a Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json, ...)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    # Portable files: older transformers (4.x, e.g. genai-perf's) know PreTrainedTokenizerFast, not
    # transformers 5's TokenizersBackend, and read special_tokens_map.json.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.update(add_bos_token=True, add_eos_token=False)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    ap.add_argument("--out", type=Path, default=Path("checkpoints/tokenizer"))
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chars-per-domain", type=int, default=6_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tok = train_tokenizer(sample_texts(args.corpora, args.chars_per_domain, args.seed), args.vocab)
    save_hf(tok, args.out)
    print(f"saved {tok.get_vocab_size()} tokens to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
