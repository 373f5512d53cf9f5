"""`python -m specdec_client.openai_api`: serve the OpenAI-compatible endpoint with uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import uvicorn

from specdec_client.openai_api.app import MAX_BODY_BYTES, create_app
from specdec_client.openai_api.triton import TritonBackend

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_TOKENIZER = REPO_ROOT / "model_repository" / "target_model" / "1"


def load_tokenizer(folder: Path) -> Any:
    """The target's tokenizer (its tokenizer_config.json holds the chat template), from a local folder only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="OpenAI-compatible endpoint in front of the specdec-triton ensemble.")
    p.add_argument("--triton-url", default=f"127.0.0.1:{os.environ.get('GRPC_PORT', 8001)}",
                   help="gRPC host:port of tritonserver")
    p.add_argument("--host", default=os.environ.get("OPENAI_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)))
    p.add_argument("--model", default="ensemble", help="the Triton model to call")
    p.add_argument("--served-model-name", default=None, help="the id clients ask for (default: --model)")
    p.add_argument("--tokenizer", type=Path, default=Path(os.environ.get("SPECDEC_TOKENIZER_DIR", DEFAULT_TOKENIZER)),
                   help="folder with the target's tokenizer files (chat template)")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a Jinja chat template file, for a target whose tokenizer has none")
    p.add_argument("--via-ensemble", action="store_true",
                   help="call the ensemble, not its generation step with the prompt tokenized here (triton.py)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    p.add_argument("--log-level", default="warning")
    return p


def build_app(args: argparse.Namespace) -> Any:
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer.is_dir() else None
    template = args.chat_template.read_text() if args.chat_template else None
    backend = TritonBackend(args.triton_url, args.model, via_ensemble=args.via_ensemble,
                            tokenizer_dir=args.tokenizer if tokenizer is not None else None)
    return create_app(backend, served_model=args.served_model_name or args.model,
                      tokenizer=tokenizer, chat_template=template, max_body_bytes=args.max_body_bytes)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    app = build_app(args)
    print(f"OpenAI-compatible endpoint on http://{args.host}:{args.port}/v1 (Triton gRPC {args.triton_url})",
          flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
