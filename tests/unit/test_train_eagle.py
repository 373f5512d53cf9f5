"""build/eagle_features.py and build/train_eagle.py on a tiny random Llama: the recorded features are the
target's, the head's math is a Llama layer over fc rows (its unrolled step sees what inference sees), training
lowers the loss, the checkpoint is the installable folder, and a resumed run goes on where it stopped."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

BUILD = Path(__file__).resolve().parents[2] / "build"
sys.path.insert(0, str(BUILD))

import eagle_features  # noqa: E402
import train_eagle  # noqa: E402

VOCAB, HIDDEN = 300, 64
EXPECTED_TENSORS = {f"model.layers.0.{k}" for k in train_eagle.LAYER_KEYS} | {"model.norm.weight", "eagle.fc.weight"}


@pytest.fixture(autouse=True)
def one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """A random 2-layer Llama (tied embeddings, GQA 4/2 heads) and answers it wrote greedily or by sampling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("eagle")
    target = root / "target"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(target))
    rng = random.Random(0)
    rows = []
    with torch.no_grad():
        for i in range(48):
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 24))]
            mode = "sampled" if i % 4 == 3 else "greedy"
            ids = torch.as_tensor([prompt])
            if mode == "greedy":
                answer = []
                for _ in range(rng.randrange(8, 20)):  # incremental greedy decoding, as target_answers does
                    nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                    answer.append(nxt)
                    ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            else:
                answer = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 20))]
            rows.append({"id": f"req-{i:06d}", "domain": ("code", "json", "prose")[i % 3], "kind": "k",
                         "mode": mode, "prompt_ids": prompt, "answer_ids": answer})
    answers = root / "answers.jsonl"
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    features = root / "features"
    summary = eagle_features.main(["--target", str(target), "--answers", str(answers), "--out", str(features),
                                   "--tokens-per-batch", "256", "--shard-tokens", "400", "--no-progress"])
    return {"root": root, "target": target, "answers": answers, "features": features, "rows": rows,
            "model": model, "summary": summary}


def test_features_are_the_targets_final_normed_states(tiny) -> None:
    summary = tiny["summary"]
    assert summary["examples"] == 48
    assert summary["greedy_checked"] > 300
    assert summary["greedy_match"] == 1.0  # argmax(f_t @ E^T) is every greedy answer's next token
    index = eagle_features.read_index(tiny["features"])
    assert sorted(r["id"] for r in index) == sorted(r["id"] for r in tiny["rows"])
    assert len({r["shard"] for r in index}) > 1  # --shard-tokens cut it into shards
    by_id = {r["id"]: r for r in tiny["rows"]}
    model = tiny["model"]
    for row in index[:5]:
        src = by_id[row["id"]]
        ids = src["prompt_ids"] + src["answer_ids"]
        assert row["ids"] == ids and row["prompt_len"] == len(src["prompt_ids"]) and row["length"] == len(ids)
        stored = eagle_features.np.load(tiny["features"] / eagle_features.FEATURES.format(row["shard"]))
        stored = torch.from_numpy(stored[row["offset"]:row["offset"] + row["length"]].astype("float32"))
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor([ids])).logits[0]
        # What the output layer reads: E f_t is the target's logits (float16 storage aside).
        torch.testing.assert_close(stored @ model.model.embed_tokens.weight.T, logits, atol=2e-2, rtol=1e-2)
        assert torch.equal((stored @ model.model.embed_tokens.weight.T).argmax(-1), logits.argmax(-1))


def test_feature_recording_resumes_without_repeating(tiny) -> None:
    before = len(eagle_features.read_index(tiny["features"]))
    summary = eagle_features.main(["--target", str(tiny["target"]), "--answers", str(tiny["answers"]),
                                   "--out", str(tiny["features"]), "--no-progress"])
    assert summary["examples"] == 0
    assert len(eagle_features.read_index(tiny["features"])) == before


