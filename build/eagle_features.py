"""Record the target's features for training an EAGLE draft head (``build/train_eagle.py``).

The feature of position t is the target's final-normed hidden state f_t, the vector its output layer reads
(``logits_t = f_t @ E^T``). One teacher-forced, batched fp32 forward of the target per group of
similar-length examples records f_t at every position of:

* the target's answers (``build/target_answers.py``, JSONL or gzipped: ``{"id", "domain", "kind", "mode",
  "prompt_ids", "answer_ids"}``), prompt and answer, greedy and sampled alike (the head's soft labels come from
  f itself);
* optionally, windows of real training text (``--text-per-domain``), cut as ``build/target_labels.py`` cuts them.

With ``--aux-layers`` (EAGLE-3's multi-layer fusion), the outputs of those decoder layers (the residual stream
before the next layer, unnormalized) are recorded too, in ``aux_NNNNN.npy`` (float16 ``[tokens, layers,
hidden]``, rows as in the features shard); ``aux_layers.json`` names the layers.

On greedy answers the recorded features are checked: ``argmax(f_t @ E^T)`` must be the answer's next token
(the share that is, ``greedy_match``, is printed; below 1 only at near-ties of batched against incremental
fp32 arithmetic).

Output in ``--out``, one shard per ``--shard-tokens`` recorded tokens: ``features_NNNNN.npy`` (float16
``[tokens, hidden]``) and, written after it, ``index_NNNNN.jsonl`` (one line an example: ``id, domain, kind,
mode, offset, length, prompt_len, ids``; ``offset`` is its first row in the shard). A shard without its index
was cut short and is recorded again: a stopped run resumes on the ids not yet in an index. Usage::

    python build/eagle_features.py --target model_repository/target_model/1 \\
        --answers data/chat/answers_0.jsonl --answers data/chat/answers_1.jsonl --out data/eagle --threads 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

FEATURES = "features_{:05d}.npy"
INDEX = "index_{:05d}.jsonl"
AUX = "aux_{:05d}.npy"
AUX_LAYERS_FILE = "aux_layers.json"


def read_index(out: Path) -> list[dict]:
    """Every complete shard's index rows, each with ``shard`` (its number) added."""
    rows = []
    for path in sorted(out.glob("index_*.jsonl")):
        shard = int(path.stem.split("_")[1])
        if not (out / FEATURES.format(shard)).exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rows.append({**json.loads(line), "shard": shard})
    return rows


