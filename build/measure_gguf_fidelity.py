"""Greedy answers of the served target against Hugging Face transformers on the same GGUF file.

transformers loads a GGUF checkpoint by dequantizing it exactly into fp32; that is the reference. For each
held-out chat request (`prompts/bench_chat.json`, domains interleaved) this decodes `--tokens` new tokens
greedily with transformers and with our onnxruntime step graphs (each `--graphs` file, e.g. the fp32 export of
the converted folder and the graph served from the file's blocks), and prints per graph how many answers are
token for token equal to transformers'. Where one differs, it prints the first differing position and
transformers' margin there (top-1 minus top-2 logit, fp32): a difference at a margin of a few hundredths is a
near-tie that the arithmetic (int8 activations, another summation order) decides, not a different model.
With `--llama-server URL` (a `llama-server` serving the same file) llama.cpp's greedy answers are compared too:
llama.cpp also multiplies its 4-bit blocks with 8-bit quantized activations.

    python build/measure_gguf_fidelity.py --gguf FILE.gguf --requests 12 --tokens 128 \\
        --graphs fp32=model_repository/target_model/1/onnx/decoder.onnx \\
                 gguf=model_repository/target_model/1/onnx/decoder.gguf.onnx
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "client"))
sys.path.insert(0, str(REPO_ROOT / "python_backend"))

from specdec.checkpoint import read_end_ids  # noqa: E402
from specdec.runtime.base import ForwardItem  # noqa: E402
from specdec.runtime.onnx_llama import OnnxLlamaRuntime  # noqa: E402
from specdec.tokenizer import TextTokenizer  # noqa: E402
from specdec_client.load_profile import load_prompts  # noqa: E402


def ours(runtime: OnnxLlamaRuntime, prompt: list[int], tokens: int, end_ids: frozenset[int]) -> list[int]:
    """Greedy decoding on one slot of `runtime` (prefill, then one token a step)."""
    logits = runtime.forward([ForwardItem(0, 0, np.asarray(prompt))])[0]
    out: list[int] = []
    while len(out) < tokens:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in end_ids:
            break
        logits = runtime.forward([ForwardItem(0, len(prompt) + len(out) - 1, np.asarray([token]))])[0]
    return out


def reference(model, prompt: list[int], tokens: int, end_ids: frozenset[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy answer and its top-1 minus top-2 logit margin at every step."""
    import torch

    with torch.inference_mode():
        result = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                                eos_token_id=sorted(end_ids), output_logits=True, return_dict_in_generate=True)
    out = result.sequences[0, len(prompt):].tolist()
    margins = []
    for step in result.logits:
        top = torch.topk(step[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return out, margins


END = -1  # any end token: answers are compared up to where they end


def llama_cpp(url: str, prompt: list[int], tokens: int) -> list[int]:
    """llama-server's greedy answer to the same token ids (its /completion endpoint, top-1 sampling)."""
    import urllib.request

    body = json.dumps({"prompt": prompt, "n_predict": tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                       "return_tokens": True, "special": True}).encode()
    request = urllib.request.Request(url.rstrip("/") + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return [*answer["tokens"], *([END] if answer.get("stop_type") == "eos" else [])]  # it returns no end token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=REPO_ROOT / "model_repository" / "target_model" / "1")
    parser.add_argument("--graphs", nargs="+", required=True, help="NAME=PATH of step graphs of the target")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", help="URL of a llama-server serving the same GGUF file")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name,
                                                 dtype=torch.float32).eval()
    tokenizer = TextTokenizer(str(args.model_dir))
    end_ids = read_end_ids(args.model_dir)
    graphs = dict(item.split("=", 1) for item in args.graphs)
    runtimes = {name: OnnxLlamaRuntime(args.model_dir, num_slots=1, num_threads=args.threads, onnx_path=path)
                for name, path in graphs.items()}
    rows = []
    for request in load_prompts()[:args.requests]:
        prompt = tokenizer.encode(request["prompt"])
        expected, margins = reference(model, prompt, args.tokens, end_ids)
        row = {"task": request["task"], "tokens": len(expected)}
        answers = {name: ours(runtime, prompt, args.tokens, end_ids) for name, runtime in runtimes.items()}
        if args.llama_server:
            answers["llama.cpp"] = llama_cpp(args.llama_server, prompt, args.tokens)
        expected = [END if t in end_ids else t for t in expected]
        for name, got in answers.items():
            got = [END if t in end_ids else t for t in got]
            first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                         None if len(expected) == len(got) else min(len(expected), len(got)))
            row[name] = {"equal": first is None, "first_difference": first,
                         "margin_there": round(margins[first], 4) if first is not None and first < len(margins)
                         else None}
        if "llama.cpp" in answers:  # which of ours answers as llama.cpp does on the same file
            row["equal_to_llama.cpp"] = sorted(name for name in runtimes
                                               if [END if t in end_ids else t for t in answers[name]]
                                               == answers["llama.cpp"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name in rows[0]:
        if name in ("task", "tokens", "equal_to_llama.cpp"):
            continue
        equal = sum(row[name]["equal"] for row in rows)
        margins = [row[name]["margin_there"] for row in rows if not row[name]["equal"]]
        print(f"{name}: {equal}/{len(rows)} answers equal to transformers' on the GGUF file"
              + (f"; margins at the first difference: {margins}" if margins else ""))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
