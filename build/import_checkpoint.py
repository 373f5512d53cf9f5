"""Put a target and a draft Hugging Face checkpoint into the model repository ("bring your own checkpoints").

The default pair goes through the same path (``build/train.py`` writes ``<run>/hf``, this script copies it).
Checks before anything is copied:

- both folders hold ``config.json``, weights (``*.safetensors``) and a tokenizer (``tokenizer.json``);
- the draft and the target tokenizers are the same: same vocabulary (token -> id), same special tokens
  (BOS/EOS/PAD), and the configs' ``vocab_size`` agree. Otherwise :class:`IncompatibleCheckpoints` names
  the first differences.

Only the Hugging Face files are copied into ``<repo>/target_model/1`` and ``<repo>/draft_model/1``;
``model.py`` and ``config.pbtxt`` there are left alone. Stale HF files of a previous pair are removed.
A ``--repo`` folder that does not exist yet is made from this project's ``model_repository`` (its configs,
``model.py`` files and profiles, no checkpoints), so a second deployment never edits the default one.

Either side may be a GGUF file instead of a folder: it is converted first (``build/gguf_convert.py``).

Usage: ``python build/import_checkpoint.py --target DIR_OR_GGUF --draft DIR_OR_GGUF [--repo DIR]``, then
``make serve MODEL_REPOSITORY=DIR``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEMPLATE_REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt",
            "added_tokens.json", "proposal_vocab.json",  # a draft's restricted output layer (draft_vocab.py)
            "gguf_source.json")  # a converted GGUF file's path: the onnxruntime runtime serves its blocks
WEIGHT_GLOBS = ("*.safetensors", "model.safetensors.index.json")
# What a repository template copy leaves out: checkpoints, their exports, and generated files.
NOT_SERVING = ("*.safetensors", "*.safetensors.index.json", "onnx", "__pycache__", *HF_FILES)


class IncompatibleCheckpoints(ValueError):
    """The target and the draft cannot be paired (different tokenizers or missing files)."""


def _hf_files(src: Path) -> list[Path]:
    files = [src / n for n in HF_FILES if (src / n).is_file()]
    for pattern in WEIGHT_GLOBS:
        files.extend(sorted(src.glob(pattern)))
    return files


def _check_folder(src: Path, role: str) -> None:
    if not src.is_dir():
        raise IncompatibleCheckpoints(f"{role} checkpoint {src} is not a folder")
    if not (src / "config.json").is_file():
        raise IncompatibleCheckpoints(f"{role} checkpoint {src} has no config.json")
    if not list(src.glob("*.safetensors")):
        raise IncompatibleCheckpoints(f"{role} checkpoint {src} has no *.safetensors weights "
                                      "(convert .bin weights with save_pretrained(safe_serialization=True))")
    if not (src / "tokenizer.json").is_file():
        raise IncompatibleCheckpoints(f"{role} checkpoint {src} has no tokenizer.json (a fast tokenizer is needed)")


def _special_ids(src: Path) -> dict[str, int | None]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    return {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}


def _vocab(src: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab(with_added_tokens=True)


def check_compatible(target: Path, draft: Path) -> None:
    """Raise :class:`IncompatibleCheckpoints` unless ``draft`` can propose tokens for ``target``."""
    _check_folder(target, "target")
    _check_folder(draft, "draft")
    problems: list[str] = []
    tv, dv = _vocab(target), _vocab(draft)
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))
        only_d = sorted(set(dv) - set(tv))
        moved = sorted(k for k in set(tv) & set(dv) if tv[k] != dv[k])
        msg = f"vocabularies differ: target has {len(tv)} tokens, draft has {len(dv)}"
        if only_t:
            msg += f"; only in target: {only_t[:5]!r}"
        if only_d:
            msg += f"; only in draft: {only_d[:5]!r}"
        if moved:
            msg += f"; different ids for {len(moved)} tokens, e.g. {moved[0]!r}: target {tv[moved[0]]}, " \
                   f"draft {dv[moved[0]]}"
        problems.append(msg)
    tc = json.loads((target / "config.json").read_text())
    dc = json.loads((draft / "config.json").read_text())
    if tc.get("vocab_size") != dc.get("vocab_size"):
        problems.append(f"config vocab_size differs: target {tc.get('vocab_size')}, draft {dc.get('vocab_size')}")
    elif (draft / "proposal_vocab.json").is_file():
        from specdec.checkpoint import read_proposal_vocab

        try:
            read_proposal_vocab(draft, int(dc["vocab_size"]))
        except ValueError as exc:
            problems.append(f"draft proposal vocabulary: {exc}")
    if not problems:
        ts, ds = _special_ids(target), _special_ids(draft)
        if ts != ds:
            problems.append(f"special token ids differ: target {ts}, draft {ds}")
    if problems:
        raise IncompatibleCheckpoints("draft and target tokenizers are not compatible: " + "; ".join(problems))


def install(src: Path, dst: Path) -> list[Path]:
    """Copy the HF files of ``src`` into ``dst`` (removing stale HF files there); returns the copied paths."""
    dst.mkdir(parents=True, exist_ok=True)
    for old in _hf_files(dst):
        old.unlink()
    copied = []
    for f in _hf_files(src):
        shutil.copyfile(f, dst / f.name)
        (dst / f.name).chmod(0o644)
        copied.append(dst / f.name)
    return copied


# Models of the template that belong to its default pair only: the EAGLE head reads the default target's
# features, so a repository for other checkpoints serves the draft model and prompt lookup without it.
PAIR_SPECIFIC_MODELS = ("eagle_draft",)


def new_repository(repo: Path, template: Path = TEMPLATE_REPOSITORY) -> Path:
    """Make ``repo`` from ``template``'s serving files (configs, model.py, profiles), without checkpoints."""
    if repo.exists():
        raise FileExistsError(f"{repo} already exists")
    shutil.copytree(template, repo, ignore=shutil.ignore_patterns(*NOT_SERVING, *PAIR_SPECIFIC_MODELS))
    return repo


def import_pair(target: Path, draft: Path, repo: Path) -> dict[str, list[Path]]:
    """Check ``target`` and ``draft`` and copy them into ``repo``'s target_model/1 and draft_model/1.

    ``repo`` is made from the project's model repository when it does not exist; GGUF files are converted.
    """
    with tempfile.TemporaryDirectory(prefix="specdec-gguf-") as scratch:
        target, draft = (_as_folder(path, Path(scratch) / role) for path, role in ((target, "target"),
                                                                                   (draft, "draft")))
        check_compatible(target, draft)
        if not repo.exists():
            new_repository(repo)
        return {"target": install(target, repo / "target_model" / "1"),
                "draft": install(draft, repo / "draft_model" / "1")}


def _as_folder(path: Path, scratch: Path) -> Path:
    """A Hugging Face folder for ``path``: itself, or the conversion of a GGUF file into ``scratch``."""
    if path.is_file() and path.suffix == ".gguf":
        from gguf_convert import convert

        return convert(path, scratch)
    return path


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="Hugging Face folder or GGUF file of the target")
    ap.add_argument("--draft", type=Path, required=True, help="Hugging Face folder or GGUF file of the draft")
    ap.add_argument("--repo", type=Path, default=Path("model_repository"),
                    help="model repository to install into (made from model_repository/ when missing)")
    args = ap.parse_args(argv)
    try:
        done = import_pair(args.target, args.draft, args.repo)
    except IncompatibleCheckpoints as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for role, files in done.items():
        print(f"{role}: {', '.join(str(f) for f in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
