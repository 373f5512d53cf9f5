"""Make a corpus of the target's own greedy continuations, to fine-tune the draft on what it must predict.

Prompts are ``<s>`` plus a slice of a training document (from its start, or from a random offset), the
target continues each greedily with a KV cache, in batches of equal prompt length (no padding needed).
Output: ``<out>/<domain>/{train,valid}.jsonl`` with token ids (``"ids"``) next to the decoded text, a layout
``build/train.py --corpora`` reads directly (it uses ``ids`` when present).

Usage: ``python build/greedy_corpus.py --target checkpoints/target/hf --out data/greedy --sequences 256``
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import DOMAINS, read_jsonl, write_jsonl  # noqa: E402
from train import bf16_autocast  # noqa: E402

GEN_TOKENS = {"json": 160, "code": 256, "prose": 320}


@torch.no_grad()
def greedy_batch(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy continuations (``[B, n]``) of equal-length ``prompts`` (``[B, P]``) with a KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with bf16_autocast():
        logits = model(input_ids=prompts, past_key_values=cache, use_cache=True).logits
    out = []
    for _ in range(n):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
        with bf16_autocast():
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
    return torch.cat(out, dim=1)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    ap.add_argument("--out", type=Path, default=Path("data/greedy"))
    ap.add_argument("--sequences", type=int, default=256, help="continuations per domain")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=0, help="tokens per continuation (0: per domain default)")
    ap.add_argument("--valid-frac", type=float, default=0.05)
    ap.add_argument("--domains", default=",".join(DOMAINS))
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    model = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(args.target))
    eos = tok.eos_token_id
    for dom in args.domains.split(","):
        docs = read_jsonl(args.corpora / dom / "train.jsonl")
        made: list[dict] = []
        bar = tqdm(total=args.sequences, desc=dom)
        while len(made) < args.sequences:
            plen = rng.choice([8, 16, 24, 32, 48, 64])
            rows: list[list[int]] = []
            tries = 0
            while len(rows) < args.batch:
                tries += 1
                if tries > 50 * args.batch:  # documents too short for this prompt length
                    plen, rows, tries = max(2, plen // 2), [], 0
                ids = tok(rng.choice(docs)["text"], add_special_tokens=False)["input_ids"]
                if len(ids) < plen:
                    continue
                off = 0 if rng.random() < 0.5 else rng.randrange(0, len(ids) - plen + 1)
                rows.append([tok.bos_token_id] + ids[off:off + plen - 1])
            cont = greedy_batch(model, torch.tensor(rows), args.gen_tokens or GEN_TOKENS.get(dom, 256)).tolist()
            for prompt, c in zip(rows, cont, strict=True):
                if eos in c:
                    c = c[:c.index(eos) + 1]
                ids = prompt + c
                made.append({"id": f"greedy-{dom}/{len(made):05d}", "source": f"greedy-{dom}", "ids": ids,
                             "text": tok.decode(ids, skip_special_tokens=True)})
            bar.update(len(rows))
        bar.close()
        n_valid = max(1, int(len(made) * args.valid_frac))
        write_jsonl(args.out / dom / "valid.jsonl", made[:n_valid])
        write_jsonl(args.out / dom / "train.jsonl", made[n_valid:])


if __name__ == "__main__":
    main()