def test_stages_reusing_ids_for_other_examples_are_all_trained_on(tiny, tmp_path) -> None:
    """Two stages' folders reuse ids (request ids of another seed): a duplicate is the same sequence."""
    import shutil

    other = tmp_path / "other_stage"
    shutil.copytree(tiny["features"], other)
    for index in other.glob("index_*.jsonl"):
        rows = [json.loads(line) for line in index.read_text(encoding="utf-8").splitlines() if line.strip()]
        for row in rows[1:]:  # the first stays the same example: loaded once
            row["ids"] = row["ids"][:-1]  # another example (one token shorter) under the same id
        index.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    one = train_eagle.load_features([tiny["features"]], 0.0, 768)[0]
    both = train_eagle.load_features([tiny["features"], other], 0.0, 768)[0]
    sequences = [tuple(example["ids"]) for example in both]
    assert len(set(sequences)) == len(sequences)  # no example twice (the unchanged first one included)
    assert len(both) > 1.5 * len(one)  # keyed by id, the second folder would add nothing
    # The held-out agreement's cache of the target's argmax is per example too, not per id.
    _, _, arrays = train_eagle.load_features([tiny["features"], other], 0.0, 768)
    head, cache = _head(tiny), {}
    train_eagle.agreement(head, [e for e in both if e["src"][0] == 0], arrays, 4096, cache)
    second = [e for e in both if e["src"][0] == 1]
    assert train_eagle.agreement(head, second, arrays, 4096, cache) == train_eagle.agreement(
        head, second, arrays, 4096, {})


def _head(tiny, init_layer: int = 1, fc_init: str = "feature") -> train_eagle.EagleHead:
    torch.manual_seed(0)
    return train_eagle.EagleHead(tiny["target"], list(range(VOCAB)), init_layer, fc_init, 0.02, seed=3)


def _batch(tiny, n: int = 6) -> dict:
    train, valid, arrays = train_eagle.load_features([tiny["features"]], 0.0, 768)
    return train_eagle.collate(train[:n], arrays), train[:n]


