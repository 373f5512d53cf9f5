"""The target's argmax at every position of real training text: cheap labels for the draft.

Generating answers (``build/target_answers.py``) costs one target step per label; scoring a document costs
one batched forward for all of its positions, several times fewer CPU seconds per label on these machines.
The labels are what greedy speculation on a raw-text prompt must match: the target's next token given the
document so far. Windows are cut from the training split of ``build/corpora.py`` (never the validation split
the benchmark prompts come from).

Output: one JSON object a line, ``{"id", "domain", "ids", "labels"}`` (``labels[t]``: the target's argmax
after ``ids[:t + 1]``), appended and resumable like the answers. Usage::

    python build/target_labels.py --target model_repository/target_model/1 --out data/chat/labels.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import DOMAINS, read_jsonl  # noqa: E402
from target_answers import done_ids  # noqa: E402


def windows(corpora: Path, tokenizer, per_domain: int, length: int, seed: int) -> list[dict]:
    """``per_domain`` windows of ``length`` tokens per domain, from seeded random offsets of documents."""
    rng = random.Random(seed)
    out = []
    for domain in DOMAINS:
        docs = read_jsonl(corpora / domain / "train.jsonl")
        made = 0
        while made < per_domain:
            ids = tokenizer(rng.choice(docs)["text"], add_special_tokens=False)["input_ids"]
            if len(ids) < length // 4:
                continue
            start = 0 if rng.random() < 0.3 or len(ids) <= length else rng.randrange(0, len(ids) - length)
            out.append({"id": f"label-{domain}-{made:06d}", "domain": domain, "ids": ids[start:start + length]})
            made += 1
    return out


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("model_repository/target_model/1"))
    ap.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    ap.add_argument("--out", type=Path, default=Path("data/chat/labels.jsonl"))
    ap.add_argument("--per-domain", type=int, default=2000)
    ap.add_argument("--length", type=int, default=384)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast: labels then differ at near-ties")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    model = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    todo = windows(args.corpora, tokenizer, args.per_domain, args.length, args.seed)
    random.Random(args.seed).shuffle(todo)
    skip = done_ids(args.out)
    todo = [w for w in todo if w["id"] not in skip]
    todo.sort(key=lambda w: len(w["ids"]))  # similar lengths together: little padding
    groups = [todo[i:i + args.batch] for i in range(0, len(todo), args.batch)]
    random.Random(args.seed + 1).shuffle(groups)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pad = tokenizer.pad_token_id or 0
    with args.out.open("a", encoding="utf-8") as out, torch.inference_mode(), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
        for group in tqdm(groups, desc="labels", unit="batch"):
            width = max(len(w["ids"]) for w in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            for row, w in enumerate(group):
                ids[row, :len(w["ids"])] = torch.as_tensor(w["ids"])
            labels = model(input_ids=ids).logits.argmax(-1)  # right padding: real positions are unaffected
            for row, w in enumerate(group):
                out.write(json.dumps({**w, "labels": labels[row, :len(w["ids"])].tolist()}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