def load_examples(answers: list[Path], max_len: int) -> list[dict]:
    """Answer rows as ``{"id", "domain", "kind", "mode", "ids", "prompt_len"}``, the first row of each id."""
    examples, seen = [], set()
    for path in answers:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        for line in raw.decode("utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a stop
                continue
            if row.get("id") in seen or not row.get("answer_ids"):
                continue
            seen.add(row["id"])
            ids = (row["prompt_ids"] + row["answer_ids"])[:max_len]
            examples.append({"id": row["id"], "domain": row["domain"], "kind": row.get("kind", ""),
                             "mode": row.get("mode", "greedy"), "ids": ids, "prompt_len": len(row["prompt_ids"])})
    return examples


def text_examples(target: Path, corpora: Path, per_domain: int, length: int, seed: int) -> list[dict]:
    """Windows of real training text (``target_labels.windows``): features at every position."""
    from target_labels import windows
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return [{"id": f"eagle-{w['id']}", "domain": w["domain"], "kind": "text", "mode": "text", "ids": w["ids"],
             "prompt_len": 0} for w in windows(corpora, tokenizer, per_domain, length, seed)]


def groups_by_length(examples: list[dict], tokens_per_batch: int, seed: int) -> list[list[dict]]:
    """Batches of similar-length examples, at most ``tokens_per_batch`` padded tokens each (or one example)."""
    order = sorted(examples, key=lambda e: len(e["ids"]))
    groups, group, width = [], [], 0
    for ex in order:
        width = max(width, len(ex["ids"]))
        if group and width * (len(group) + 1) > tokens_per_batch:
            groups.append(group)
            group, width = [], len(ex["ids"])
        group.append(ex)
    if group:
        groups.append(group)
    random.Random(seed).shuffle(groups)  # shards mix lengths and domains; the progress rate is steady
    return groups


class FeatureRecorder:
    """The target in fp32 (Hugging Face Llama): ``features(ids)`` is its final-normed hidden state."""

    def __init__(self, target: Path, bf16: bool = False, aux_layers: tuple[int, ...] = (),
                 device: str = "cpu") -> None:
        from transformers import LlamaForCausalLM

        self.device = torch.device(device)
        self.model = LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).to(self.device).eval()
        self.embed = self.model.get_input_embeddings().weight  # tied: the output layer too
        self.bf16 = bf16
        self.aux_layers = aux_layers
        config = self.model.config
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self.hidden = int(config.hidden_size)

    @torch.inference_mode()
    def features(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, width, hidden]`` fp32 features of right-padded sequences (rows past a sequence are junk) and,
        with aux layers, their outputs ``[B, width, layers, hidden]``."""
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, :len(seq)] = torch.as_tensor(seq)
        ids = ids.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            # LlamaModel's last hidden state is model.norm's output: what lm_head multiplies. Causal attention
            # over right padding leaves every real position exactly as it is alone.
            out = self.model.model(input_ids=ids, use_cache=False, output_hidden_states=bool(self.aux_layers))
        aux = None
        if self.aux_layers:  # hidden_states[i + 1] is decoder layer i's output
            aux = torch.stack([out.hidden_states[i + 1] for i in self.aux_layers], dim=2).float()
        return out.last_hidden_state.float(), aux

    @torch.inference_mode()
    def greedy_matches(self, feats: torch.Tensor, ex: dict) -> tuple[int, int]:
        """(matches, answer tokens): how often ``argmax(f_t @ E^T)`` is the greedy answer's next token."""
        start, ids = ex["prompt_len"], torch.as_tensor(ex["ids"], device=feats.device)
        if ex["mode"] != "greedy" or start < 1 or start >= len(ids):
            return 0, 0
        predicted = (feats[start - 1:len(ids) - 1] @ self.embed.T).argmax(-1)
        return int((predicted == ids[start:]).sum()), len(ids) - start


def teacher_forced(recorder: FeatureRecorder, examples: list[dict], tokens_per_batch: int, seed: int):
    """Each example, one batch of similar lengths at a time, with its features [n, hidden], its aux layers'
    outputs [n, layers, hidden] (or None) and its greedy check ``(matches, answer tokens)``."""
    for group in groups_by_length(examples, tokens_per_batch, seed):
        hidden, aux = recorder.features([ex["ids"] for ex in group])
        for row, ex in enumerate(group):
            n = len(ex["ids"])
            yield ex, hidden[row, :n], None if aux is None else aux[row, :n], recorder.greedy_matches(hidden[row], ex)


def _save(path: Path, arrays: list[np.ndarray], what: str) -> None:
    data = np.concatenate(arrays).astype(np.float16)
    if not np.isfinite(data).all():
        raise ValueError(f"{path.name}: {what} outside the float16 range")
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, data)
    os.replace(tmp, path)


def write_shard(out: Path, shard: int, feats: list[np.ndarray], rows: list[dict],
                aux: list[np.ndarray] | None = None) -> None:
    """Features (and aux layers) first, then the index that marks the shard complete (all through a rename)."""
    _save(out / FEATURES.format(shard), feats, "features")
    if aux:
        _save(out / AUX.format(shard), aux, "aux layer outputs")
    tmp = out / (INDEX.format(shard) + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, out / INDEX.format(shard))


