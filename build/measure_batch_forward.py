"""What one batched forward of the target costs as the batch grows: decode steps (1 token) and verification
passes (`--width` tokens) of `batch` sequences at `--context` cached tokens each, in one process, on the
onnxruntime runtime the server uses. Prints ms per forward, per sequence, tokens/s the forward could serve, and
the cores the process kept busy meanwhile. With `--compare-copy`, a second runtime whose graph copies each
layer's context (as before the in-place binding, specdec.runtime.onnx_llama.graph_writing_in_place) runs the
same forwards, interleaved.

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
    parser.add_argument("--weight-quantization", default="gguf",
                        help="the target's served weights (gguf: the GGUF file's blocks, as deployed; none: fp32)")
    parser.add_argument("--compare-copy", action="store_true",
                        help="also time a runtime whose graph copies each layer's context per forward")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    quantization = None if args.weight_quantization == "none" else args.weight_quantization
    runtimes = {"in place": OnnxLlamaRuntime(args.model_dir, num_slots=max(batches), max_length=args.context + 64,
                                             num_threads=args.threads, weight_quantization=quantization)}
    if args.compare_copy:
        runtimes["copied"] = OnnxLlamaRuntime(args.model_dir, num_slots=max(batches),
                                              max_length=args.context + 64, num_threads=args.threads,
                                              weight_quantization=quantization)
        runtimes["copied"].written_context = {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, runtimes["in place"].vocab_size, args.context) for _ in range(max(batches))]
    for runtime in runtimes.values():
        for slot, prompt in enumerate(prompts):
            runtime.forward_outputs([ForwardItem(slot, 0, prompt)])
    for width in (int(w) for w in args.widths.split(",")):
        for batch in batches:
            tokens = rng.integers(0, runtimes["in place"].vocab_size, (batch, width))
            items = [ForwardItem(slot, args.context, tokens[slot], num_logits=width) for slot in range(batch)]
            seconds = dict.fromkeys(runtimes, 0.0)
            cpu_seconds = dict.fromkeys(runtimes, 0.0)
            for runtime in runtimes.values():
                runtime.forward_outputs(items)  # warm-up at this shape
            for _ in range(args.repeats):
                for name, runtime in runtimes.items():
                    started, cpu_started = time.perf_counter(), time.process_time()
                    runtime.forward_outputs(items)
                    seconds[name] += (time.perf_counter() - started) / args.repeats
                    cpu_seconds[name] += (time.process_time() - cpu_started) / args.repeats
            for name, took in seconds.items():
                print(f"context {args.context} width {width} batch {batch:3d} ({name}): {1e3 * took:7.1f} ms/forward "
                      f"{1e3 * took / batch:6.2f} ms/sequence {batch / took:7.1f} forwards' sequences/s "
                      f"{cpu_seconds[name] / took:4.2f} cores", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