def test_head_step_one_is_a_llama_layer_over_fc_rows(tiny, tmp_path) -> None:
    """Saved and reloaded as Hugging Face Llama (1 layer), the checkpoint computes the head's g from z."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaModel

    head = _head(tiny)
    with torch.no_grad():
        head.eagle.fc.raw.normal_(0, 0.1)  # not the pass-through start: both halves matter
    train_eagle.save_head(head, list(range(VOCAB)), tmp_path / "ckpt")
    state = load_file(str(tmp_path / "ckpt" / train_eagle.EAGLE_WEIGHTS))
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    hf = LlamaModel(LlamaConfig(**{k: v for k, v in config.items() if k != "specdec_eagle"})).eval()
    missing = hf.load_state_dict({k[len("model."):]: v.float() for k, v in state.items() if k.startswith("model.")},
                                 strict=False)
    assert missing.missing_keys == ["embed_tokens.weight"] and not missing.unexpected_keys
    head.load_own(state)  # the bf16-rounded weights on both sides
    batch, examples = _batch(tiny, 1)
    ids, feats = batch["ids"], batch["feats"]
    rows = torch.arange(ids.shape[1] - 1)[None]
    with torch.no_grad():
        g, _ = head(ids, feats, rows, ttt=False)
        embed = head.embed.float()[ids[:, 1:]]
        z = torch.cat([embed, feats[:, :-1]], -1) @ state["eagle.fc.weight"].float().T
        want = hf(inputs_embeds=z).last_hidden_state
    torch.testing.assert_close(g, want, atol=1e-4, rtol=1e-4)


def test_unrolled_step_sees_what_inference_sees(tiny) -> None:
    """Unrolled row j = the head run on x_0..x_{j+1} whose row j reads g_{j-1} instead of f_j: attention over the
    true rows < j and its own row, at RoPE position j."""
    head = _head(tiny, init_layer=0, fc_init="both")
    batch, examples = _batch(tiny, 1)
    ids, feats = batch["ids"], batch["feats"]
    n = ids.shape[1] - 1
    rows = torch.arange(n)[None]
    with torch.no_grad():
        g, g2 = head(ids, feats, rows)
        assert g2.shape[1] == n - 1
        for j in (1, n // 2, n - 1):
            fed = feats[:, :j + 2].clone()
            fed[:, j] = g[:, j - 1]
            alone, _ = head(ids[:, :j + 2], fed, torch.arange(j + 1)[None], ttt=False)
            torch.testing.assert_close(g2[:, j - 1], alone[:, j], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(g2[:, j - 1], g[:, j], atol=1e-3)


def test_collate_masks_answer_rows_only(tiny) -> None:
    batch, examples = _batch(tiny, 4)
    for b, ex in enumerate(examples):
        rows, mask = batch["rows"][b], batch["mask"][b]
        chosen = rows[mask].tolist()
        assert chosen == list(range(max(ex["start"] - 2, 0), len(ex["ids"]) - 2))  # x_{j+2} on the answer
        assert rows[0] == max(ex["start"] - 3, 0)
        pad = batch["feats"][b, len(ex["ids"]):]
        torch.testing.assert_close(pad, torch.zeros_like(pad))


def test_a_few_steps_lower_the_loss(tiny) -> None:
    head = _head(tiny)
    batch, _ = _batch(tiny, 8)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(12):
        loss, parts = train_eagle.losses(head, batch, 0.5, 1.0, False, False)
        first = first if first is not None else parts
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, last = train_eagle.losses(head, batch, 0.5, 1.0, False, False)
    assert {"ce", "kl", "l1", "ce2", "kl2", "l12"} <= set(last)
    assert last["kl"] < 0.7 * first["kl"] and last["kl2"] < 0.8 * first["kl2"]
    assert last["l1"] < first["l1"]


def _oracle(shift: int):
    """A head's forward that predicts the feature ``shift`` rows on (1: the target's own next feature)."""
    def forward(ids, feats, rows, ttt=True, detach=False):
        g = train_eagle._take(feats[:, shift:], rows)
        return g, g[:, 1:]
    return forward


def test_agreement_scores_the_targets_argmax(tiny, monkeypatch) -> None:
    """A head whose g is exactly f_{j+1} agrees everywhere (full proposal vocabulary), one that predicts f_j
    (the feature it was fed) agrees only where the target repeats its argmax."""
    head = _head(tiny)
    train, _, arrays = train_eagle.load_features([tiny["features"]], 0.0, 768)
    examples = [ex for ex in train if ex["mode"] == "greedy"][:10]

    monkeypatch.setattr(head, "forward", _oracle(1))
    one, two = train_eagle.agreement(head, examples, arrays, 256, {})
    assert set(one.values()) == {1.0} and set(two.values()) == {1.0}
    monkeypatch.setattr(head, "forward", _oracle(0))
    one, _ = train_eagle.agreement(head, examples, arrays, 256, {})
    assert max(one.values()) < 0.5


def test_sampling_probs_are_the_servers() -> None:
    from specdec.sampling import SamplingParams, probabilities

    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    for temperature, top_p in ((0.7, 0.95), (1.0, 1.0), (0.5, 0.3)):
        want = probabilities(logits.double().numpy(), SamplingParams(temperature=temperature, top_p=top_p))
        got = train_eagle.sampling_probs(logits, temperature, top_p)
        torch.testing.assert_close(got.double(), torch.from_numpy(want), atol=1e-6, rtol=1e-5)


def test_overlap_is_the_acceptance_of_speculative_sampling(tiny, monkeypatch) -> None:
    """sum min(p, q) on sampled answers at their temperature: 1 for a head that predicts the target's own next
    feature (the whole vocabulary proposed), less for one that repeats the feature it read; and it is the rate at
    which speculative sampling's verification accepts a token drawn from q (counted over draws)."""
    from specdec.rejection_sampler import rejection_verify

    head = _head(tiny)
    train, _, arrays = train_eagle.load_features([tiny["features"]], 0.0, 768)
    examples = [ex for ex in train if ex["sampling"] == "t0.7"]
    assert examples and all(ex["mode"] == "sampled" for ex in examples)
    monkeypatch.setattr(head, "forward", _oracle(1))
    one, two = train_eagle.overlap(head, examples, arrays, 256)
    assert set(one) == {f"{ex['domain']} t0.7" for ex in examples} and set(two) == set(one)
    assert all(v == pytest.approx(1.0, abs=1e-4) for v in [*one.values(), *two.values()]), (one, two)
    monkeypatch.setattr(head, "forward", _oracle(0))
    behind, _ = train_eagle.overlap(head, examples, arrays, 256)
    assert all(0.0 < v < 0.9 for v in behind.values())

    batch = train_eagle.collate(examples[:1], arrays)
    feats = batch["feats"][0]
    p = train_eagle.sampling_probs(feats[5] @ head.embed.float().T, 0.7, 0.95).double().numpy()
    q = train_eagle.sampling_probs(feats[4] @ head.embed.float().T, 0.7, 0.95).double().numpy()
    rng = np.random.default_rng(0)
    draws = 4000
    accepted = sum(rejection_verify([int(rng.choice(VOCAB, p=q / q.sum()))], [-1], np.stack([p, p]),
                                    q[None], rng).accepted for _ in range(draws))
    assert accepted / draws == pytest.approx(float(np.minimum(p, q).sum()), abs=0.03)


