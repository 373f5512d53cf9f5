"""`generate`: send one prompt to the served ensemble and print the text, then speed and acceptance."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from specdec_client.api import GenerationError, generate_grpc, generate_http

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "model_repository" / "target_model" / "1"


def chat_prompt(message: str, tokenizer_dir: Path, system: str | None = None) -> str:
    """``message`` as one user turn in the target's chat template (its generation prompt appended)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if not tokenizer.chat_template:
        raise SystemExit(f"error: the tokenizer in {tokenizer_dir} has no chat template")
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", help="the prompt (read from stdin when absent)")
    parser.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--stream", action="store_true", help="print text as it arrives")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=None, help="0 = plain decoding")
    parser.add_argument("--task", choices=("auto", "json", "code", "text"), default=None)
    parser.add_argument("--exclude-input", action="store_true", help="do not echo the prompt (non-streaming)")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a chat request in the target's chat template (answer only)")
    parser.add_argument("--system", default=None, help="with --chat: a system message")
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                        help="with --chat: the folder of the target's tokenizer (its chat template)")
    args = parser.parse_args(argv)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.chat:
        prompt = chat_prompt(prompt, args.tokenizer, args.system)
        args.exclude_input = True
    params = {
        "text_input": prompt, "max_tokens": args.max_tokens, "stream": args.stream,
        "num_draft_tokens": args.num_draft_tokens, "task": args.task,
        "exclude_input_in_output": True if args.exclude_input else None,
    }
    url = args.url or ("127.0.0.1:8001" if args.protocol == "grpc" else "127.0.0.1:8000")
    call = generate_grpc if args.protocol == "grpc" else generate_http
    try:
        result = call(url, params, on_text=lambda text: print(text, end="", flush=True), model=args.model)
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # connection refused and the like
        print(f"error: cannot reach the server at {url}: {exc}", file=sys.stderr)
        return 2
    stats = result.stats
    print(
        f"\n\n{result.num_output_tokens} tokens in {result.latency_s:.2f} s "
        f"({result.tokens_per_second:.1f} tokens/s); acceptance {stats.get('acceptance_rate', 0):.2f} "
        f"({int(stats.get('total_accepted_draft_tokens', 0))}/{int(stats.get('total_draft_tokens', 0))} draft tokens)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
