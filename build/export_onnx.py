"""Export the decoder step of Hugging Face checkpoints to ONNX (specdec.runtime.step_graph), and check it.

Any supported family (specdec.families: Llama 3.x, Qwen2/2.5, Qwen3, Mistral); a checkpoint of another one
stops the export with exit code 2 and the config.json field and value that are not supported.

By default every decoder of the model repository (the EAGLE head too when the repository has one), into
`<model>/1/onnx/decoder.onnx`: where the onnxruntime runtime looks first (it exports there itself on first
load when the file is missing or stale, so this is only ahead-of-time work), and the 8-bit graph beside it of
a model whose config.pbtxt asks for `weight_quantization`. With --check, onnxruntime runs
the export against the torch runtime on a real prompt and prints max |logit difference| and argmax
agreement. Usage:

    python build/export_onnx.py --check
    python build/export_onnx.py --checkpoint path/to/hf_model --out /tmp/model.onnx --dtype float16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from specdec.checkpoint import UnsupportedCheckpoint, read_spec
from specdec.runtime.graph_contract import ONNX_FILE
from specdec.runtime.onnx_llama import export_is_current, resolve_onnx
from specdec.runtime.step_graph import DTYPES, export_decoder

REPO_ROOT = Path(__file__).resolve().parents[1]
DECODER_MODELS = ("target_model", "draft_model", "eagle_draft")
OPTIONAL_MODELS = ("eagle_draft",)  # exported when the repository holds it (an imported pair has no head)
CHECK_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def check_export(model_dir: Path, onnx_path: Path) -> tuple[float, float]:
    """(max |logit difference|, argmax agreement) of onnxruntime vs the torch runtime over every position
    of a real prompt (fp32 exports)."""
    from specdec.runtime.base import ForwardItem
    from specdec.runtime.onnx_llama import OnnxLlamaRuntime
    from specdec.runtime.parity import logit_parity
    from specdec.runtime.torch_llama import TorchLlamaRuntime
    from specdec.tokenizer import TextTokenizer

    ids = np.asarray(TextTokenizer(model_dir).encode(CHECK_PROMPT), dtype=np.int64)
    size = read_spec(model_dir).eagle_feature_size  # an EAGLE head: seeded stand-in features per token
    features = np.random.default_rng(0).standard_normal((len(ids), size)).astype(np.float32) if size else None
    item = [ForwardItem(0, 0, ids, num_logits=len(ids), features=features)]
    expected = TorchLlamaRuntime(model_dir, num_slots=1, max_length=len(ids), num_threads=1).forward(item)[0]
    got = OnnxLlamaRuntime(model_dir, num_slots=1, max_length=len(ids), onnx_path=onnx_path).forward(item)[0]
    return logit_parity(expected, got)


def configured_parameter(model_dir: Path, key: str) -> str | None:
    """A string parameter of the config.pbtxt above a repository model's version folder (None: not set)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config_file = model_dir.parent / "config.pbtxt"
    if not config_file.is_file():
        return None
    config = text_format.Parse(config_file.read_text(), mc.ModelConfig())
    parameter = config.parameters.get(key)
    return parameter.string_value if parameter is not None and parameter.string_value else None


def configured_quantization(model_dir: Path) -> str | None:
    """The weight quantization a repository model is served with (its `weight_quantization`, `auto` resolved
    from the checkpoint as the server resolves it)."""
    from specdec.runtime import choose_weights

    role = configured_parameter(model_dir, "role") or "target"
    runtime = configured_parameter(model_dir, "runtime") or "onnxruntime"
    return choose_weights(role, runtime, configured_parameter(model_dir, "weight_quantization"), model_dir)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--models", default=",".join(DECODER_MODELS), help="decoder models of the repository")
    parser.add_argument("--checkpoint", type=Path, help="export this checkpoint folder instead (with --out)")
    parser.add_argument("--out", type=Path, help="output file for --checkpoint")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--force", action="store_true", help="export even when a current export exists")
    parser.add_argument("--check", action="store_true", help="compare with the torch runtime (float32 only)")
    args = parser.parse_args(argv)

    if args.checkpoint:
        if not args.out:
            parser.error("--checkpoint needs --out")
        jobs = [(args.checkpoint, args.out)]
    else:
        names = [name.strip() for name in args.models.split(",") if name.strip()]
        names = [name for name in names if name not in OPTIONAL_MODELS
                 or (args.model_repository / name / "1" / "config.json").is_file()]
        jobs = [(args.model_repository / name / "1", args.model_repository / name / "1" / "onnx" / ONNX_FILE)
                for name in names]
    families = {}
    for model_dir, _ in jobs:  # all of them before anything is written
        try:
            families[model_dir] = read_spec(model_dir).family
        except UnsupportedCheckpoint as exc:
            print(f"error: {model_dir}: {exc}", file=sys.stderr)
            return 2
    for model_dir, out in jobs:
        if not args.force and export_is_current(out, model_dir, args.dtype):
            print(f"{out}: current, kept")
        else:
            started = time.perf_counter()
            export_decoder(model_dir, out, dtype=args.dtype)
            print(f"{out}: exported from {model_dir} ({families[model_dir]}, {args.dtype}, "
                  f"{out.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s)")
        quantization = None if args.checkpoint else configured_quantization(model_dir)
        if quantization:
            print(f"{resolve_onnx(model_dir, out.parent, args.dtype, quantization)}: {quantization} weights, current")
        if args.check:
            if args.dtype != "float32":
                parser.error("--check compares float32 exports")
            diff, agreement = check_export(model_dir, out)
            print(f"  onnxruntime vs torch: max |logit diff| {diff:.2e}, argmax agreement {agreement:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