def test_losses_compare_sampled_answers_at_their_temperature(tiny, monkeypatch) -> None:
    head = _head(tiny)
    train, _, arrays = train_eagle.load_features([tiny["features"]], 0.0, 768)
    batch = train_eagle.collate([ex for ex in train if ex["sampling"] == "t0.7"][:4], arrays)
    assert batch["temperature"].tolist() == pytest.approx([0.7] * 4)
    _, at_one = train_eagle.losses(head, batch, 0.5, 1.0, False, False)
    loss, at_answer = train_eagle.losses(head, batch, 0.5, 1.0, False, False, temperatures=True, tv_weight=1.0)
    assert at_answer["ce"] != at_one["ce"] and 0.0 < at_answer["tv"] < 1.0 and "tv" not in at_one
    loss.backward()  # the total variation is differentiable where p != q
    monkeypatch.setattr(head, "forward", _oracle(1))
    _, exact = train_eagle.losses(head, batch, 0.5, 1.0, False, False, temperatures=True, tv_weight=1.0)
    assert exact["tv"] == pytest.approx(0.0, abs=1e-4) and exact["kl"] == pytest.approx(0.0, abs=1e-4)


def _train_args(tiny, out: Path, steps: int) -> list[str]:
    return ["--target", str(tiny["target"]), "--features", str(tiny["features"]), "--out", str(out),
            "--init-layer", "1", "--proposal-vocab", "200", "--steps", str(steps), "--tokens-per-batch", "100000",
            "--lr", "3e-3", "--warmup", "0", "--min-lr-frac", "1.0", "--valid-frac", "0.25", "--eval-every", "2",
            "--ckpt-every", "2", "--threads", "1", "--no-bf16", "--seed", "5", "--no-progress"]


def test_a_given_proposal_vocabulary_widened_by_the_training_answers(tiny, tmp_path) -> None:
    given = tmp_path / "proposal_vocab.json"
    given.write_text(json.dumps({"token_ids": [5, 6, 7]}))
    args = _train_args(tiny, tmp_path / "run", 0)
    at = args.index("--proposal-vocab")
    args[at:at + 2] = ["--proposal-vocab-file", str(given), "--proposal-vocab-add", "40"]
    train_eagle.main(args)
    vocab = json.loads((tmp_path / "run/best/proposal_vocab.json").read_text())["token_ids"]
    assert {5, 6, 7, 1, 2} <= set(vocab) and 40 <= len(vocab) <= 45 and vocab == sorted(vocab)


def test_a_saved_head_does_not_take_the_targets_fused_layers(tiny, tmp_path) -> None:
    """The target lists the layers it returns for a fused head (FEATURE_LAYERS_KEY); the head's own config,
    copied from the target's, must not: the head is one layer and fuses nothing itself."""
    head = _head(tiny)
    head.config = {**head.config, train_eagle.FEATURE_LAYERS_KEY: [0]}
    train_eagle.save_head(head, list(range(VOCAB)), tmp_path / "head")
    assert train_eagle.FEATURE_LAYERS_KEY not in json.loads((tmp_path / "head/config.json").read_text())


