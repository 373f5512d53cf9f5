"""Where the EAGLE head's first guess misses on the target's greedy answers to the held-out chat requests, and how
many of those tokens it could not have proposed at all (outside its proposal vocabulary).

For each domain: the target (Hugging Face, fp32) answers the first ``--prompts`` bench chat requests greedily,
then runs teacher-forced over prompt + answer with ``output_hidden_states``; the installed head reads those
features (its fused layers too) and guesses every answer token from the row before (step 1, as when it drafts
the first token). Printed per domain:

- ``agree``: the head's argmax over its proposal vocabulary equals the target's token (α at k = 1, greedy);
- ``agree_full``: the same over the whole vocabulary (what scoring every token would give this head);
- ``outside``: answer tokens outside the proposal vocabulary; ``outside_seen``: of those, ones already in the
  context (prompt or earlier answer) as the same id; ``outside_variant``: ones whose form with / without a
  leading space or with the other case of the first letter is in the context (a key copied from the prompt).

``--show`` prints each answer with its misses as ``[target's token|head's guess]``. Nothing here is trained or
selected on these requests. Usage::

    python build/measure_head_misses.py --prompts 8 --domains json,code,prose --show
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_backend"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specdec.checkpoint import EAGLE_CONFIG_KEY, load_state_dict  # noqa: E402
from train_eagle import EagleHead  # noqa: E402

PROMPTS = ROOT / "client/specdec_client/prompts/bench_chat.json"
REPOSITORY = ROOT / "model_repository"
NEW_TOKENS = {"json": 128, "code": 256, "prose": 512}  # the benchmark's scenario lengths


def spelling_variants(token_id: int, vocab: dict[str, int], spelling: dict[int, str]) -> set[int]:
    """Ids of the token's text with a leading space added or removed, or its first letter's case flipped."""
    text = spelling[token_id]
    forms = {text[1:] if text.startswith("Ġ") else "Ġ" + text, text[:1].swapcase() + text[1:]}
    return {vocab[form] for form in forms if form in vocab} - {token_id}


def load_head(repository: Path) -> EagleHead:
    folder = repository / "eagle_draft/1"
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vocab = json.loads((folder / "proposal_vocab.json").read_text(encoding="utf-8"))
    ids = vocab["token_ids"] if isinstance(vocab, dict) else vocab
    head = EagleHead(repository / "target_model/1", ids,
                     aux_layers=tuple(config[EAGLE_CONFIG_KEY].get("aux_layers", ())))
    head.load_own({k: v for k, v in load_state_dict(folder).items() if not k.startswith("model.embed_tokens")})
    return head.eval()


@torch.no_grad()
def measure(domain: str, prompts: list[dict], target, tokenizer, head: EagleHead, show: bool) -> dict[str, float]:
    vocab = tokenizer.get_vocab()
    spelling = {i: s for s, i in vocab.items()}
    proposal = set(head.proposal.tolist())
    layers = [layer + 1 for layer in head.aux_layers]  # hidden_states[i + 1] is decoder layer i's output
    counts = dict(tokens=0, agree=0, agree_full=0, outside=0, outside_seen=0, outside_variant=0)
    for request in prompts:
        prompt = tokenizer(request["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
        ids = target.generate(prompt, max_new_tokens=NEW_TOKENS[domain], do_sample=False)
        states = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in layers], -1).float() if layers else None
        rows = torch.arange(ids.shape[1] - 1)[None]
        g, _ = head(ids, states[-1].float(), rows, ttt=False, aux=aux)  # g[j] predicts token j + 2
        guess = head.proposal[head.logits(g[0]).argmax(-1)].tolist()
        guess_full = (g[0].float() @ head.embed.float().T).argmax(-1).tolist()
        tokens = ids[0].tolist()
        seen = set(tokens[:prompt.shape[1]])
        variants = {v for t in seen for v in spelling_variants(t, vocab, spelling)}
        marked = []
        for position in range(prompt.shape[1], len(tokens)):
            token, predicted = tokens[position], guess[position - 2]
            counts["tokens"] += 1
            counts["agree"] += predicted == token
            counts["agree_full"] += guess_full[position - 2] == token
            if token not in proposal:
                counts["outside"] += 1
                counts["outside_seen"] += token in seen
                counts["outside_variant"] += token not in seen and token in variants
            seen.add(token)
            variants |= spelling_variants(token, vocab, spelling)
            text = tokenizer.decode([token])
            marked.append(text if predicted == token else f"[{text}|{tokenizer.decode([predicted])}]")
        if show:
            print(f"--- {request['id']}\n{''.join(marked)}\n")
    shares = {key: round(value / max(counts["tokens"], 1), 3) for key, value in counts.items() if key != "tokens"}
    return {"tokens": counts["tokens"], **shares}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="requests per domain (the first of each)")
    ap.add_argument("--domains", default="json,code,prose")
    ap.add_argument("--repository", type=Path, default=REPOSITORY)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", action="store_true", help="print every answer with the head's misses marked")
    args = ap.parse_args(argv)
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    unknown = sorted(set(domains) - set(NEW_TOKENS))
    if unknown:
        ap.error(f"unknown domain(s) {unknown}; choose from {sorted(NEW_TOKENS)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    target_dir = args.repository / "target_model/1"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = load_head(args.repository)
    scenarios = json.loads(PROMPTS.read_text(encoding="utf-8"))["scenarios"]
    results = {}
    for domain in domains:
        prompts = scenarios[domain]
        prompts = prompts["prompts"] if isinstance(prompts, dict) else prompts
        results[domain] = measure(domain, prompts[:args.prompts], target, tokenizer, head, args.show)
        print(domain, json.dumps(results[domain]), flush=True)
    return results


if __name__ == "__main__":
    main()
