"""build/train.py, build/tokenizer.py and build/import_checkpoint.py run end to end on tiny inputs (issue 3)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

BUILD = Path(__file__).resolve().parents[2] / "build"
sys.path.insert(0, str(BUILD))

import corpora  # noqa: E402
import greedy_corpus  # noqa: E402
import import_checkpoint  # noqa: E402
import tokenizer as tokmod  # noqa: E402
import train  # noqa: E402

TINY = ["def add(a, b):\n    return a + b\n", '{"id": 1, "name": "x", "tags": ["a", "b"]}\n',
        "It was the best of times, it was the worst of times.\n"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny corpus (all three domains) and a tokenizer trained on it."""
    root = tmp_path_factory.mktemp("tiny")
    corp = root / "corpora"
    for dom, text in zip(corpora.DOMAINS, TINY, strict=True):
        docs = [{"id": f"{dom}/{i}", "source": dom, "text": text * (1 + i % 3)} for i in range(40)]
        train_docs, valid_docs = corpora.split_docs(docs, 0.05)
        corpora.write_jsonl(corp / dom / "train.jsonl", train_docs)
        corpora.write_jsonl(corp / dom / "valid.jsonl", valid_docs)
    tok = root / "tok"
    tokmod.main(["--corpora", str(corp), "--out", str(tok), "--vocab", "300"])
    return {"root": root, "corpora": corp, "tok": tok}


def _train_args(tiny: dict[str, Path], out: Path, layers: int, steps: int) -> list[str]:
    return ["--corpora", str(tiny["corpora"]), "--tokenizer", str(tiny["tok"]), "--out", str(out),
            "--cache", str(tiny["root"] / "cache"), "--layers", str(layers), "--hidden", "32", "--heads", "2",
            "--kv-heads", "2", "--intermediate", "64", "--seq-len", "32", "--batch", "4", "--micro", "2",
            "--steps", str(steps), "--warmup", "2", "--eval-every", "2", "--eval-windows", "2",
            "--ckpt-every", "2", "--no-progress"]


def test_split_holds_out_at_least_the_fraction() -> None:
    docs = [{"id": f"d{i}", "source": "s", "text": "x" * (10 + i)} for i in range(200)]
    train_docs, valid_docs = corpora.split_docs(docs, 0.03)
    held = sum(len(d["text"]) for d in valid_docs)
    assert held >= 0.03 * sum(len(d["text"]) for d in docs)
    assert not {d["id"] for d in train_docs} & {d["id"] for d in valid_docs}
    assert corpora.split_docs(docs, 0.03) == (train_docs, valid_docs)


def test_json_generator_is_seeded_and_valid() -> None:
    a = list(corpora.json_docs(20, seed=7))
    assert a == list(corpora.json_docs(20, seed=7))
    for d in a:
        text = d["text"].strip()
        try:
            json.loads(text)
        except json.JSONDecodeError:  # JSON Lines documents
            for line in text.splitlines():
                json.loads(line)


def test_train_runs_logs_and_resumes(tiny) -> None:
    out = tiny["root"] / "run"
    losses = train.main(_train_args(tiny, out, layers=2, steps=4))
    assert set(losses) == set(corpora.DOMAINS)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "eval" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert evals[-1]["eval"]["json"] < evals[0]["eval"]["json"]
    state = out / "state.pt"
    assert state.is_file()
    # resume: continue the same run to 6 steps
    train.main(_train_args(tiny, out, layers=2, steps=6) + ["--resume"])
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 6
    assert json.loads((out / "summary.json").read_text())["steps"] == 6

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    tok = AutoTokenizer.from_pretrained(str(out / "hf"))
    assert model.config.num_hidden_layers == 2
    assert model.config.eos_token_id == tok.eos_token_id
    assert str(next(model.parameters()).dtype) == "torch.bfloat16"