def test_training_writes_the_installable_head_and_resumes(tiny, tmp_path) -> None:
    from safetensors import safe_open

    out = tmp_path / "run"
    train_eagle.main(_train_args(tiny, out, 4))
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert log[-1]["loss"] < log[0]["loss"]  # one batch holds all the training rows: the same batch each step
    assert set(log[-1]["agreement"]) == {"code", "json", "prose"} and set(log[-1]["agreement_step2"]) == {
        "code", "json", "prose"}
    best = out / "best"
    with safe_open(str(best / train_eagle.EAGLE_WEIGHTS), "pt") as f:
        assert set(f.keys()) == EXPECTED_TENSORS
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())  # noqa: SIM118
        assert list(f.get_tensor("eagle.fc.weight").shape) == [HIDDEN, 2 * HIDDEN]
    config = json.loads((best / "config.json").read_text())
    target_config = json.loads((tiny["target"] / "config.json").read_text())
    assert config["specdec_eagle"] == {"feature_size": HIDDEN, "feature": "final_norm"}
    same = lambda c: {k: v for k, v in c.items() if k not in ("num_hidden_layers", "specdec_eagle")}  # noqa: E731
    assert same(config) == same(target_config)
    assert config["num_hidden_layers"] == 1
    vocab = json.loads((best / "proposal_vocab.json").read_text())["token_ids"]
    assert len(vocab) == 200 and {1, 2} <= set(vocab) and vocab == sorted(vocab)
    agreement = json.loads((best / "agreement.json").read_text())
    assert agreement["step"] in (0, 2, 4) and set(agreement["agreement_step2"]) == {"code", "json", "prose"}
    assert agreement["overlap"] and all(k.endswith(" t0.7") and 0 < v < 1 for k, v in agreement["overlap"].items())

    # Resume to 6 steps: the same weights as one uninterrupted 6-step run.
    train_eagle.main(_train_args(tiny, out, 6) + ["--resume"])
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    straight = tmp_path / "straight"
    train_eagle.main(_train_args(tiny, straight, 6))
    resumed = torch.load(out / "state.pt", weights_only=False)
    whole = torch.load(straight / "state.pt", weights_only=False)
    assert resumed["step"] == whole["step"] == 6
    for k, v in whole["model"].items():
        torch.testing.assert_close(resumed["model"][k], v, atol=1e-6, rtol=1e-5)
    initial = _head(tiny, init_layer=1)
    assert not torch.allclose(initial.state_dict()["eagle.fc.raw"], whole["model"]["eagle.fc.raw"])


def test_init_from_a_trained_draft_or_head(tiny, tmp_path) -> None:
    """--init-from: a 1-layer draft's layer and norm (fc keeps its init), or a saved head's every tensor."""
    from safetensors.torch import load_file, save_file

    head = _head(tiny)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    train_eagle.save_head(head, list(range(VOCAB)), tmp_path / "head")
    saved = load_file(str(tmp_path / "head" / train_eagle.EAGLE_WEIGHTS))
    again = train_eagle.EagleHead(tiny["target"], list(range(VOCAB)), 0, "feature", 0.0, 3, tmp_path / "head")
    for k, v in again.own_state().items():
        torch.testing.assert_close(v.float(), saved[k].float())
    draft = tmp_path / "draft"
    draft.mkdir()
    save_file({k: v for k, v in saved.items() if k != "eagle.fc.weight"}, str(draft / "draft_layers.safetensors"))
    from_draft = train_eagle.EagleHead(tiny["target"], list(range(VOCAB)), 0, "embedding", 0.0, 3, draft)
    torch.testing.assert_close(from_draft.model.norm.weight, saved["model.norm.weight"].float())
    fc = from_draft.eagle.fc.weight
    assert torch.equal(fc[:, :HIDDEN], torch.eye(HIDDEN)) and not fc[:, HIDDEN:].any()


