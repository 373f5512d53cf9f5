"""Have the target answer the chat requests of ``build/chat_requests.py``: the draft's distillation data.

Chat requests go through the target's own chat template; raw requests are continued as they are. Most
answers are greedy (what greedy speculation must predict); a share is sampled (temperature 0.7, top-p
0.95) so the draft also sees what the target writes when a client samples. Requests are answered with the
project's own static-cache runtime, many at a time (continuous batching).

``--sampling t0.7,t1.0`` instead answers every request once per listed decoding mode (the benchmark's
``SAMPLINGS``), each answer seeded from its request and mode, under the id ``<request id>@<mode>`` (a request's
answers stay on one side of the training split, which hashes the request id). ``--prompts-from`` takes the
prompts of an answers file made before (its ``prompt_ids``), e.g. the committed greedy answers, so their
requests get sampled answers beside the greedy ones without the corpora.

Resumable: answers are appended to ``--out`` as they are made, one JSON object a line
(``{"id", "domain", "kind", "mode", "prompt_ids", "answer_ids"}``, with ``--sampling`` also ``"sampling"``:
the mode's name); a second run skips the ids already there, so the job can be stopped and restarted at any
time (``--limit`` bounds one run).

Usage: ``python build/target_answers.py --target model_repository/target_model/1 \\
    --requests data/chat/requests.jsonl --out data/chat/answers.jsonl --threads 2``;
``python build/target_answers.py --prompts-from build/answers/chat2033-cpu.jsonl.gz --sampling t0.7,t1.0 \\
    --max-new 128 --out data/sampled/answers.jsonl``
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specdec.sampling import SamplingParams, make_rng, probabilities, sample  # noqa: E402
from specdec_client.bench_prompts import SAMPLINGS  # noqa: E402

MAX_NEW_TOKENS = {"code": 256, "json": 160, "prose": 256}
MAX_PROMPT_TOKENS = 512
SAMPLED = SAMPLINGS["t0.7"]
SLOT_ROWS = MAX_PROMPT_TOKENS + max(MAX_NEW_TOKENS.values())


def prompt_ids(tokenizer, request: dict) -> list[int]:
    """Token ids of a request: the chat template with the generation prompt, or the raw text."""
    if "messages" in request:
        return list(tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
    return tokenizer(request["prompt"], add_special_tokens=False)["input_ids"]


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file, gzipped or not; a line cut short by a stop is skipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def requests_of_answers(path: Path) -> list[dict]:
    """Requests ``{"id", "domain", "kind", "prompt_ids"}`` from an answers file, the first row of each id."""
    seen, requests = set(), []
    for row in read_jsonl(path):
        base = row["id"].split("@")[0]
        if base not in seen:
            seen.add(base)
            requests.append({"id": base, "domain": row["domain"], "kind": row.get("kind", ""),
                             "prompt_ids": row["prompt_ids"]})
    return requests


def done_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    ids = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (ValueError, KeyError):  # a line cut short by a stop: answered again
            continue
    return ids


class ContinuousAnswerer:
    """Answers requests with one of the project's runtimes, `runtime.num_slots` sequences at a time.

    A finished sequence frees its slot at once and the next request is prefilled into it (continuous
    batching): one decode forward serves every live sequence. On this CPU the static-cache torch runtime runs
    about 5x faster than Hugging Face ``generate`` on padded batches (measured: 200 against 16-48 tokens/s,
    batch 16), the served onnxruntime graph (the GGUF file's 4-bit blocks) faster still.
    """

    def __init__(self, runtime, eos_ids: list[int]) -> None:
        self.runtime = runtime
        self.eos_ids = set(eos_ids)

    def run(self, todo: list[tuple[dict, list[int], int, SamplingParams]], write, progress) -> None:
        """Answer every ``(request, prompt_ids, max_new, sampling)``; ``write(request, ids, answer, mode)``."""
        from specdec.runtime.base import ForwardItem

        pending = list(reversed(todo))
        live: dict[int, dict] = {}  # slot -> state
        free = list(range(self.runtime.num_slots))
        while pending or live:
            fresh = []
            while free and pending:
                req, ids, max_new, sampling = pending.pop()
                slot = free.pop()
                live[slot] = {"req": req, "ids": ids, "answer": [], "max_new": max_new, "sampling": sampling,
                              "rng": make_rng(sampling.seed)}
                fresh.append(slot)
            items = [ForwardItem(slot=s, past_length=0, input_ids=np.asarray(live[s]["ids"])) for s in fresh]
            logits = self.runtime.forward(items) if items else []
            steps = [(s, lg) for s, lg in zip(fresh, logits, strict=True)]
            decoding = [s for s in live if s not in fresh]
            items = [ForwardItem(slot=s, past_length=len(live[s]["ids"]) + len(live[s]["answer"]) - 1,
                                 input_ids=np.asarray(live[s]["answer"][-1:])) for s in decoding]
            if items:
                steps += list(zip(decoding, self.runtime.forward(items), strict=True))
            for slot, lg in steps:
                state = live[slot]
                probs = probabilities(lg[-1], state["sampling"])[0]
                token = int(probs.argmax()) if state["sampling"].greedy else sample(probs, state["rng"])
                state["answer"].append(token)
                if token in self.eos_ids or len(state["answer"]) >= state["max_new"]:
                    mode = "greedy" if state["sampling"].greedy else "sampled"
                    write(state["req"], state["ids"], state["answer"], mode)
                    progress(1)
                    del live[slot]
                    free.append(slot)


def make_runtime(args: argparse.Namespace):
    """The runtime ``--runtime`` names, ``--slots`` sequences of prompt + answer rows."""
    if args.runtime == "served":
        from export_onnx import configured_quantization
        from specdec.runtime import build_runtime

        return build_runtime("onnxruntime", args.target, args.slots, SLOT_ROWS, num_threads=args.threads,
                             weight_quantization=configured_quantization(args.target))
    from specdec.runtime.torch_llama import TorchLlamaRuntime

    return TorchLlamaRuntime(args.target, num_slots=args.slots, max_length=SLOT_ROWS, dtype=getattr(torch, args.dtype))


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    from transformers import AutoTokenizer, GenerationConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=Path("model_repository/target_model/1"))
    ap.add_argument("--requests", type=Path, default=Path("data/chat/requests.jsonl"))
    ap.add_argument("--out", type=Path, default=Path("data/chat/answers.jsonl"))
    ap.add_argument("--slots", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--sampled-frac", type=float, default=0.25, help="share of requests answered by sampling")
    ap.add_argument("--limit", type=int, default=0, help="answer at most this many requests in this run")
    ap.add_argument("--shard", default="0/1", help="I/N: answer every N-th request from the I-th (parallel jobs)")
    ap.add_argument("--threads", type=int, default=1, help="1 unless the cores are free: oversubscribed "
                    "OpenMP threads slow matmuls down several times")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bfloat16 prefills 3x faster on CPUs with avx512_bf16, but torch's CPU attention is 5x "
                         "slower in bf16 than in fp32 (measured: 20 against 4 ms a layer, 32 x 500 rows)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--runtime", choices=("torch", "served"), default="torch", help="torch: the checkpoint in "
                    "--dtype; served: the onnxruntime graph the server runs (its config.pbtxt's weight "
                    "quantization: the text the served target writes)")
    ap.add_argument("--prompts-from", type=Path, help="take the prompts of this answers file (JSONL, .gz too) "
                    "instead of --requests")
    ap.add_argument("--sampling", default="", help=f"answer every request once per mode of {sorted(SAMPLINGS)} "
                    "(comma-separated; replaces --sampled-frac)")
    ap.add_argument("--max-new", type=int, default=0, help="new tokens per answer (0: per domain, "
                    f"{MAX_NEW_TOKENS})")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.sampling.split(",") if m.strip()]
    unknown = [m for m in modes if m not in SAMPLINGS]
    if unknown:
        ap.error(f"--sampling: unknown modes {unknown}; known: {sorted(SAMPLINGS)}")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    eos = GenerationConfig.from_pretrained(str(args.target)).eos_token_id
    eos_ids = list(eos) if isinstance(eos, list) else [eos]
    if args.prompts_from:
        requests = requests_of_answers(args.prompts_from)
    else:
        requests = [json.loads(line) for line in args.requests.read_text(encoding="utf-8").splitlines()]
    shard, shards = (int(x) for x in args.shard.split("/"))
    skip = done_ids(args.out)
    todo = []
    for index, req in enumerate(requests):
        if index % shards != shard:
            continue
        ids = req["prompt_ids"] if "prompt_ids" in req else prompt_ids(tokenizer, req)
        if len(ids) > MAX_PROMPT_TOKENS:
            continue
        number = int(req["id"].rsplit("-", 1)[-1])
        max_new = args.max_new or MAX_NEW_TOKENS[req["domain"]]
        if modes:
            for m, mode in enumerate(modes):
                answer_id = f"{req['id']}@{mode}"
                if answer_id not in skip:
                    seed = (args.seed * 1_000_003 + number) * 8 + m
                    sampling = SamplingParams(**SAMPLINGS[mode], seed=seed)
                    todo.append(({**req, "id": answer_id, "sampling": mode}, ids, max_new, sampling))
            continue
        if req["id"] in skip:
            continue
        sampled = random.Random(f"{args.seed}/{req['id']}").random() < args.sampled_frac
        sampling = SamplingParams(**SAMPLED, seed=args.seed * 1_000_003 + number) if sampled else SamplingParams()
        todo.append((req, ids, max_new, sampling))
    if modes:  # a run stopped early has answered every domain and mode alike
        random.Random(args.seed).shuffle(todo)
    if args.limit:
        todo = todo[:args.limit]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="answers", unit="req")
    with args.out.open("a", encoding="utf-8") as out:
        def write(req: dict, ids: list[int], answer: list[int], mode: str) -> None:
            row = {"id": req["id"], "domain": req["domain"], "kind": req["kind"], "mode": mode,
                   "prompt_ids": ids, "answer_ids": answer}
            if "sampling" in req:
                row["sampling"] = req["sampling"]
            out.write(json.dumps(row) + "\n")
            out.flush()

        answerer = ContinuousAnswerer(make_runtime(args), eos_ids)
        answerer.run(todo, write, bar.update)
    bar.close()
    print(f"answers in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
