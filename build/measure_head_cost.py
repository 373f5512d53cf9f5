"""What an EAGLE head's call costs against a target step, in the CPU runtime the server uses (onnxruntime, one
thread each, interleaved in one process): c of one drafted token, for heads with and without EAGLE-3 fusion.

A head is a folder of ``build/train_eagle.py`` (``best/`` or ``last/``); a fused head (``--aux``) is saved as
it is served: one ``eagle.fc`` over [token embedding, feature, normalized aux layers] and a feature ``(1 +
layers) x hidden`` wide, the plain head's graph with a wider input. Each head is completed with the installed
head's shared files (embeddings, tokenizer) and exported to ONNX in a scratch folder. Usage::

    python build/measure_head_cost.py runs/s3_control/best runs/s3_fused/best --iterations 300
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from specdec.runtime.base import ForwardItem  # noqa: E402
from specdec.runtime.onnx_llama import OnnxLlamaRuntime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEAD_FILES = ("config.json", "eagle_layers.safetensors", "proposal_vocab.json")


def servable(run: Path, shared: Path, out: Path) -> Path:
    """``run``'s head completed with ``shared``'s files and exported to ONNX in ``out``."""
    shutil.copytree(shared, out, ignore=shutil.ignore_patterns("onnx", "model.py", "__pycache__"))
    for name in HEAD_FILES:
        shutil.copy(run / name, out / name)
    subprocess.run([sys.executable, str(ROOT / "build/export_onnx.py"), "--checkpoint", str(out), "--out",
                    str(out / "onnx/decoder.onnx")], check=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", type=Path, nargs="+", help="head folders of build/train_eagle.py")
    ap.add_argument("--shared", type=Path, default=ROOT / "model_repository/eagle_draft/1",
                    help="an assembled head folder whose shared files (embeddings, tokenizer) complete each head")
    ap.add_argument("--target", type=Path, default=ROOT / "model_repository/target_model/1")
    ap.add_argument("--past", type=int, default=300, help="context rows before the measured token")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 40000, args.past + 1)
    with tempfile.TemporaryDirectory(prefix="head-cost-") as tmp:
        runtimes = {}
        for i, run in enumerate(args.heads):
            folder = servable(run, args.shared, Path(tmp) / f"head{i}")
            runtimes[str(run)] = OnnxLlamaRuntime(folder, num_slots=1, max_length=args.past + 8, num_threads=1)
        target = OnnxLlamaRuntime(args.target, num_slots=1, max_length=args.past + 8, num_threads=1)
        for rt in runtimes.values():
            width = rt.spec.eagle_feature_size
            rt.forward([ForwardItem(0, 0, ids[:args.past],
                                    features=rng.standard_normal((args.past, width)).astype(np.float32))])
        target.forward([ForwardItem(0, 0, ids[:args.past])])
        times: dict[str, list[float]] = {name: [] for name in [*runtimes, "target"]}
        for _ in range(args.warmup + args.iterations):  # interleaved: the same machine load for every model
            for name, rt in runtimes.items():
                feature = rng.standard_normal((1, rt.spec.eagle_feature_size)).astype(np.float32)
                started = time.perf_counter()
                rt.forward([ForwardItem(0, args.past, ids[args.past:], features=feature)])
                times[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            target.forward([ForwardItem(0, args.past, ids[args.past:])])
            times["target"].append(time.perf_counter() - started)
        widths = {name: rt.spec.eagle_feature_size for name, rt in runtimes.items()}
    ms = {name: statistics.median(t[args.warmup:]) * 1e3 for name, t in times.items()}
    report = {"target_step_ms": round(ms["target"], 3), "past": args.past, "iterations": args.iterations,
              "heads": {name: {"feature_size": widths[name], "step_ms": round(ms[name], 3),
                               "c": round(ms[name] / ms["target"], 4)} for name in runtimes}}
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