def record(recorder: FeatureRecorder, examples: list[dict], out: Path, tokens_per_batch: int, shard_tokens: int,
           seed: int, progress: bool = True) -> dict:
    """Record ``examples`` into new shards of ``out``; returns counts and the greedy check."""
    out.mkdir(parents=True, exist_ok=True)
    taken = [int(p.stem.split("_")[1]) for p in out.glob("features_*.npy")]
    taken += [int(p.stem.split("_")[1]) for p in out.glob("index_*.jsonl")]
    shard = max(taken, default=-1) + 1
    feats: list[np.ndarray] = []
    aux_rows: list[np.ndarray] = []
    rows: list[dict] = []
    offset = matched = checked = tokens = 0
    started = time.monotonic()
    bar = tqdm(total=sum(len(e["ids"]) for e in examples), desc="features", unit="tok", unit_scale=True,
               disable=not progress)
    for ex, hidden, aux, (m, c) in teacher_forced(recorder, examples, tokens_per_batch, seed):
        n = len(ex["ids"])
        matched, checked = matched + m, checked + c
        feats.append(hidden.cpu().numpy().astype(np.float16))
        if aux is not None:
            aux_rows.append(aux.cpu().numpy().astype(np.float16))
        rows.append({"id": ex["id"], "domain": ex["domain"], "kind": ex["kind"], "mode": ex["mode"],
                     "offset": offset, "length": n, "prompt_len": ex["prompt_len"], "ids": ex["ids"]})
        offset += n
        tokens += n
        bar.update(n)
        bar.set_postfix(greedy_match=f"{matched / max(checked, 1):.4f}", refresh=False)
        if offset >= shard_tokens:
            write_shard(out, shard, feats, rows, aux_rows)
            shard, feats, aux_rows, rows, offset = shard + 1, [], [], [], 0
    if rows:
        write_shard(out, shard, feats, rows, aux_rows)
    bar.close()
    seconds = time.monotonic() - started
    return {"examples": len(examples), "tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "greedy_checked": checked,
            "greedy_match": round(matched / checked, 5) if checked else None}


def main(argv: list[str] | None = None) -> dict:
    """Command line entry point; returns the run's summary (also printed to stderr)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("model_repository/target_model/1"))
    ap.add_argument("--answers", type=Path, action="append", default=[], help="answers JSONL (repeatable)")
    ap.add_argument("--out", type=Path, default=Path("data/eagle"), help="shard folder (appended, resumable)")
    ap.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    ap.add_argument("--text-per-domain", type=int, default=0, help="windows of real text per domain (0: none)")
    ap.add_argument("--text-length", type=int, default=384)
    ap.add_argument("--max-len", type=int, default=768, help="prompt + answer tokens kept per example")
    ap.add_argument("--tokens-per-batch", type=int, default=4096, help="padded tokens per target forward")
    ap.add_argument("--shard-tokens", type=int, default=131072, help="tokens per shard (float16: 1.1 KiB each)")
    ap.add_argument("--limit", type=int, default=0, help="record at most this many new examples in this run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast: faster, features then not exact")
    ap.add_argument("--aux-layers", default="", help="comma-separated decoder layers whose outputs are recorded "
                    "too (EAGLE-3 fusion, e.g. 2,15; a folder keeps one choice)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    aux_layers = tuple(int(x) for x in args.aux_layers.split(",") if x.strip())
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = args.out / AUX_LAYERS_FILE
    if chosen.exists() and tuple(json.loads(chosen.read_text(encoding="utf-8"))) != aux_layers:
        ap.error(f"{args.out} records aux layers {chosen.read_text().strip()}, not {list(aux_layers)}")
    if aux_layers and not chosen.exists() and any(args.out.glob("index_*.jsonl")):
        ap.error(f"{args.out} holds shards recorded without aux layers")
    if aux_layers and not chosen.exists():
        chosen.write_text(json.dumps(list(aux_layers)) + "\n", encoding="utf-8")
    examples = load_examples(args.answers, args.max_len)
    if args.text_per_domain:
        examples += text_examples(args.target, args.corpora, args.text_per_domain, args.text_length, args.seed)
    done = {r["id"] for r in read_index(args.out)} if args.out.exists() else set()
    todo = [ex for ex in examples if ex["id"] not in done and len(ex["ids"]) >= 3]
    random.Random(args.seed).shuffle(todo)  # a --limit run takes every domain and kind
    if args.limit:
        todo = todo[:args.limit]
    print(f"{len(examples)} examples, {len(examples) - len(todo)} recorded or left out, {len(todo)} to record "
          f"({sum(len(e['ids']) for e in todo):,} tokens) into {args.out}", file=sys.stderr)
    summary = {"examples": 0, "tokens": 0}
    if todo:
        recorder = FeatureRecorder(args.target, bf16=args.bf16, aux_layers=aux_layers)
        summary = record(recorder, todo, args.out, args.tokens_per_batch, args.shard_tokens, args.seed,
                         args.progress)
    print(json.dumps(summary), file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
