"""Greedy output quality of target checkpoints along training: the loop curve of docs/MODELS.md §4.

For each checkpoint (a Hugging Face folder, or a ``build/train.py`` ``state.pt``), the target writes greedy
continuations of held-out document openings, the same prompts and lengths ``build/measure_pair.py`` uses,
and this reports per domain the mean distinct-4-gram ratio (1.0: no repeated 4-gram; loops push it towards
0), the share of continuations whose last quarter repeats one short cycle, the broken characters per 1000
generated tokens (U+FFFD in the decoded text: byte-level tokens that never complete a UTF-8 character, which
is how a target that unlikelihood training pushed too hard escapes its loops, docs/MODELS.md §4, "Target,
fifth session"), and for JSON how many finished documents parse.

Usage: ``python build/greedy_quality.py [--reference] CKPT [CKPT ...] --out curve.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import DOMAINS  # noqa: E402
from measure_pair import GEN_TOKENS, ROOT, distinct4, greedy, json_valid, prompts_for  # noqa: E402

MAX_CYCLE = 32  # longest period (tokens) counted as a loop
REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for bytes that are not valid UTF-8


def tail_cycle(ids: list[int], max_cycle: int = MAX_CYCLE) -> int:
    """Period of the shortest cycle that the last quarter of ``ids`` repeats exactly, or 0 if none."""
    tail = ids[-max(len(ids) // 4, 2 * max_cycle):]
    for period in range(1, max_cycle + 1):
        if len(tail) >= 2 * period and all(tail[i] == tail[i - period] for i in range(period, len(tail))):
            return period
    return 0


def broken_chars(tok, prompt: list[int], cont: list[int]) -> int:
    """U+FFFD characters the continuation adds to the decoded text (prompt and continuation decoded together,
    so a character split across the boundary is not counted)."""
    whole = tok.decode(prompt + cont, skip_special_tokens=True)
    return whole.count(REPLACEMENT_CHAR) - tok.decode(prompt, skip_special_tokens=True).count(REPLACEMENT_CHAR)


def load_target(path: Path):
    """A causal LM from an HF folder or from a training ``state.pt`` (weights and config saved by train.py)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), None
    state = torch.load(path, map_location="cpu", weights_only=False)
    model = LlamaForCausalLM(LlamaConfig.from_dict(state["config"]))
    model.load_state_dict(state["model"])
    return model.float().eval(), {"step": state["step"], "tokens_seen": state["tokens_seen"]}


def quality(model, tok, corpora: Path, prompts: int, prompt_tokens: int) -> dict:
    """Per-domain distinct-4, loop share and JSON validity of greedy continuations (``model`` None: of the
    held-out documents' own continuations, the reference a loop-free writer gives)."""
    out = {}
    for dom in DOMAINS:
        div, loops, finished, valid, broken, generated = [], 0, 0, 0, 0, 0
        for p in prompts_for(dom, corpora, tok, prompts, prompt_tokens, None):
            if model is None:
                cont = (p["rest"] + [tok.eos_token_id])[:GEN_TOKENS[dom]]
            else:
                cont = greedy(model, p["ids"], GEN_TOKENS[dom], tok.eos_token_id)
            div.append(distinct4(cont))
            broken += broken_chars(tok, p["ids"], cont)
            generated += len(cont)
            ended = bool(cont) and cont[-1] == tok.eos_token_id
            loops += (not ended) and tail_cycle(cont) > 0
            if dom == "json" and ended:
                finished += 1
                valid += json_valid(tok.decode(p["ids"] + cont, skip_special_tokens=True))
        out[dom] = {"distinct4_mean": round(statistics.mean(div), 3), "looping": loops, "prompts": len(div),
                    "broken_per_1k_tokens": round(1000 * broken / max(generated, 1), 2)}
        if dom == "json":
            out[dom].update(json_finished=finished, json_valid_of_finished=valid)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", type=Path, nargs="*")
    ap.add_argument("--reference", action="store_true", help="also a row for the held-out documents themselves")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "model_repository" / "target_model" / "1")
    ap.add_argument("--corpora", type=Path, default=ROOT / "data" / "corpora")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts per domain")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(str(args.tokenizer))
    rows = []
    if args.reference:
        rows.append({"checkpoint": "held-out text", **quality(None, tok, args.corpora, args.prompts,
                                                               args.prompt_tokens)})
        print(json.dumps(rows[-1]), flush=True)
    for path in args.checkpoints:
        model, meta = load_target(path)
        row = {"checkpoint": str(path), **(meta or {}),
               **quality(model, tok, args.corpora, args.prompts, args.prompt_tokens)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
