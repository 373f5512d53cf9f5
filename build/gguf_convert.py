"""Convert a GGUF checkpoint into a Hugging Face folder (config.json, safetensors, tokenizer) our runtimes load.

transformers reads GGUF (``from_pretrained(folder, gguf_file=NAME)``, with the ``gguf`` package) and
dequantizes the weights, but then refuses ``save_pretrained`` because the model is flagged as
gguf-quantized. So the state dict is copied into a fresh model of the same class built from the plain
config (the quantization entry removed) and saved from there, in bf16 by default (half the folder; bf16
rounds the dequantized values, but the onnxruntime runtime serves such a folder from the GGUF file's own
blocks and exact values, `specdec.runtime.gguf_blocks`, found through the path `gguf_source.json` records).

Usage: ``python build/gguf_convert.py FILE.gguf OUT_DIR [--dtype bfloat16|float16|float32]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specdec.runtime.gguf_blocks import GGUF_SOURCE_FILE as CONVERTED_MARK  # written last: the folder is complete
from specdec.runtime.gguf_blocks import source_record

DTYPES = ("bfloat16", "float16", "float32")


def is_converted(gguf_file: Path, out_dir: Path, dtype: str) -> bool:
    """True when ``out_dir`` holds a complete conversion of this very file in this dtype."""
    mark = out_dir / CONVERTED_MARK
    if not mark.is_file():
        return False
    try:
        recorded = json.loads(mark.read_text(encoding="utf-8"))
    except ValueError:
        return False
    return recorded == {**source_record(gguf_file), "dtype": dtype}


def convert(gguf_file: Path, out_dir: Path, dtype: str = "bfloat16", force: bool = False) -> Path:
    """Write the Hugging Face folder of ``gguf_file`` into ``out_dir`` (skipped when already done)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file = gguf_file.resolve()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if not force and is_converted(gguf_file, out_dir, dtype):
        return out_dir
    folder, name = str(gguf_file.parent), gguf_file.name
    started = time.monotonic()
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = type(quantized)(config)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # A tied output layer is absent from the state dict by design; anything else missing is an error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"{gguf_file}: state dict mismatch, missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = model.to(getattr(torch, dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CONVERTED_MARK).unlink(missing_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    (out_dir / CONVERTED_MARK).write_text(json.dumps({**source_record(gguf_file), "dtype": dtype}) + "\n",
                                          encoding="utf-8")
    print(f"converted {gguf_file.name} -> {out_dir} ({dtype}, {time.monotonic() - started:.0f} s)", file=sys.stderr)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf_file", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--force", action="store_true", help="convert even when out_dir already holds this file")
    args = ap.parse_args(argv)
    convert(args.gguf_file, args.out_dir, args.dtype, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
