"""Distil a small draft for a pretrained target on the target's own answers (``build/target_answers.py``).

The draft is the target's architecture cut to ``--layers`` decoder layers, initialised from the target's
layers ``--init-layers``. It shares the target's token embeddings and, through them, its tied output
layer, restricted to a proposal vocabulary (FR-Spec): the most frequent tokens of the target's answers.
Both are frozen, so only the draft's own layers and final norm are trained and committed
(``draft_layers.safetensors``, a few MB); ``assemble`` adds the target's embeddings at setup.

The loss is cross-entropy against the target's answer tokens (greedy answers: exactly the target's argmax,
what greedy speculation must match), only on answer positions. Held-out answers (by a hash of their id)
give the top-1 agreement per domain, which is α for greedy speculation with k = 1.

Resumable (``<out>/state.pt``), seeded, with progress bars. Usage::

    python build/train_draft.py --target model_repository/target_model/1 --answers data/chat/answers.jsonl \\
        --out runs/draft --layers 1 --steps 2000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from specdec.checkpoint import PROPOSAL_VOCAB_FILE, load_state_dict  # noqa: E402

DRAFT_WEIGHTS = "draft_layers.safetensors"  # the draft's own layers: committed
SHARED_WEIGHTS = "shared_embeddings.safetensors"  # the target's embeddings: written at setup by assemble()
INDEX_FILE = "model.safetensors.index.json"  # lets Hugging Face load the two files as one checkpoint
EMBED_KEY = "model.embed_tokens.weight"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
ASSEMBLED_MARK = "assembled_from.json"


def _held_out(example_id: str, frac: float) -> bool:
    """Held out by a hash of the request id: ``<request id>@<mode>`` answers of one request fall together."""
    request_id = example_id.split("@")[0]
    return int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < frac


def load_answers(paths: list[Path], valid_frac: float, max_len: int) -> tuple[list[dict], list[dict]]:
    """(train, valid) examples ``{"ids", "start", "domain", "mode"[, "labels"]}``; ``start``: first answer
    position. Rows with ``labels`` (``build/target_labels.py``) carry the target's argmax at every position."""
    train, valid, seen = [], [], set()
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("id") in seen or not (row.get("answer_ids") or row.get("labels")):
                continue  # resumed or sharded runs may repeat an id
            seen.add(row["id"])
            if "labels" in row:  # real text with the target's argmax at every position (target_labels.py)
                example = {"ids": row["ids"][:max_len], "labels": row["labels"][:max_len], "start": 0,
                           "domain": row["domain"], "mode": "text", "kind": "labels"}
            else:
                ids = (row["prompt_ids"] + row["answer_ids"])[:max_len]
                example = {"ids": ids, "start": len(row["prompt_ids"]), "domain": row["domain"],
                           "mode": row["mode"], "kind": row.get("kind", "")}
            (valid if _held_out(row["id"], valid_frac) else train).append(example)
    return train, valid


def choose_proposal_vocab(examples: list[dict], size: int, always: list[int]) -> list[int]:
    """The ``size`` most frequent answer tokens, each domain weighted equally, ``always`` included."""
    counts: dict[str, torch.Tensor] = {}
    for ex in examples:
        answer = torch.as_tensor(ex["labels"] if "labels" in ex else ex["ids"][ex["start"]:])
        counts.setdefault(ex["domain"], torch.zeros(0))
        found = torch.bincount(answer).double()
        total = counts[ex["domain"]]
        if total.numel() < found.numel():
            total = F.pad(total, (0, found.numel() - total.numel()))
        total[:found.numel()] += found
        counts[ex["domain"]] = total
    width = max(c.numel() for c in counts.values())
    score = torch.stack([F.pad(c, (0, width - c.numel())) / c.sum() for c in counts.values()]).mean(0)
    score = F.pad(score, (0, max(0, max(always) + 1 - score.numel())))
    score[always] = math.inf
    order = torch.argsort(score, descending=True, stable=True)
    chosen = [int(t) for t in order[:size] if score[t] > 0]
    return sorted(chosen)


