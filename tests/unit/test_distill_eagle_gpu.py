"""build/distill_eagle_gpu.py on a tiny random Llama, on the CPU: batched left-padded answers are what the
target writes one sequence at a time, the features kept in memory give train_eagle's batches exactly, and a
budgeted run trains and writes the installable head."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build"))

import distill_eagle_gpu as gpu  # noqa: E402
import eagle_features  # noqa: E402
import train_eagle  # noqa: E402

VOCAB, HIDDEN, EOS = 300, 64, 2
AUX = (0,)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A random 2-layer Llama and 12 answer plans of various prompt lengths, 3 of them sampled."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("eagle_gpu")
    target = root / "target"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=EOS, pad_token_id=EOS, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(str(target))
    rng = random.Random(1)
    plan = [{"id": f"s/req-{i}" + ("/sampled" if i % 4 == 3 else ""), "sampled": i % 4 == 3, "held_out": i < 3,
             "request": {"id": f"s/req-{i}", "source_id": f"req-{i}", "domain": ("code", "json", "prose")[i % 3],
                         "kind": "k"},
             "prompt_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 30))]} for i in range(12)]
    return {"root": root, "target": target, "plan": plan}


@pytest.fixture(autouse=True)
def short_answers(monkeypatch):
    for domain in ("code", "json", "prose"):
        monkeypatch.setitem(gpu.MAX_NEW_TOKENS, domain, 14)


def _answers(tiny, batch_size: int = 4):
    recorder = eagle_features.FeatureRecorder(tiny["target"], aux_layers=AUX)
    rows = gpu.answer(recorder.model, tiny["plan"], [EOS], recorder.pad_id, batch_size, time.monotonic() + 600,
                      7, torch.device("cpu"), progress=lambda _: None)
    return recorder, rows


def test_batched_left_padded_answers_are_the_targets_own_greedy_answers(tiny) -> None:
    recorder, rows = _answers(tiny)
    assert sorted(r["id"] for r in rows) == sorted(e["id"] for e in tiny["plan"])
    model = recorder.model
    for row in rows:
        assert 1 <= len(row["answer_ids"]) <= 14
        if row["mode"] != "greedy":
            continue
        ids, expected = torch.as_tensor([row["prompt_ids"]]), []
        with torch.no_grad():
            for _ in range(14):  # one sequence, no padding, incremental argmax
                token = int(model(input_ids=ids).logits[0, -1].argmax())
                expected.append(token)
                if token == EOS:
                    break
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        assert row["answer_ids"] == expected, row["id"]
    # Cut off by the deadline: none answered, nothing fails.
    assert gpu.answer(model, tiny["plan"], [EOS], recorder.pad_id, 4, time.monotonic() - 1, 7,
                      torch.device("cpu")) == []


def test_answers_made_beforehand_replace_their_plan_entries(tiny, tmp_path) -> None:
    plan = [dict(entry) for entry in tiny["plan"]]
    greedy, sampled, other = plan[0], plan[3], plan[1]
    made = tmp_path / "answers.jsonl"
    lines = [
        {"id": "req-0", "domain": "code", "kind": "k", "mode": "greedy", "prompt_ids": greedy["prompt_ids"],
         "answer_ids": [5, 6, EOS]},
        {"id": "req-3", "domain": "code", "kind": "k", "mode": "sampled", "prompt_ids": sampled["prompt_ids"],
         "answer_ids": [7]},
        {"id": "req-1", "domain": "json", "kind": "k", "mode": "greedy", "prompt_ids": [9, 9],  # another prompt
         "answer_ids": [8]},
        {"id": "req-999", "domain": "json", "kind": "k", "mode": "greedy", "prompt_ids": [4], "answer_ids": [4]},
        {"id": "req-0", "domain": "code", "kind": "k", "mode": "sampled", "prompt_ids": greedy["prompt_ids"],
         "answer_ids": [4]},  # req-0 has no sampled entry in the plan
    ]
    made.write_text("\n".join(json.dumps(line) for line in lines) + '\n{"id": "req-2", "mo', encoding="utf-8")
    rows = gpu.answers_made_before(plan, [made])
    assert [(r["id"], r["mode"], r["answer_ids"]) for r in rows] == [
        (greedy["id"], "greedy", [5, 6, EOS]), (sampled["id"], "sampled", [7])]
    assert rows[0]["held_out"] == greedy["held_out"] and rows[1]["held_out"] == sampled["held_out"]
    assert greedy not in plan and sampled not in plan and other in plan and len(plan) == len(tiny["plan"]) - 2
    # Every request file numbers its requests alike: req-0 of another file, another prompt, is not answered by
    # the row; the same prompt in two files is answered once per row that answers it.
    first = tiny["plan"][0]
    other_file = {**first, "id": "t/req-0", "request": {**first["request"], "id": "t/req-0"}, "prompt_ids": [4, 4]}
    same_prompt = {**first, "id": "u/req-0", "request": {**first["request"], "id": "u/req-0"}}
    twice = [dict(first), other_file, same_prompt]
    rows = gpu.answers_made_before(twice, [made])
    assert [r["id"] for r in rows] == [first["id"]] and twice == [other_file, same_prompt]
    made.write_text(json.dumps(lines[0]) + "\n" + json.dumps(lines[0]) + "\n", encoding="utf-8")
    twice = [dict(first), other_file, same_prompt]
    rows = gpu.answers_made_before(twice, [made])
    assert [r["id"] for r in rows] == [first["id"], "u/req-0"] and twice == [other_file]
    assert gpu.answers_made_before(twice, []) == [] and twice == [other_file]
    # A run's own answers.jsonl.gz names rows by the plan's ids (file stem and, for sampled ones, "/sampled").
    plan = [dict(entry) for entry in tiny["plan"]] + [other_file]
    own = [{**lines[0], "id": first["id"]}, {**lines[1], "id": sampled["id"]},
           {**lines[0], "id": other_file["id"], "prompt_ids": other_file["prompt_ids"], "answer_ids": [3]}]
    assert sampled["id"].endswith("/sampled")
    with gzip.open(tmp_path / "answers.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(row) + "\n" for row in own))
    rows = gpu.answers_made_before(plan, [tmp_path / "answers.jsonl.gz"])
    assert [(r["id"], r["answer_ids"]) for r in rows] == [
        (first["id"], [5, 6, EOS]), (sampled["id"], [7]), (other_file["id"], [3])]
    assert len(plan) == len(tiny["plan"]) - 2
    # target_answers --sampling names a request's answers <request id>@<mode>; the plan samples at t0.7 only.
    plan = [dict(entry) for entry in tiny["plan"]]
    modes = [{**lines[1], "id": "req-3@t1.0", "answer_ids": [2]}, {**lines[1], "id": "req-3@t0.7", "answer_ids": [1]}]
    made.write_text("".join(json.dumps(row) + "\n" for row in modes), encoding="utf-8")
    rows = gpu.answers_made_before(plan, [made])
    assert [(r["id"], r["answer_ids"]) for r in rows] == [(sampled["id"], [1])] and sampled not in plan


def test_request_ids_are_made_unique_per_file(tmp_path) -> None:
    first, second = tmp_path / "chat1.jsonl", tmp_path / "chat2.jsonl"
    first.write_text('{"id": "code-1", "domain": "code"}\n\n', encoding="utf-8")
    second.write_text('{"id": "code-1", "domain": "code"}\n', encoding="utf-8")
    assert [(r["id"], r["source_id"]) for r in gpu.read_requests([first, second])] == [
        ("chat1/code-1", "code-1"), ("chat2/code-1", "code-1")]


def test_features_on_the_device_give_train_eagles_batches(tiny, tmp_path) -> None:
    recorder, rows = _answers(tiny)
    store = gpu.FeatureStore(sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in rows), HIDDEN,
                             len(AUX) * HIDDEN, torch.device("cpu"))
    examples, summary = gpu.record(recorder, rows, store, 256, 3)
    assert summary["greedy_match"] == 1.0 and summary["examples"] == len(examples) == len(rows)
    # The same answers through the on-disk path: shards, index, train_eagle.collate.
    answers = tmp_path / "answers.jsonl"
    gpu.write_answers(rows, tmp_path)
    answers.write_bytes(gzip.decompress((tmp_path / "answers.jsonl.gz").read_bytes()))
    eagle_features.main(["--target", str(tiny["target"]), "--answers", str(answers), "--out", str(tmp_path / "f"),
                         "--aux-layers", ",".join(map(str, AUX)), "--no-progress"])
    on_disk, _, arrays = train_eagle.load_features([tmp_path / "f"], 0.0, 768, aux=True)
    by_ids = {tuple(e["ids"]): e for e in examples}
    batch = on_disk[:5]
    expected = train_eagle.collate(batch, arrays)
    got = gpu.gpu_collate([by_ids[tuple(e["ids"])] for e in batch], store)
    assert set(got) == set(expected)
    for key in ("ids", "rows", "mask"):
        assert torch.equal(got[key], expected[key]), key
    for key in ("feats", "aux"):  # fp16 storage of the same forward (batches of other shapes: last-bit noise)
        torch.testing.assert_close(got[key], expected[key], atol=2e-3, rtol=2e-3)


def test_a_budgeted_run_trains_and_writes_the_installable_head(tiny, tmp_path) -> None:
    recorder, rows = _answers(tiny)
    store = gpu.FeatureStore(10_000, HIDDEN, len(AUX) * HIDDEN, torch.device("cpu"))
    examples, _ = gpu.record(recorder, rows, store, 256, 3)
    torch.manual_seed(0)
    head = train_eagle.EagleHead(tiny["target"], list(range(VOCAB)), 1, "feature", 0.02, seed=3, aux_layers=AUX)
    args = argparse.Namespace(lr=1e-3, warmup=2, min_lr_frac=0.1, probe_steps=2, evals=2, tokens_per_batch=256,
                              seed=5, feature_weight=0.5, ttt_weight=1.0, answer_temperatures=True, tv_weight=0.5)
    logged = []
    result = gpu.train(head, [e for e in examples if not e["held_out"]],
                       [e for e in examples if e["held_out"] and e["mode"] == "greedy"], store, args,
                       time.monotonic() + 3.0, tmp_path, logged.append)
    assert result["steps"] >= 5 and result["start"]["step"] == 0
    probe = next(r["probe"] for r in logged if isinstance(r, dict) and "probe" in r)
    assert probe["steps"] == result["steps"]
    assert sum("agreement" in r for r in logged if isinstance(r, dict)) == 3  # the start and --evals
    for name in ("config.json", train_eagle.EAGLE_WEIGHTS, "proposal_vocab.json", "agreement.json"):
        assert (tmp_path / name).is_file()
    assert json.loads((tmp_path / "agreement.json").read_text())["step"] == result["best"]["step"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["specdec_eagle"]["aux_layers"] == list(AUX) and config["num_hidden_layers"] == 1


def test_the_schedule_warms_up_then_decays_over_the_fitted_steps() -> None:
    args = argparse.Namespace(lr=1.0, warmup=10, min_lr_frac=0.1)
    assert gpu._lr(0, None, args) == pytest.approx(0.1)
    assert gpu._lr(500, None, args) == 1.0  # before the probe fixes the step count: the peak
    assert gpu._lr(10, 110, args) == pytest.approx(1.0)
    assert gpu._lr(60, 110, args) == pytest.approx(0.55)
    assert gpu._lr(110, 110, args) == pytest.approx(0.1)
