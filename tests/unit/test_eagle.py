"""The EAGLE drafter without a server: features out of the target, into the head, the bookkeeping of the
head's rows, losslessness, degradation, and the exported graphs' parity with torch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from specdec.config import SpeculationConfig, SpeculationSettings, resolve
from specdec.drafting.eagle import EagleDrafter
from specdec.drafting.ngram import PromptLookup
from specdec.engines import DraftEngine, StepRequest, StepResult, TargetEngine
from specdec.errors import InvalidRequestError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.inprocess import InProcessBackend
from specdec.runtime.base import ForwardItem
from specdec.runtime.torch_llama import TorchLlamaRuntime

MAX_LENGTH = 128
PROMPT = [5, 9, 17, 33, 4, 61, 12, 8, 40, 22, 71, 3, 19]


def backend(pair: tuple[Path, Path], eagle: Path) -> InProcessBackend:
    target, draft = pair

    def runtime(folder: Path) -> TorchLlamaRuntime:
        return TorchLlamaRuntime(folder, num_slots=4, max_length=MAX_LENGTH)

    return InProcessBackend(TargetEngine(runtime(target), 60), DraftEngine(runtime(draft), 60),
                            DraftEngine(runtime(eagle), 60))


def generate(backend_, drafter: str, k: int, candidates: int = 1, prefill_chunk: int = 256,
             max_tokens: int = 40, prompt: list[int] = PROMPT,
             lookup: PromptLookup | None = None) -> tuple[list[int], GenerationStats]:
    settings = SpeculationSettings("text", drafter, k, k, candidates, "greedy", 0.7, explicit_length=True,
                                   prompt_lookup=lookup or PromptLookup(adaptive=False))
    generator = SpeculativeGenerator(backend_, MAX_LENGTH, prefill_chunk=prefill_chunk)
    stats = GenerationStats()

    async def run() -> list[int]:
        tokens: list[int] = []
        async for update in generator.generate(GenerationRequest(prompt, max_tokens, settings=settings), 7, stats):
            tokens += update.token_ids
        return tokens

    return asyncio.run(run()), stats


def test_target_returns_the_features_its_output_layer_reads(tiny_pair):
    runtime = TorchLlamaRuntime(tiny_pair[0], num_slots=2, max_length=MAX_LENGTH)
    out = runtime.forward_outputs([ForwardItem(0, 0, np.asarray(PROMPT), num_logits=3, num_hidden=len(PROMPT)),
                                   ForwardItem(1, 0, np.asarray(PROMPT[:4]))])
    assert out[0].hidden.shape == (len(PROMPT), runtime.spec.hidden_size) and out[1].hidden is None
    embed = runtime.weights.embed.numpy()  # tied: the output layer is the embedding matrix
    np.testing.assert_allclose(out[0].hidden[-3:] @ embed.T, out[0].logits, atol=1e-4)
    engine = TargetEngine(TorchLlamaRuntime(tiny_pair[0], num_slots=2, max_length=MAX_LENGTH), 60)
    result = engine.step([StepRequest(1, input_ids=np.asarray(PROMPT), start=True, num_hidden=5)])[0]
    np.testing.assert_allclose(result.hidden, out[0].hidden[-5:], atol=1e-5)
    bad = engine.step([StepRequest(2, input_ids=np.asarray(PROMPT), start=True, num_hidden=len(PROMPT) + 1)])[0]
    assert isinstance(bad.error, InvalidRequestError) and "num_hidden" in str(bad.error)


def test_the_head_refuses_tokens_without_their_features(tiny_eagle):
    engine = DraftEngine(TorchLlamaRuntime(tiny_eagle, num_slots=4, max_length=MAX_LENGTH), 60)
    assert engine.runtime.feature_size == engine.runtime.spec.hidden_size
    ids = np.asarray(PROMPT[:4])
    missing = engine.step([StepRequest(1, input_ids=ids, start=True, num_draft_tokens=2)])[0]
    wrong = engine.step([StepRequest(2, input_ids=ids, start=True, num_draft_tokens=2,
                                     features=np.zeros((3, engine.runtime.feature_size), np.float32))])[0]
    for result in (missing, wrong):
        assert isinstance(result.error, InvalidRequestError) and "features" in str(result.error)
    good = engine.step([StepRequest(3, input_ids=ids, start=True, num_draft_tokens=3,
                                    features=np.ones((4, engine.runtime.feature_size), np.float32))])[0]
    assert good.error is None and len(good.token_ids) == 3


@pytest.mark.parametrize(("k", "candidates", "prefill_chunk"),
                         [(1, 1, 256), (3, 1, 256), (5, 1, 4), (3, 2, 256), (2, 3, 5)])
def test_greedy_with_the_head_equals_plain_decoding(tiny_pair, tiny_eagle, k, candidates, prefill_chunk):
    plain, _ = generate(backend(tiny_pair, tiny_eagle), "model", 0)
    got, stats = generate(backend(tiny_pair, tiny_eagle), "eagle", k, candidates, prefill_chunk)
    assert got == plain
    assert stats.drafter == "eagle" and stats.draft_failures == 0
    assert stats.draft_calls == stats.verification_passes > 0


def test_a_confidence_floor_is_refused_on_a_chain(tiny_eagle):
    """min_confidence floors a dynamic tree's nodes; a chain has no floor (stopping where the drafter was unsure
    did not pay, and was removed): a chain request that sets one is refused, naming the field."""
    engine = DraftEngine(TorchLlamaRuntime(tiny_eagle, num_slots=1, max_length=MAX_LENGTH), 60)
    features = np.zeros((len(PROMPT), engine.runtime.feature_size), np.float32)
    result = engine.step([StepRequest(1, input_ids=np.asarray(PROMPT), start=True, num_draft_tokens=4,
                                      features=features, min_confidence=0.5)])[0]
    assert isinstance(result.error, InvalidRequestError) and "min_confidence" in str(result.error)


def record_head_proposals(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(context tokens, proposed tokens) of every EAGLE proposal made from now on."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = EagleDrafter.propose

    async def recording(self, tokens, k, candidates, sampling, want_probs, **options):
        proposal = await propose(self, tokens, k, candidates, sampling, want_probs, **options)
        seen.append((list(tokens), proposal.tokens))
        return proposal

    monkeypatch.setattr(EagleDrafter, "propose", recording)
    return seen


def test_each_proposal_is_what_a_fresh_head_computes_from_the_target_features(tiny_pair, tiny_eagle, monkeypatch):
    """The head's rows after many rollbacks hold exactly the target's features of the committed tokens: each
    proposal equals the chain a fresh head drafts from a full recomputation."""
    seen = record_head_proposals(monkeypatch)
    generate(backend(tiny_pair, tiny_eagle), "eagle", 3, prefill_chunk=5)
    assert len(seen) > 5 and sum(len(proposal) == 3 for _, proposal in seen) >= len(seen) - 2
    target = TorchLlamaRuntime(tiny_pair[0], num_slots=1, max_length=MAX_LENGTH)
    for tokens, proposal in seen[::3]:
        n = len(tokens)
        features = target.forward_outputs([ForwardItem(0, 0, np.asarray(tokens[:-1]), num_hidden=n - 1)])[0].hidden
        head = TorchLlamaRuntime(tiny_eagle, num_slots=1, max_length=MAX_LENGTH)
        out = head.forward_outputs([ForwardItem(0, 0, np.asarray(tokens[1:]), num_hidden=1, features=features)])[0]
        chain = [int(out.logits[-1].argmax())]
        for row in range(n - 1, n + 1):
            out = head.forward_outputs([ForwardItem(0, row, np.asarray(chain[-1:]), num_hidden=1,
                                                    features=out.hidden[-1:])])[0]
            chain.append(int(out.logits[-1].argmax()))
        assert proposal == chain[:len(proposal)]  # shorter only at the end (max_tokens)


# Repeats its own suffix, so prompt lookup proposes from the start and the head catches up afterwards.
REPEATING = PROMPT + PROMPT[:6]


@pytest.mark.parametrize(("k", "candidates", "prefill_chunk"), [(2, 1, 256), (3, 2, 5)])
def test_lookup_in_front_of_the_head_equals_plain_and_keeps_its_features(tiny_pair, tiny_eagle, k, candidates,
                                                                         prefill_chunk, monkeypatch):
    """Iterations that prompt lookup proposes still hand the head the target's features of what they
    committed: every later proposal of the head is what a fresh head computes from a full recomputation."""
    seen = record_head_proposals(monkeypatch)
    plain, _ = generate(backend(tiny_pair, tiny_eagle), "model", 0, prompt=REPEATING)
    got, stats = generate(backend(tiny_pair, tiny_eagle), "eagle+ngram", k, candidates, prefill_chunk,
                          prompt=REPEATING, lookup=PromptLookup(length=4, min_ngram=1))
    assert got == plain and stats.draft_failures == 0
    assert stats.lookup_draft_tokens > 0 and stats.draft_calls == len(seen) > 0
    if candidates > 1:
        return
    target = TorchLlamaRuntime(tiny_pair[0], num_slots=1, max_length=MAX_LENGTH)
    for tokens, proposal in seen:
        n = len(tokens)
        features = target.forward_outputs([ForwardItem(0, 0, np.asarray(tokens[:-1]), num_hidden=n - 1)])[0].hidden
        head = TorchLlamaRuntime(tiny_eagle, num_slots=1, max_length=MAX_LENGTH)
        out = head.forward_outputs([ForwardItem(0, 0, np.asarray(tokens[1:]), num_hidden=1, features=features)])[0]
        assert proposal[0] == int(out.logits[-1].argmax())


class FailingEagle(InProcessBackend):
    async def drafter_step(self, drafter, request: StepRequest) -> StepResult:
        if drafter != "eagle":
            return await super().drafter_step(drafter, request)
        if request.end:
            return StepResult()
        return StepResult(error=InvalidRequestError("features", "the head is broken"))


def test_a_failing_head_degrades_to_plain_decoding(tiny_pair, tiny_eagle):
    plain, _ = generate(backend(tiny_pair, tiny_eagle), "model", 0)
    good = backend(tiny_pair, tiny_eagle)
    got, stats = generate(FailingEagle(good.target, good.draft, good.eagle), "eagle", 3)
    assert got == plain
    assert stats.draft_failures == 1 and stats.verification_passes == 0


def test_a_deployment_without_the_head_drafts_with_the_model_and_refuses_eagle_requests():
    config = SpeculationConfig.from_dict({"drafter": {"json": "eagle", "code": "model", "text": "ngram"}})
    assert config.profiles["json"].drafter == "eagle"
    served = config.serving(("model", "ngram"))
    assert [served.profiles[t].drafter for t in ("json", "code", "text")] == ["model", "model", "ngram"]
    common = dict(num_draft_tokens=None, num_candidates=None, acceptance=None, verify_threshold=None, sampling=False)
    assert resolve(config, "code", None, drafter="eagle", **common).drafter == "eagle"
    with pytest.raises(InvalidRequestError, match="drafter"):
        resolve(served, "code", None, drafter="eagle", **common)


def test_exported_graphs_match_torch_with_features(tiny_pair, tiny_eagle, tmp_path):
    from specdec.runtime.onnx_llama import OnnxLlamaRuntime
    from specdec.runtime.step_graph import export_decoder

    def pair_of(folder: Path) -> tuple[TorchLlamaRuntime, OnnxLlamaRuntime]:
        onnx_path = export_decoder(folder, tmp_path / f"{folder.name}.onnx")
        return (TorchLlamaRuntime(folder, num_slots=2, max_length=MAX_LENGTH),
                OnnxLlamaRuntime(folder, num_slots=2, max_length=MAX_LENGTH, onnx_path=onnx_path))

    def assert_same(runtimes, items) -> list:
        expected, got = (runtime.forward_outputs(items) for runtime in runtimes)
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_allclose(g.logits, e.logits, atol=1e-4)
            assert (e.hidden is None) == (g.hidden is None)
            if e.hidden is not None:
                np.testing.assert_allclose(g.hidden, e.hidden, atol=1e-4)
        return expected

    target = assert_same(pair_of(tiny_pair[0]), [
        ForwardItem(0, 0, np.asarray(PROMPT), num_logits=2, num_hidden=len(PROMPT)),
        ForwardItem(1, 0, np.asarray(PROMPT[:5]), num_hidden=2)])
    features = target[0].hidden
    head = pair_of(tiny_eagle)
    n = len(PROMPT) - 1
    assert_same(head, [ForwardItem(0, 0, np.asarray(PROMPT[1:]), num_hidden=1, features=features[:n]),
                       ForwardItem(1, 0, np.asarray(PROMPT[1:4]), num_logits=3, num_hidden=3, features=features[:3])])
    # Tree nodes hanging after the prefix, each with its parent's feature.
    assert_same(head, [ForwardItem(0, n, np.asarray([7, 8, 9]), num_logits=3, num_hidden=3,
                                   tree_parents=np.asarray([-1, -1, 0]), features=features[:3])])


def test_a_fusing_target_returns_its_layers_outputs_beside_the_final_feature(fused_eagle):
    """EAGLE-3 fusion: [final-normed state, RMS-normalized outputs of the listed layers in their order]."""
    import torch
    from transformers import LlamaForCausalLM

    target, _ = fused_eagle
    runtime = TorchLlamaRuntime(target, num_slots=1, max_length=MAX_LENGTH)
    assert runtime.spec.feature_layers == (1, 0) and runtime.spec.feature_width == 3 * runtime.spec.hidden_size
    out = runtime.forward_outputs([ForwardItem(0, 0, np.asarray(PROMPT), num_hidden=len(PROMPT))])[0]
    with torch.no_grad():
        hf = LlamaForCausalLM.from_pretrained(str(target)).eval()
        states = hf.model(input_ids=torch.as_tensor([PROMPT]), output_hidden_states=True).hidden_states
    unit = lambda x: x / x.pow(2).mean(-1, keepdim=True).add(runtime.spec.rms_norm_eps).sqrt()  # noqa: E731
    want = torch.cat([states[-1][0], unit(states[2][0]), unit(states[1][0])], dim=-1).numpy()
    np.testing.assert_allclose(out.hidden, want, atol=1e-4)


def test_greedy_with_a_fused_head_equals_plain_decoding(tiny_pair, fused_eagle):
    """The head reads the target's fused features and, on drafted rows, its own output zero-padded."""
    pair = (fused_eagle[0], tiny_pair[1])
    plain, _ = generate(backend(pair, fused_eagle[1]), "model", 0)
    for k, candidates in ((3, 1), (2, 3)):
        got, stats = generate(backend(pair, fused_eagle[1]), "eagle", k, candidates, prefill_chunk=5)
        assert got == plain and stats.draft_failures == 0 and stats.draft_calls > 0