def test_bf16_autocast_only_where_the_cpu_has_native_bf16(tmp_path) -> None:
    """Emulated bf16 (an AVX2-only CPU) made a training step 25x slower than fp32: autocast must stay off there."""
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma\n")
    sapphire = tmp_path / "spr"
    sapphire.write_text("processor : 0\nflags : fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert not train.cpu_has_native_bf16(avx2)
    assert train.cpu_has_native_bf16(sapphire)
    assert not train.cpu_has_native_bf16(tmp_path / "missing")
    assert train.parse_args(["--out", "x"]).bf16 == "auto"
    assert train.parse_args(["--out", "x", "--no-bf16"]).bf16 == "off"
    assert train.parse_args(["--out", "x", "--bf16", "on"]).bf16 == "on"
    saved = train.USE_BF16
    try:
        for enabled in (False, True):
            train.USE_BF16 = enabled
            assert train.bf16_autocast()._enabled is enabled
    finally:
        train.USE_BF16 = saved


def test_repeated_ngram_mask_marks_only_repeats_after_the_prefix() -> None:
    import torch

    seq = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    mask = train.repeated_ngram_mask(seq, start=2, n=2)
    # (1, 2) repeats at t=4 and t=7, (2, 3) at t=5, (3, 1) at t=6; the second row never repeats
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert not mask[1].any()
    assert not train.repeated_ngram_mask(seq, start=8, n=2)[0, :8].any()


def test_unlikelihood_steps_run_and_are_logged(tiny) -> None:
    out = tiny["root"] / "ul"
    train.main(_train_args(tiny, out, layers=1, steps=4) + ["--ul-every", "1", "--ul-batch", "2", "--ul-prefix",
                                                            "8", "--ul-tokens", "16", "--ul-ngram", "2"])
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    last = log[-1]
    assert last["step"] == 4 and last["ul_loss"] >= 0.0 and 0.0 <= last["ul_repeated"] <= 1.0


def test_draft_on_teacher_argmax_and_greedy_corpus(tiny) -> None:
    teacher = tiny["root"] / "teacher"
    train.main(_train_args(tiny, teacher, layers=2, steps=2))
    greedy = tiny["root"] / "greedy"
    greedy_corpus.main(["--target", str(teacher / "hf"), "--corpora", str(tiny["corpora"]), "--out", str(greedy),
                        "--sequences", "4", "--batch", "2", "--gen-tokens", "12"])
    docs = corpora.read_jsonl(greedy / "json" / "train.jsonl") + corpora.read_jsonl(greedy / "json" / "valid.jsonl")
    assert len(docs) == 4
    assert all(d["ids"][0] == 1 and len(d["ids"]) > 8 for d in docs)
    out = tiny["root"] / "draft"
    args = _train_args(tiny, out, layers=1, steps=2)
    args[args.index(str(tiny["corpora"]))] = str(greedy)
    final = train.main(args + ["--teacher", str(teacher / "hf"), "--seq-len", "16"])
    assert {f"{d}_agree" for d in corpora.DOMAINS} <= set(final)
    assert all(0.0 <= final[f"{d}_agree"] <= 1.0 for d in corpora.DOMAINS)


def test_same_seed_same_batches(tiny) -> None:
    import numpy as np

    streams = {"a": np.arange(1000, dtype=np.uint16), "b": np.arange(1000, 2000, dtype=np.uint16)}
    b1 = train.Batches(streams, {"a": 1, "b": 1}, 16, 4, seed=3)
    b2 = train.Batches(streams, {"a": 1, "b": 1}, 16, 4, seed=3)
    assert (b1.get(5) == b2.get(5)).all()
    assert not (b1.get(5) == b1.get(6)).all()


def _tiny_hf(tiny, out: Path, vocab: int | None = None, tok_dir: Path | None = None) -> Path:
    """Save a random 1-layer Llama with the tiny tokenizer (optionally another one) into ``out``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tok_dir or tiny["tok"]))
    cfg = LlamaConfig(vocab_size=vocab or len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


def test_import_pair_copies_hf_files_only(tiny, tmp_path) -> None:
    target = _tiny_hf(tiny, tmp_path / "t")
    draft = _tiny_hf(tiny, tmp_path / "d")
    repo = tmp_path / "repo"
    (repo / "target_model" / "1").mkdir(parents=True)
    keep = repo / "target_model" / "1" / "model.py"
    keep.write_text("# not ours\n")
    (repo / "target_model" / "1" / "stale.safetensors").write_text("old")
    rc = import_checkpoint.main(["--target", str(target), "--draft", str(draft), "--repo", str(repo)])
    assert rc == 0
    for role in ("target_model", "draft_model"):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (repo / role / "1" / name).is_file()
    assert keep.read_text() == "# not ours\n"
    assert not (repo / "target_model" / "1" / "stale.safetensors").exists()


def test_import_rejects_different_vocab(tiny, tmp_path) -> None:
    other_corp = tmp_path / "other"
    for dom in corpora.DOMAINS:
        docs = [{"id": f"{dom}/{i}", "source": dom, "text": f"zebra quokka {i} " * 5} for i in range(20)]
        corpora.write_jsonl(other_corp / dom / "train.jsonl", docs)
    other_tok = tmp_path / "other_tok"
    tokmod.main(["--corpora", str(other_corp), "--out", str(other_tok), "--vocab", "290"])
    target = _tiny_hf(tiny, tmp_path / "t")
    draft = _tiny_hf(tiny, tmp_path / "d", tok_dir=other_tok)
    with pytest.raises(import_checkpoint.IncompatibleCheckpoints, match="vocabularies differ"):
        import_checkpoint.import_pair(target, draft, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
    assert import_checkpoint.main(["--target", str(target), "--draft", str(draft),
                                   "--repo", str(tmp_path / "repo")]) == 2


def test_import_carries_a_draft_proposal_vocabulary(tiny, tmp_path) -> None:
    target = _tiny_hf(tiny, tmp_path / "t")
    draft = _tiny_hf(tiny, tmp_path / "d")
    repo = tmp_path / "repo"
    (draft / "proposal_vocab.json").write_text(json.dumps({"token_ids": [0, 1, 2, 7]}))
    import_checkpoint.import_pair(target, draft, repo)
    assert json.loads((repo / "draft_model" / "1" / "proposal_vocab.json").read_text())["token_ids"] == [0, 1, 2, 7]
    (draft / "proposal_vocab.json").unlink()  # a new draft without one: the old subset must not survive
    import_checkpoint.import_pair(target, draft, repo)
    assert not (repo / "draft_model" / "1" / "proposal_vocab.json").exists()
    (draft / "proposal_vocab.json").write_text(json.dumps({"token_ids": [0, 10_000]}))
    with pytest.raises(import_checkpoint.IncompatibleCheckpoints, match="proposal vocabulary"):
        import_checkpoint.check_compatible(target, draft)


def test_import_rejects_vocab_size_mismatch(tiny, tmp_path) -> None:
    target = _tiny_hf(tiny, tmp_path / "t")
    draft = _tiny_hf(tiny, tmp_path / "d", vocab=512)
    with pytest.raises(import_checkpoint.IncompatibleCheckpoints, match="vocab_size differs"):
        import_checkpoint.check_compatible(target, draft)


def test_measure_pair_tau() -> None:
    import measure_pair

    assert measure_pair.tau_formula(0.0, 4) == 1.0
    assert measure_pair.tau_formula(1.0, 4) == 5.0
    assert abs(measure_pair.tau_formula(0.5, 2) - 1.75) < 1e-9
    # all matches: every pass emits k+1 tokens (the last pass is cut by the end of the sequence)
    assert measure_pair.tau_simulated([[True] * 8], k=3) == 4.0
    # no match: one token per pass
    assert measure_pair.tau_simulated([[False] * 5], k=3) == 1.0
    # T T F | T F: passes emit 3 (two accepted + bonus), then 2
    assert measure_pair.tau_simulated([[True, True, False, True, False]], k=4) == 2.5
    assert measure_pair.distinct4([1, 2, 3, 4] * 5) < 0.3 < measure_pair.distinct4(list(range(20)))


def test_greedy_quality_finds_loops_and_reads_training_state(tiny) -> None:
    import greedy_quality

    assert greedy_quality.tail_cycle(list(range(40)) + [7, 8, 9] * 30) == 3
    assert greedy_quality.tail_cycle([5] * 80) == 1
    assert greedy_quality.tail_cycle(list(range(200))) == 0
    run = tiny["root"] / "quality"
    train.main(_train_args(tiny, run, layers=1, steps=2))
    rows = greedy_quality.main([str(run / "state.pt"), str(run / "hf"), "--reference", "--tokenizer",
                                str(tiny["tok"]), "--corpora", str(tiny["corpora"]), "--prompts", "2",
                                "--prompt-tokens", "8"])
    assert [r["checkpoint"] for r in rows] == ["held-out text", str(run / "state.pt"), str(run / "hf")]
    assert rows[1]["step"] == 2
    for row in rows:
        assert set(corpora.DOMAINS) <= set(row)
        assert all(0.0 <= row[d]["distinct4_mean"] <= 1.0 and row[d]["prompts"] >= 1 for d in corpora.DOMAINS)
        assert 0 <= row["json"]["json_valid_of_finished"] <= row["json"]["json_finished"]
        assert all(row[d]["broken_per_1k_tokens"] >= 0.0 for d in corpora.DOMAINS)


def test_broken_chars_counts_only_the_continuations_incomplete_bytes(tiny) -> None:
    import greedy_quality
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny["tok"]))
    prompt = tok("def f():")["input_ids"]
    whole = tok("def f(): return 'é'")["input_ids"]
    assert greedy_quality.broken_chars(tok, prompt, whole[len(prompt):]) == 0
    lead_byte = tok.convert_tokens_to_ids("Ã")  # byte-level BPE's token for 0xC3, the first byte of "é"
    assert lead_byte != tok.unk_token_id
    assert greedy_quality.broken_chars(tok, prompt, [lead_byte] + tok(" x", add_special_tokens=False)["input_ids"]) == 1
