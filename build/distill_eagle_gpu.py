"""Distil the EAGLE head on one GPU, in one process and within a time budget: answers, features, training.

On the project's 2-core CPUs a distillation stage (``build/distill_eagle.sh``) spends an hour having the
target answer ~2,000 chat requests and half an hour training 300 steps. A lent GPU does both phases at a
hundred times that rate, within minutes of machine time, so this driver runs them back to back and keeps
everything between them on the GPU (no feature shards on disk):

1. **answers**: the target answers the chat requests of ``--requests`` (``build/chat_requests.py``), greedy
   first, then ``--train-requests`` (earlier stages' requests: trained on, never held out), then a sampled
   answer (temperature 0.7, top-p 0.95, as ``build/target_answers.py``) to each of ``--requests``; Hugging
   Face ``generate`` on length-sorted, left-padded batches in fp32 (TF32 off), until ``--answer-seconds``;
2. **features**: one teacher-forced fp32 forward per batch records every position's final-normed feature and
   the aux layers' outputs (``eagle_features.FeatureRecorder``) into fp16 tensors on the GPU, checking that
   the feature's argmax is the greedy answer's next token (``greedy_match``);
3. **training**: ``train_eagle``'s head, losses and held-out agreement, from ``--init-from`` (the installed
   head), for as many steps as fit in what is left of ``--budget-seconds`` (timed on the first steps; the
   cosine schedule is then fixed). Held out: ``--valid-frac`` of ``--requests`` by a hash of the request id,
   both of its answers (only greedy ones are scored); none of them is trained on. The best held-out head is
   written to ``--out`` as an installable folder whenever it improves, so a run stopped early leaves one.

``--answers`` takes answers made beforehand (``build/target_answers.py`` on a CPU, in the background, to the
same request files): they join the plan's answers as if made here, and the GPU answers only the rest, so its
minutes go to training instead. An answer matches a plan entry by its request id and mode.

Output in ``--out``: ``config.json``, ``eagle_layers.safetensors``, ``proposal_vocab.json`` (the head),
``summary.json`` (counts, rates, agreement at the start and of the best head), ``train_log.jsonl`` and
``answers.jsonl.gz`` (``build/target_answers.py``'s format: ``build/eagle_features.py`` can record them
again on a CPU). Usage (the GPU run's exact command is in docs/MODELS.md, section 6)::

    python build/distill_eagle_gpu.py --target model_repository/target_model/1 \\
        --init-from model_repository/eagle_draft/1 --requests data/gpu/requests.jsonl --out runs/eagle_gpu
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from eagle_features import FeatureRecorder, teacher_forced  # noqa: E402
from specdec.checkpoint import EAGLE_AUX_LAYERS, EAGLE_CONFIG_KEY, PROPOSAL_VOCAB_FILE  # noqa: E402
from target_answers import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, SAMPLED, prompt_ids  # noqa: E402
from train_draft import _held_out, batches  # noqa: E402
from train_eagle import (  # noqa: E402
    EagleHead,
    agreement,
    answer_temperature,
    loss_rows,
    losses,
    sampling_of,
    save_head,
)

MAX_LEN = MAX_PROMPT_TOKENS + max(MAX_NEW_TOKENS.values())


# -------------------------------------------------------------------------------------------------- answers

def answer_plan(tokenizer, requests: list[dict], train_requests: list[dict], valid_frac: float,
                seed: int) -> list[dict]:
    """Every answer to make, in the order made: ``{"id", "request", "prompt_ids", "sampled", "held_out"}``.

    Greedy answers of ``requests``, then of ``train_requests``, then sampled answers of ``requests``: a run cut
    short by its budget has the greedy answers (what greedy speculation predicts) of the new requests first."""
    prompts: dict[str, list[int]] = {}

    def entries(reqs: list[dict], sampled: bool, can_hold_out: bool) -> list[dict]:
        out = []
        for req in reqs:
            if req["id"] not in prompts:
                prompts[req["id"]] = prompt_ids(tokenizer, req)
            ids = prompts[req["id"]]
            if len(ids) > MAX_PROMPT_TOKENS:
                continue
            out.append({"id": req["id"] + ("/sampled" if sampled else ""), "request": req, "prompt_ids": ids,
                        "sampled": sampled, "held_out": can_hold_out and _held_out(req["id"], valid_frac)})
        random.Random(f"{seed}/{len(out)}/{sampled}").shuffle(out)
        return out

    return entries(requests, False, True) + entries(train_requests, False, False) + entries(requests, True, True)


def answers_made_before(plan: list[dict], paths: list[Path]) -> list[dict]:
    """The rows of ``paths`` (``build/target_answers.py``'s jsonl, or .gz) that answer an entry of ``plan``, as
    ``answer`` returns them; the entries they answer are removed from ``plan`` (in place).

    A row matches by its id, its mode and its prompt's token ids. Its id is the plan's (``<file stem>/<id>``,
    as a run's own ``answers.jsonl.gz`` writes it) or the request's own (as ``build/target_answers.py`` writes
    it, or ``<id>@t0.7`` from ``target_answers --sampling``, whose other modes the plan has no entry for):
    request files number their requests alike (``req-000001`` is in every file), so that id alone cannot
    say which request a row answers. Entries of one id, mode and prompt are the same question; a row answers
    the first of them not answered yet."""
    by_key: dict[tuple, list[dict]] = {}
    for entry in plan:
        prompt = tuple(entry["prompt_ids"])
        by_key.setdefault((entry["request"]["id"], entry["sampled"], prompt), []).append(entry)
        by_key.setdefault((entry["request"]["source_id"], entry["sampled"], prompt), []).append(entry)
    rows, answered = [], set()
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut short when its job was stopped
                    continue
                sampled = row["mode"] == "sampled"
                row_id = row["id"].removesuffix("/sampled") if sampled else row["id"]  # the plan's sampled ids
                if "@" in row_id:  # target_answers --sampling: <request id>@<mode>; the plan samples at t0.7 only
                    row_id, mode = row_id.split("@", 1)
                    if mode != "t0.7":
                        continue
                key = (row_id, sampled, tuple(row["prompt_ids"]))
                entry = next((e for e in by_key.get(key, []) if e["id"] not in answered), None)
                if entry is None:
                    continue
                answered.add(entry["id"])
                req = entry["request"]
                rows.append({"id": entry["id"], "domain": req["domain"], "kind": req["kind"], "mode": row["mode"],
                             "prompt_ids": entry["prompt_ids"], "answer_ids": row["answer_ids"],
                             "held_out": entry["held_out"]})
    plan[:] = [entry for entry in plan if entry["id"] not in answered]
    return rows


@torch.inference_mode()
def answer(model, plan: list[dict], eos_ids: list[int], pad_id: int, batch_size: int, deadline: float,
           seed: int, device: torch.device, progress=print) -> list[dict]:
    """Answer the plan's entries in its order, a batch of one domain and mode sorted by prompt length at a time,
    until ``deadline`` (time.monotonic()); returns ``target_answers.py`` rows plus ``held_out``."""
    from transformers import GenerationConfig

    rows: list[dict] = []
    started, made_tokens = time.monotonic(), 0
    # Batches keep the plan's order: the plan is cut into chunks of 8 batches, each chunk grouped by (domain,
    # sampled) and sorted by prompt length, so padding stays small and a cut-off run is still mixed.
    chunk = batch_size * 8
    for first in range(0, len(plan), chunk):
        groups: dict[tuple, list[dict]] = {}
        for entry in plan[first:first + chunk]:
            groups.setdefault((entry["request"]["domain"], entry["sampled"]), []).append(entry)
        for (domain, sampled), entries in sorted(groups.items()):
            entries.sort(key=lambda e: len(e["prompt_ids"]))
            for at in range(0, len(entries), batch_size):
                if time.monotonic() >= deadline:
                    return rows
                batch = entries[at:at + batch_size]
                width = max(len(e["prompt_ids"]) for e in batch)
                ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for b, e in enumerate(batch):  # left padding: every prompt ends where generation starts
                    ids[b, width - len(e["prompt_ids"]):] = torch.as_tensor(e["prompt_ids"])
                    mask[b, width - len(e["prompt_ids"]):] = 1
                config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS[domain], eos_token_id=eos_ids,
                                          pad_token_id=pad_id, do_sample=sampled,
                                          **({**SAMPLED, "top_k": 0} if sampled else {}))
                torch.manual_seed(seed * 1_000_003 + len(rows))
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     generation_config=config)[:, width:].tolist()
                for e, new in zip(batch, out, strict=True):
                    cut = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
                    req = e["request"]
                    rows.append({"id": e["id"], "domain": req["domain"], "kind": req["kind"],
                                 "mode": "sampled" if sampled else "greedy", "prompt_ids": e["prompt_ids"],
                                 "answer_ids": new[:cut], "held_out": e["held_out"]})
                    made_tokens += cut
                elapsed = time.monotonic() - started
                progress(f"answers {len(rows)}/{len(plan)}: {made_tokens:,} tokens in {elapsed:.0f} s "
                         f"({made_tokens / max(elapsed, 1e-9):,.0f} tokens/s)")
    return rows


# ------------------------------------------------------------------------------------------------- features

class FeatureStore:
    """Every recorded position's features on the GPU: ``feats`` [N, H] and ``aux`` [N, layers * H], fp16."""

    def __init__(self, capacity: int, hidden: int, aux_width: int, device: torch.device) -> None:
        self.feats = torch.empty((capacity, hidden), dtype=torch.float16, device=device)
        self.aux = torch.empty((capacity, aux_width), dtype=torch.float16, device=device) if aux_width else None
        self.used = 0

    def add(self, feats: torch.Tensor, aux: torch.Tensor | None) -> int:
        """Append [n, H] (and [n, layers, H]) rows; returns their offset."""
        n, offset = feats.shape[0], self.used
        if offset + n > self.feats.shape[0]:
            raise MemoryError("the feature store is full")
        self.feats[offset:offset + n] = feats.to(torch.float16)
        if self.aux is not None:
            self.aux[offset:offset + n] = aux.reshape(n, -1).to(torch.float16)
        self.used += n
        return offset


def record(recorder: FeatureRecorder, rows: list[dict], store: FeatureStore, tokens_per_batch: int,
           seed: int) -> tuple[list[dict], dict]:
    """Examples (``train_eagle``'s form, ``src`` ("gpu",)) of every answer, their features in ``store``."""
    examples, matched, checked = [], 0, 0
    pending = [{"id": r["id"], "domain": r["domain"], "kind": r["kind"], "mode": r["mode"],
                "ids": (r["prompt_ids"] + r["answer_ids"])[:MAX_LEN], "prompt_len": len(r["prompt_ids"]),
                "held_out": r["held_out"]} for r in rows if r["answer_ids"]]
    started = time.monotonic()
    for ex, hidden, aux, (m, c) in teacher_forced(recorder, pending, tokens_per_batch, seed):
        matched, checked = matched + m, checked + c
        if len(ex["ids"]) - 2 < max(ex["prompt_len"] - 2, 0) + 1:
            continue  # no position to learn from
        offset = store.add(hidden, aux)
        examples.append({"id": ex["id"], "ids": ex["ids"], "start": ex["prompt_len"], "domain": ex["domain"],
                         "mode": ex["mode"], "kind": ex["kind"], "src": ("gpu",), "offset": offset,
                         "held_out": ex["held_out"], "sampling": sampling_of(ex)})
    seconds = time.monotonic() - started
    tokens = sum(len(ex["ids"]) for ex in pending)
    return examples, {"examples": len(examples), "tokens": tokens, "seconds": round(seconds, 1),
                      "tokens_per_s": round(tokens / max(seconds, 1e-9)), "greedy_checked": checked,
                      "greedy_match": round(matched / checked, 5) if checked else None}


def gpu_collate(batch: list[dict], store: FeatureStore) -> dict[str, torch.Tensor]:
    """``train_eagle.collate``'s batch, gathered from the store on its device (padding rows zero)."""
    device = store.feats.device
    width = max(len(ex["ids"]) for ex in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    index = torch.zeros((len(batch), width), dtype=torch.long)
    real = torch.zeros((len(batch), width, 1), dtype=torch.bool)
    for b, ex in enumerate(batch):
        n = len(ex["ids"])
        ids[b, :n] = torch.as_tensor(ex["ids"])
        index[b, :n] = torch.arange(ex["offset"], ex["offset"] + n)
        real[b, :n] = True
    index, real = index.to(device), real.to(device)
    rows, mask = loss_rows(batch)
    out = {"ids": ids.to(device), "feats": store.feats[index].float() * real, "rows": rows.to(device),
           "mask": mask.to(device),
           "temperature": torch.tensor([answer_temperature(ex) for ex in batch], dtype=torch.float32, device=device)}
    if store.aux is not None:
        out["aux"] = store.aux[index].float() * real
    return out


# ------------------------------------------------------------------------------------------------- training

def train(model: EagleHead, train_set: list[dict], eval_set: list[dict], store: FeatureStore, args,
          deadline: float, out: Path, log) -> dict:
    """Train until ``deadline``: the step count is fixed from the first ``args.probe_steps`` steps' time."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    cache: dict = {}
    evaluated = time.monotonic()
    one, two = agreement(model, eval_set, store, args.tokens_per_batch, cache, gpu_collate)
    eval_seconds = time.monotonic() - evaluated
    start = {"step": 0, "agreement": one, "agreement_step2": two, "eval_seconds": round(eval_seconds, 1)}
    log(start)
    best, best_record = _mean(one), {"step": 0, **one, "step2": two}
    save_head(model, model.proposal.tolist(), out, best_record)
    total = None  # fixed after the probe steps
    stream = batches(train_set, args.tokens_per_batch, random.Random(args.seed))
    step, probe_started, started = 0, None, time.monotonic()
    while total is None or step < total:
        if step == 2:  # the first steps compile and warm kernels up: not timed
            probe_started = time.monotonic()
        if step == args.probe_steps + 2:
            per_step = (time.monotonic() - probe_started) / args.probe_steps
            evals = args.evals
            left = deadline - time.monotonic() - (evals + 1) * eval_seconds
            total = max(step + 1, step + int(left / per_step))
            log({"probe": {"seconds_per_step": round(per_step, 4), "steps": total, "evals": evals}})
        lr = _lr(step, total, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = gpu_collate(next(stream), store)
        loss, parts = losses(model, batch, args.feature_weight, args.ttt_weight, False, True,
                             args.answer_temperatures, args.tv_weight)
        opt.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        every = max(1, (total or 10**9) // args.evals)
        if total is not None and ((step % every == 0 and step + every <= total) or step == total):
            one, two = agreement(model, eval_set, store, args.tokens_per_batch, cache, gpu_collate)
            record = {"step": step, "loss": round(loss.item(), 4), **parts, "lr": lr, "agreement": one,
                      "agreement_step2": two, "elapsed_s": round(time.monotonic() - started, 1)}
            log(record)
            if _mean(one) > best:
                best, best_record = _mean(one), {"step": step, **one, "step2": two}
                save_head(model, model.proposal.tolist(), out, best_record)
        elif step % 50 == 0:
            log({"step": step, "loss": round(loss.item(), 4), **parts, "lr": lr,
                 "elapsed_s": round(time.monotonic() - started, 1)})
    return {"start": start, "best": best_record, "steps": step,
            "train_seconds": round(time.monotonic() - started, 1)}


def _mean(scores: dict) -> float:
    return sum(scores.values()) / max(len(scores), 1)


def _lr(step: int, total: int | None, args) -> float:
    """Linear warm-up, then a cosine to ``min_lr_frac`` of the peak over the steps fixed by the probe."""
    if step < args.warmup or total is None:
        return args.lr * min(step + 1, args.warmup) / args.warmup
    t = min((step - args.warmup) / max(1, total - args.warmup), 1.0)
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


# ----------------------------------------------------------------------------------------------------- main

def read_requests(paths: list[Path]) -> list[dict]:
    """Requests of every file, ids made unique across files as ``<file stem>/<id>`` (``source_id``: the id)."""
    out = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                request = json.loads(line)
                out.append({**request, "id": f"{path.stem}/{request['id']}", "source_id": request["id"]})
    return out


def write_answers(rows: list[dict], out: Path) -> None:
    with gzip.open(out / "answers.jsonl.gz", "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: v for k, v in row.items() if k != "held_out"}) + "\n")


def main(argv: list[str] | None = None) -> dict:
    """Command line entry point; returns the summary."""
    from transformers import AutoTokenizer, GenerationConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("model_repository/target_model/1"))
    ap.add_argument("--init-from", type=Path, default=Path("model_repository/eagle_draft/1"),
                    help="the head to train further (its proposal vocabulary and aux layers are kept)")
    ap.add_argument("--requests", type=Path, action="append", required=True,
                    help="chat requests answered greedily and sampled, a share held out (repeatable)")
    ap.add_argument("--train-requests", type=Path, action="append", default=[],
                    help="requests answered greedily after --requests and only trained on (repeatable)")
    ap.add_argument("--answers", type=Path, action="append", default=[],
                    help="answers made beforehand to these requests (build/target_answers.py; repeatable)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-seconds", type=float, default=470.0, help="the whole run, from the model's load")
    ap.add_argument("--answer-seconds", type=float, default=200.0)
    ap.add_argument("--answer-batch", type=int, default=384)
    ap.add_argument("--limit", type=int, default=0, help="answer at most this many (a quick check)")
    ap.add_argument("--capacity-tokens", type=int, default=12_000_000, help="feature rows kept on the device")
    ap.add_argument("--tokens-per-batch", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--feature-weight", type=float, default=0.5)
    ap.add_argument("--ttt-weight", type=float, default=1.0)
    ap.add_argument("--answer-temperatures", action="store_true", help="sampled answers' rows compared at the "
                    "temperature they were sampled at (train_eagle's option)")
    ap.add_argument("--tv-weight", type=float, default=0.0, help="weight of the total variation (train_eagle's)")
    ap.add_argument("--probe-steps", type=int, default=20)
    ap.add_argument("--evals", type=int, default=6, help="held-out evaluations after the start's")
    ap.add_argument("--valid-frac", type=float, default=0.1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=2032)
    args = ap.parse_args(argv)
    began = time.monotonic()
    deadline = began + args.budget_seconds
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the target's answers and features in true fp32
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train_log.jsonl").open("a", encoding="utf-8")

    def log(record) -> None:
        line = record if isinstance(record, str) else json.dumps(record)
        print(f"[{time.monotonic() - began:6.1f}s] {line}", file=sys.stderr, flush=True)
        if not isinstance(record, str):
            log_file.write(line + "\n")
            log_file.flush()

    head_config = json.loads((args.init_from / "config.json").read_text(encoding="utf-8"))
    aux_layers = tuple((head_config.get(EAGLE_CONFIG_KEY) or {}).get(EAGLE_AUX_LAYERS, []))
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    eos = GenerationConfig.from_pretrained(str(args.target)).eos_token_id
    eos_ids = list(eos) if isinstance(eos, list) else [eos]
    plan = answer_plan(tokenizer, read_requests(args.requests), read_requests(args.train_requests),
                       args.valid_frac, args.seed)
    made_before = answers_made_before(plan, args.answers)
    if args.limit:
        plan = plan[:args.limit]
    recorder = FeatureRecorder(args.target, aux_layers=aux_layers, device=args.device)
    log(f"plan: {len(plan)} answers; aux layers {list(aux_layers)}; device {device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'})")
    if made_before:
        log(f"{len(made_before)} answers made beforehand "
            f"({sum(len(r['answer_ids']) for r in made_before):,} tokens); {len(plan)} left to answer")
    rows = made_before + answer(recorder.model, plan, eos_ids, recorder.pad_id, args.answer_batch,
                                began + args.answer_seconds, args.seed, device, log)
    write_answers(rows, args.out)
    answered = {"answers": len(rows), "made_before": len(made_before),
                "answer_tokens": sum(len(r["answer_ids"]) for r in rows),
                "seconds": round(time.monotonic() - began, 1),
                "by_mode": {m: sum(r["mode"] == m for r in rows) for m in ("greedy", "sampled")},
                "by_domain": {d: sum(r["domain"] == d for r in rows) for d in MAX_NEW_TOKENS}}
    log({"answered": answered})
    capacity = min(args.capacity_tokens, sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows))
    store = FeatureStore(capacity, recorder.hidden, len(aux_layers) * recorder.hidden, device)
    examples, recorded = record(recorder, rows, store, args.tokens_per_batch, args.seed)
    log({"recorded": recorded})
    del recorder.model  # the head's turn: the target's weights and its generation cache leave the device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    given = json.loads((args.init_from / PROPOSAL_VOCAB_FILE).read_text(encoding="utf-8"))["token_ids"]
    special = [tokenizer.bos_token_id, recorder.pad_id, *eos_ids]  # as train_eagle: always proposable
    proposal = sorted({int(t) for t in given} | {int(t) for t in special if t is not None})
    train_set = [ex for ex in examples if not ex["held_out"]]
    eval_set = [ex for ex in examples if ex["held_out"] and ex["mode"] == "greedy"]
    rms_sample = store.feats[:min(store.used, 200_000)].float()
    feature_rms = float(rms_sample.pow(2).mean().sqrt())
    model = EagleHead(args.target, proposal, init_from=args.init_from, fc_lr_scale=0.1, feature_rms=feature_rms,
                      aux_layers=aux_layers, seed=args.seed).to(device)
    log(f"train {len(train_set)} examples ({sum(len(e['ids']) for e in train_set):,} tokens), held out "
        f"{len(eval_set)} greedy answers scored; proposal vocabulary {len(proposal)}")
    trained = train(model, train_set, eval_set, store, args, deadline, args.out, log)
    summary = {"answered": answered, "recorded": recorded, "train_examples": len(train_set),
               "eval_examples": len(eval_set), **trained, "args": {k: str(v) for k, v in vars(args).items()},
               "seconds": round(time.monotonic() - began, 1)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    log({"start": trained["start"]["agreement"], "best": trained["best"]})
    return summary


if __name__ == "__main__":
    main()