def test_a_head_fed_the_wrong_feature_width_refuses_with_a_clear_error(tiny_pair, fused_eagle):
    """A fused head behind a target that does not emit its layers: every request degrades to plain decoding."""
    plain, _ = generate(backend(tiny_pair, fused_eagle[1]), "model", 0)
    got, stats = generate(backend(tiny_pair, fused_eagle[1]), "eagle", 3)
    assert got == plain and stats.draft_failures > 0


def test_feature_layers_must_be_distinct_inner_layers(tiny_pair):
    import json

    from specdec.checkpoint import ModelSpec, UnsupportedCheckpoint

    config = json.loads((tiny_pair[0] / "config.json").read_text())
    for layers in ([2], [0, 0], [-1]):
        with pytest.raises(UnsupportedCheckpoint, match="specdec_feature_layers"):
            ModelSpec.from_config({**config, "specdec_feature_layers": layers})


def test_exported_graphs_match_torch_with_fused_features(fused_eagle, tmp_path):
    from specdec.runtime.onnx_llama import OnnxLlamaRuntime
    from specdec.runtime.step_graph import export_decoder

    outputs = []
    for folder, items in ((fused_eagle[0], [ForwardItem(0, 0, np.asarray(PROMPT), num_logits=2,
                                                       num_hidden=len(PROMPT))]), (fused_eagle[1], None)):
        if items is None:
            features = outputs[0].hidden
            items = [ForwardItem(0, 0, np.asarray(PROMPT[1:]), num_logits=3, num_hidden=3,
                                 features=features[:len(PROMPT) - 1])]
        onnx_path = export_decoder(folder, tmp_path / f"{folder.name}.onnx")
        expected = TorchLlamaRuntime(folder, num_slots=1, max_length=MAX_LENGTH).forward_outputs(items)[0]
        onnx_runtime = OnnxLlamaRuntime(folder, num_slots=1, max_length=MAX_LENGTH, onnx_path=onnx_path)
        got = onnx_runtime.forward_outputs(items)[0]
        np.testing.assert_allclose(got.logits, expected.logits, atol=1e-4)
        np.testing.assert_allclose(got.hidden, expected.hidden, atol=1e-4)
        outputs.append(expected)
    assert outputs[0].hidden.shape[1] == 3 * outputs[1].hidden.shape[1]