def test_fusion_records_lower_layers_and_starts_as_the_plain_head(tiny, tmp_path) -> None:
    """EAGLE-3 fusion: --aux-layers records those layers' outputs beside the features; a fused head starts as the
    head it was (fc_aux at zero), learns fc_aux, saves it, and names the layers in its config."""
    from safetensors import safe_open

    fused = tmp_path / "fused"
    eagle_features.main(["--target", str(tiny["target"]), "--answers", str(tiny["answers"]), "--out", str(fused),
                         "--tokens-per-batch", "256", "--shard-tokens", "400", "--aux-layers", "0",
                         "--no-progress"])
    assert json.loads((fused / eagle_features.AUX_LAYERS_FILE).read_text()) == [0]
    with pytest.raises(SystemExit):  # one folder, one choice of layers
        eagle_features.main(["--target", str(tiny["target"]), "--answers", str(tiny["answers"]), "--out",
                             str(fused), "--no-progress"])
    row = eagle_features.read_index(fused)[0]
    aux = eagle_features.np.load(fused / eagle_features.AUX.format(row["shard"]))
    assert aux.shape[1:] == (1, HIDDEN)
    with torch.no_grad():
        hidden = tiny["model"].model(input_ids=torch.as_tensor([row["ids"]]), output_hidden_states=True)
    stored = torch.from_numpy(aux[row["offset"]:row["offset"] + row["length"], 0].astype("float32"))
    torch.testing.assert_close(stored, hidden.hidden_states[1][0], atol=2e-2, rtol=1e-2)  # layer 0's output

    train, _, arrays = train_eagle.load_features([fused], 0.0, 768, aux=True)
    batch = train_eagle.collate(train[:4], arrays)
    assert batch["aux"].shape == (*batch["ids"].shape, HIDDEN)
    plain = _head(tiny)
    torch.manual_seed(0)
    head = train_eagle.EagleHead(tiny["target"], list(range(VOCAB)), 1, "feature", 0.02, seed=3, aux_layers=(0,))
    with torch.no_grad():
        g, g2 = head(batch["ids"], batch["feats"], batch["rows"], aux=batch["aux"])
        want, want2 = plain(batch["ids"], batch["feats"], batch["rows"])
    torch.testing.assert_close(g, want)
    torch.testing.assert_close(g2, want2)
    with pytest.raises(ValueError):
        head(batch["ids"], batch["feats"], batch["rows"])

    out = tmp_path / "run"
    args = _train_args(tiny, out, 2)
    args[args.index("--features") + 1] = str(fused)
    train_eagle.main(args + ["--aux"])
    config = json.loads((out / "last" / "config.json").read_text())
    # The servable form: one fc over [embedding, feature, aux layer], a feature two hidden sizes wide.
    assert config["specdec_eagle"] == {"feature_size": 2 * HIDDEN, "feature": "final_norm", "aux_layers": [0]}
    with safe_open(str(out / "last" / train_eagle.EAGLE_WEIGHTS), "pt") as f:
        assert set(f.keys()) == EXPECTED_TENSORS
        fc = f.get_tensor("eagle.fc.weight").float()
    assert list(fc.shape) == [HIDDEN, 3 * HIDDEN] and fc[:, 2 * HIDDEN:].abs().sum() > 0  # the fusion learnt
    again = train_eagle.EagleHead(tiny["target"], list(range(VOCAB)), 1, "feature", 0.0, 3, out / "last",
                                  aux_layers=(0,))
    torch.testing.assert_close(again.eagle.fc_aux.weight, fc[:, 2 * HIDDEN:])
    torch.testing.assert_close(again.eagle.fc.weight, fc[:, :2 * HIDDEN])
    from specdec.checkpoint import read_spec

    spec = read_spec(out / "last")
    assert spec.eagle_feature_size == 2 * HIDDEN and spec.eagle_aux_layers == (0,)
    with pytest.raises(SystemExit):  # --aux on features recorded without aux layers
        train_eagle.main(_train_args(tiny, tmp_path / "bad", 1) + ["--aux"])