class Draft(torch.nn.Module):
    """A cut of the target: frozen shared embeddings and head rows, trainable decoder layers and norm."""

    def __init__(self, target_dir: Path, layers: int, init_layers: list[int], proposal_ids: list[int]) -> None:
        super().__init__()
        from transformers import AutoConfig, LlamaModel

        config = AutoConfig.from_pretrained(str(target_dir))
        config.num_hidden_layers = layers
        self.config = config
        self.decoder = LlamaModel(config)
        state = load_state_dict(target_dir)
        with torch.no_grad():
            self.decoder.embed_tokens.weight.copy_(state[EMBED_KEY].float())
            self.decoder.norm.weight.copy_(state["model.norm.weight"].float())
            for i, source in enumerate(init_layers):
                prefix = f"model.layers.{source}."
                own = {k[len(prefix):]: v.float() for k, v in state.items() if k.startswith(prefix)}
                self.decoder.layers[i].load_state_dict(own)
        self.decoder.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("proposal", torch.as_tensor(proposal_ids, dtype=torch.long), persistent=False)
        # Column of each vocabulary id among the proposal logits, -100 (ignored by the loss) outside it.
        column = torch.full((config.vocab_size,), -100, dtype=torch.long)
        column[self.proposal] = torch.arange(len(proposal_ids))
        self.register_buffer("column", column, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits over the proposal vocabulary, ``[B, T, len(proposal)]``."""
        hidden = self.decoder(input_ids=input_ids).last_hidden_state
        head = self.decoder.embed_tokens.weight[self.proposal]
        return hidden @ head.T

    def own_state(self) -> dict[str, torch.Tensor]:
        """What the draft commits: its layers and final norm under Hugging Face names (no embeddings)."""
        return {f"model.{k}": v.detach().to(torch.bfloat16).contiguous()
                for k, v in self.decoder.state_dict().items() if not k.startswith("embed_tokens")}


def batches(examples: list[dict], tokens_per_batch: int, rng: random.Random):
    """Endless batches of similar-length examples, about ``tokens_per_batch`` padded tokens each."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    groups, group, width = [], [], 0
    for i in order:
        width = max(width, len(examples[i]["ids"]))
        if group and width * (len(group) + 1) > tokens_per_batch:
            groups.append(group)
            group, width = [], len(examples[i]["ids"])
        group.append(i)
    if group:
        groups.append(group)
    while True:
        rng.shuffle(groups)
        yield from ([examples[i] for i in g] for g in groups)


def collate(batch: list[dict], column: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs and labels (proposal columns; -100 off the answer or outside the vocabulary)."""
    width = max(len(ex["ids"]) for ex in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for row, ex in enumerate(batch):
        seq = torch.as_tensor(ex["ids"])
        ids[row, :len(seq)] = seq
        if "labels" in ex:
            labels[row, :len(seq)] = column[torch.as_tensor(ex["labels"])]
            continue
        start = max(ex["start"] - 1, 0)  # position start-1 predicts the first answer token
        labels[row, start:len(seq) - 1] = column[seq[start + 1:]]
    return ids, labels


@torch.no_grad()
def agreement(model: Draft, examples: list[dict], pad_id: int, greedy_only: bool = True) -> dict[str, float]:
    """Per domain: the share of answer tokens where the draft's argmax is the target's token."""
    model.eval()
    hits: dict[str, list[int]] = {}
    for ex in examples:
        if greedy_only and ex["mode"] not in ("greedy", "text"):
            continue
        ids = torch.as_tensor([ex["ids"]])
        pred = model.proposal[model(ids)[0].argmax(-1)]
        if "labels" in ex:  # the target's argmax at every position of real text
            target, key = torch.as_tensor(ex["labels"]), f"{ex['domain']}-text"
        else:  # the target's own answer: position t predicts token t+1
            pred, target, key = pred[:-1], torch.as_tensor(ex["ids"][1:]), ex["domain"]
        answer = torch.zeros(len(target), dtype=torch.bool)
        answer[max(ex["start"] - 1, 0):] = True
        h = hits.setdefault(key, [0, 0])
        h[0] += int((pred == target)[answer].sum())
        h[1] += int(answer.sum())
    model.train()
    return {d: round(h[0] / max(h[1], 1), 4) for d, h in sorted(hits.items())}


def save_draft(model: Draft, proposal_ids: list[int], out: Path) -> None:
    """Write the committed part of the draft: config, own layers, proposal vocabulary."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16")
    config.pop("_name_or_path", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(model.own_state(), str(out / DRAFT_WEIGHTS), metadata={"format": "pt"})
    (out / PROPOSAL_VOCAB_FILE).write_text(json.dumps({"token_ids": proposal_ids}) + "\n", encoding="utf-8")


def assemble(draft_dir: Path, target_dir: Path, own_weights: str = DRAFT_WEIGHTS) -> bool:
    """Complete a committed draft folder (or an EAGLE head's: `own_weights` eagle_layers.safetensors) with the
    target's embeddings and tokenizer (skipped when current).

    Returns True when files were written. The index file lets Hugging Face load the draft as one model.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    source = target_dir / "gguf_source.json"
    stamp = {"target": str(target_dir.resolve()), "source": source.read_text() if source.exists() else None,
             "draft_weights_mtime_ns": (draft_dir / own_weights).stat().st_mtime_ns}
    mark = draft_dir / ASSEMBLED_MARK
    if mark.exists() and json.loads(mark.read_text()) == stamp and (draft_dir / SHARED_WEIGHTS).exists():
        return False
    mark.unlink(missing_ok=True)
    embed = load_state_dict(target_dir)[EMBED_KEY].to(torch.bfloat16).contiguous()
    save_file({EMBED_KEY: embed}, str(draft_dir / SHARED_WEIGHTS), metadata={"format": "pt"})
    with safe_open(str(draft_dir / own_weights), "pt") as f:
        own = list(f.keys())  # noqa: SIM118
    weight_map = {**{k: own_weights for k in own}, EMBED_KEY: SHARED_WEIGHTS}
    (draft_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1) + "\n")
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, draft_dir / name)
    target_generation = target_dir / "generation_config.json"
    if target_generation.exists():
        shutil.copyfile(target_generation, draft_dir / "generation_config.json")
    mark.write_text(json.dumps(stamp) + "\n")
    return True


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("model_repository/target_model/1"))
    ap.add_argument("--answers", type=Path, action="append", default=[], help="answers JSONL (repeatable)")
    ap.add_argument("--out", type=Path, required=True, help="run folder: state.pt, log.jsonl, draft/")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--init-layers", default="0", help="target layers the draft's layers start from")
    ap.add_argument("--proposal-vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--valid-frac", type=float, default=0.04)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-examples", type=int, default=120)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast (CPUs with avx512_bf16 or AMX)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--resume", action="store_true", help="continue from <out>/state.pt")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    answers = args.answers or [Path("data/chat/answers.jsonl")]
    train, valid = load_answers(answers, args.valid_frac, args.max_len)
    config = json.loads((args.target / "config.json").read_text())
    pad_id = int(config.get("pad_token_id") or 0)
    eos = config.get("eos_token_id")
    always = sorted({t for t in [config.get("bos_token_id"), pad_id, *(eos if isinstance(eos, list) else [eos])]
                     if t is not None})
    args.out.mkdir(parents=True, exist_ok=True)
    state_path = args.out / "state.pt"
    resumed = torch.load(state_path, weights_only=False) if args.resume and state_path.exists() else None
    proposal = resumed["proposal"] if resumed else choose_proposal_vocab(train, args.proposal_vocab, always)
    init_layers = [int(x) for x in args.init_layers.split(",")]
    model = Draft(args.target, args.layers, init_layers, proposal)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.98))
    step = 0
    if resumed:
        model.decoder.load_state_dict(resumed["decoder"])
        opt.load_state_dict(resumed["opt"])
        step = resumed["step"]
        rng.setstate(resumed["rng"])
    held_out = [t for ex in valid for t in (ex["labels"] if "labels" in ex else ex["ids"][ex["start"]:])]
    covered = int((model.column[torch.as_tensor(held_out, dtype=torch.long)] >= 0).sum()) if held_out else 0
    total = len(held_out)
    print(f"train {len(train)} answers ({sum(len(e['ids']) - e['start'] for e in train):,} answer tokens), "
          f"valid {len(valid)}; proposal vocabulary {len(proposal)} covers {covered / max(total, 1):.4f} "
          f"of held-out answer tokens", file=sys.stderr)
    # Held-out answers and held-out scored text in equal parts (each reported per domain).
    eval_set = ([ex for ex in valid if "labels" not in ex][:args.eval_examples // 2]
                + [ex for ex in valid if "labels" in ex][:args.eval_examples // 2])
    if step == 0:
        print(f"step 0 agreement {agreement(model, eval_set, pad_id)}", file=sys.stderr)

    def lr_at(s: int) -> float:
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        t = (s - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    stream = batches(train, args.tokens_per_batch, rng)
    for _ in range(step):  # the same batch order after a resume
        next(stream)
    bar = tqdm(total=args.steps, initial=step, desc="draft", disable=not args.progress)
    log = (args.out / "log.jsonl").open("a", encoding="utf-8")
    started = time.monotonic()
    best_file = args.out / "best" / "agreement.json"
    best = -1.0
    if resumed and best_file.exists():
        scores = {k: v for k, v in json.loads(best_file.read_text()).items() if k != "step"}
        best = sum(scores.values()) / max(len(scores), 1)
    while step < args.steps:
        ids, labels = collate(next(stream), model.column, pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        record = {"step": step, "loss": round(loss.item(), 4), "lr": lr_at(step - 1),
                  "elapsed_s": round(time.monotonic() - started, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            record["agreement"] = agreement(model, eval_set, pad_id)
            print(f"step {step} loss {loss.item():.3f} agreement {record['agreement']}", file=sys.stderr)
            score = sum(record["agreement"].values()) / max(len(record["agreement"]), 1)
            if score > best:  # held-out agreement, all domains alike: the draft to install
                best = score
                save_draft(model, proposal, args.out / "best")
                (args.out / "best" / "agreement.json").write_text(json.dumps({"step": step, **record["agreement"]}))
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step % args.ckpt_every == 0 or step == args.steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"decoder": model.decoder.state_dict(), "opt": opt.state_dict(), "step": step,
                        "rng": rng.getstate(), "proposal": proposal, "args": vars(args)}, tmp)
            os.replace(tmp, state_path)
            save_draft(model, proposal, args.out / "draft")
    bar.close()
    print(f"draft in {args.out / 'draft'}, the best held-out one in {args.out / 'best'} (install: copy it into "
          "model_repository/draft_model/1, then build/default_model.py)", file=sys.stderr)


if __name__ == "__main__":
    main()
