"""Choose the draft's proposal vocabulary: the most frequent tokens of the corpora (FR-Spec, arXiv:2502.14856).

A 1-layer draft spends most of its step in the output layer (hidden x vocabulary); restricting that layer to
the tokens that make up almost all of the text cuts the draft's step, hence c, at a small cost in α (a token
outside the subset can never be proposed, the target then supplies it). Tokens are ranked by their frequency
averaged over the domains (each domain weighs the same, whatever its size) in the training splits, plus any
``--extra`` corpora (e.g. the target's greedy continuations from ``build/greedy_corpus.py``); the special
tokens are always kept. Writes ``proposal_vocab.json`` (read by ``specdec.checkpoint.read_proposal_vocab``)
and prints the coverage of each domain's held-out split.

Usage: ``python build/draft_vocab.py --draft model_repository/draft_model/1 --size 2048``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from specdec.checkpoint import PROPOSAL_VOCAB_FILE  # noqa: E402
from train import tokenize_split  # noqa: E402


def domain_frequencies(tokenizer, corpora: list[Path], split: str, cache: Path) -> dict[str, np.ndarray]:
    """Relative token frequencies per domain (``<corpus>/<domain>/<split>.jsonl``), corpora pooled."""
    counts: dict[str, np.ndarray] = {}
    for root in corpora:
        for path in sorted(root.glob(f"*/{split}.jsonl")):
            stream = tokenize_split(tokenizer, path, cache)
            found = np.bincount(stream, minlength=len(tokenizer)).astype(np.float64)
            counts[path.parent.name] = counts.get(path.parent.name, 0) + found
    return {name: c / c.sum() for name, c in counts.items()}


def choose(freqs: dict[str, np.ndarray], size: int, always: list[int]) -> list[int]:
    """The `size` tokens of highest domain-averaged frequency, `always` included; sorted ids."""
    score = np.mean(np.stack(list(freqs.values())), axis=0)
    score[always] = np.inf
    order = np.argsort(-score, kind="stable")
    return sorted(int(t) for t in order[:size])


def coverage(freqs: dict[str, np.ndarray], token_ids: list[int]) -> dict[str, float]:
    """Per domain, the fraction of its tokens that lie in the subset."""
    return {name: round(float(f[token_ids].sum()), 4) for name, f in freqs.items()}


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, required=True, help="draft checkpoint folder (gets proposal_vocab.json)")
    ap.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    ap.add_argument("--extra", type=Path, action="append", default=[], help="more corpora (same layout)")
    ap.add_argument("--cache", type=Path, default=Path("data/tokens"))
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--remove", action="store_true", help="delete the draft's proposal vocabulary instead")
    args = ap.parse_args(argv)

    out = args.draft / PROPOSAL_VOCAB_FILE
    if args.remove:
        out.unlink(missing_ok=True)
        print(f"removed {out}")
        return
    tokenizer = AutoTokenizer.from_pretrained(str(args.draft))
    if not 0 < args.size <= len(tokenizer):
        ap.error(f"--size must be in 1..{len(tokenizer)}")
    train = domain_frequencies(tokenizer, [args.corpora, *args.extra], "train", args.cache)
    valid = domain_frequencies(tokenizer, [args.corpora], "valid", args.cache)
    always = sorted({t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
                     if t is not None})
    token_ids = choose(train, args.size, always)
    report = {
        "size": len(token_ids),
        "vocab_size": len(tokenizer),
        "ranked_on": [str(p) for p in [args.corpora, *args.extra]],
        "coverage_train": coverage(train, token_ids),
        "coverage_held_out": coverage(valid, token_ids),
    }
    out.write_text(json.dumps({**report, "token_ids": token_ids}) + "\n", encoding="utf-8")
    print(json.dumps({**report, "written": str(out)}, indent=2))


if __name__ == "__main__":
    main()
