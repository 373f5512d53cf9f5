"""What one batched forward of the target costs as the batch grows: decode steps (1 token) and verification
passes (`--width` tokens) of `batch` sequences at `--context` cached tokens each, in one process, on the
onnxruntime runtime the server uses. Prints ms per forward, per sequence, and tokens/s the forward could serve.

    python build/measure_batch_forward.py --context 200 --batches 1,2,4,8,16,32,64 --widths 1,5
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from specdec.runtime.base import ForwardItem
from specdec.runtime.onnx_llama import OnnxLlamaRuntime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model_repository/target_model/1")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--widths", default="1,5")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    runtime = OnnxLlamaRuntime(args.model_dir, num_slots=max(batches), max_length=args.context + 64,
                               num_threads=args.threads)
    rng = np.random.default_rng(0)
    for slot in range(max(batches)):
        runtime.forward_outputs([ForwardItem(slot, 0, rng.integers(0, runtime.vocab_size, args.context))])
    for width in (int(w) for w in args.widths.split(",")):
        for batch in batches:
            items = [ForwardItem(slot, args.context, rng.integers(0, runtime.vocab_size, width), num_logits=width)
                     for slot in range(batch)]
            runtime.forward_outputs(items)  # warm-up at this shape
            started = time.perf_counter()
            for _ in range(args.repeats):
                runtime.forward_outputs(items)
            seconds = (time.perf_counter() - started) / args.repeats
            print(f"context {args.context} width {width} batch {batch:3d}: {1e3 * seconds:7.1f} ms/forward "
                  f"{1e3 * seconds / batch:6.2f} ms/sequence {batch / seconds:7.1f} forwards' sequences/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
