"""specdec.packing: a wave of target steps packs into flat arrays and back unchanged, results likewise (failed
steps included), malformed tables are refused naming the field, and a packed wave served by the engine gives
each step what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
from specdec.engines import StepRequest, StepResult, TargetEngine
from specdec.errors import InvalidRequestError, SpecDecError
from specdec.packing import PackedResults, pack_results, pack_steps, packable, unpack_results, unpack_steps
from specdec.runtime.torch_llama import TorchLlamaRuntime


def wave() -> list[StepRequest]:
    return [
        StepRequest(7, past_length=5, input_ids=np.array([3, 4])),
        StepRequest(2**62 + 9, past_length=12, input_ids=np.array([8, 1, 6, 6]), num_logits=3, want_logits=True,
                    tree_parents=np.array([-1, 0, 1, 1]), num_hidden=4),
        StepRequest(11, past_length=3, input_ids=np.array([5]), commit_base=1, commit_rows=np.array([0, 2])),
    ]


def test_steps_round_trip():
    steps = wave()
    back = unpack_steps(pack_steps(steps))
    for before, after in zip(steps, back, strict=True):
        for name in ("sequence_id", "past_length", "num_logits", "num_hidden", "want_logits", "commit_base"):
            assert getattr(before, name) == getattr(after, name), name
        np.testing.assert_array_equal(before.input_ids, after.input_ids)
        for name in ("tree_parents", "commit_rows"):
            mine, theirs = getattr(before, name), getattr(after, name)
            assert (mine is None) == (theirs is None)
            if mine is not None:
                np.testing.assert_array_equal(mine, theirs)


def test_steps_that_start_or_end_a_sequence_do_not_pack():
    assert not packable(StepRequest(1, input_ids=np.array([1]), start=True))
    assert not packable(StepRequest(1, end=True))
    assert not packable(StepRequest(1))  # a bare commit
    with pytest.raises(ValueError, match="does not pack"):
        pack_steps([StepRequest(1, input_ids=np.array([1]), start=True)])


def test_malformed_tables_are_refused_naming_the_field():
    packed = pack_steps(wave())
    packed.input_ids = packed.input_ids[:-1]
    with pytest.raises(InvalidRequestError, match="input_ids"):
        unpack_steps(packed)
    packed = pack_steps(wave())
    packed.table = packed.table[:, :4]
    with pytest.raises(InvalidRequestError, match="steps"):
        unpack_steps(packed)
    packed = pack_steps(wave())
    packed.tree_parents = np.zeros(0, np.int64)
    with pytest.raises(InvalidRequestError, match="tree_parents"):
        unpack_steps(packed)


def test_results_round_trip_with_a_failed_step():
    steps = wave()
    rng = np.random.default_rng(0)
    results = [
        StepResult(token_ids=np.array([4])),
        StepResult(token_ids=np.array([1, 2, 3]), logits=rng.standard_normal((3, 10)),
                   hidden=rng.standard_normal((4, 6))),
        StepResult(error=SpecDecError("sequence 11 has no KV slot")),
    ]
    back = unpack_results(steps, pack_results(steps, results))
    np.testing.assert_array_equal(back[0].token_ids, [4])
    assert back[0].logits is None and back[0].hidden is None
    np.testing.assert_array_equal(back[1].logits, results[1].logits)
    np.testing.assert_array_equal(back[1].hidden, results[1].hidden)
    assert str(back[2].error) == "sequence 11 has no KV slot"
    with pytest.raises(SpecDecError, match="token ids"):
        unpack_results(steps, PackedResults(np.zeros(9, np.int64), results[1].logits, results[1].hidden,
                                            ["", "", "x"]))


def test_a_packed_wave_gives_each_step_what_it_gets_alone(tiny_pair):
    """Three sequences prefilled, then one wave of their next steps (a decode step, a verification of 3
    rows with logits and features, a step after a commit) through pack -> unpack -> engine -> pack -> unpack:
    token ids, logits and features equal those of each step served alone."""
    target_dir, _ = tiny_pair
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8, 1, 4, 4, 6, 2, 9, 9, 5, 1], [2, 4]]

    def engine_with_prompts() -> TargetEngine:
        engine = TargetEngine(TorchLlamaRuntime(target_dir, num_slots=4, max_length=64), 60)
        engine.step([StepRequest(10 + i, input_ids=np.array(p), start=True) for i, p in enumerate(prompts)])
        return engine

    steps = [
        StepRequest(10, past_length=5, input_ids=np.array([3])),
        StepRequest(11, past_length=12, input_ids=np.array([8, 1, 6]), num_logits=3, want_logits=True, num_hidden=3),
        StepRequest(12, past_length=1, input_ids=np.array([5]), commit_base=0, commit_rows=np.array([0, 1])),
    ]
    alone = [engine_with_prompts().step([step])[0] for step in steps]
    unpacked = unpack_steps(pack_steps(steps))
    together = unpack_results(unpacked, pack_results(unpacked, engine_with_prompts().step(unpacked)))
    for one, packed in zip(alone, together, strict=True):
        assert one.error is None and packed.error is None
        np.testing.assert_array_equal(one.token_ids, packed.token_ids)
        for name in ("logits", "hidden"):
            mine, theirs = getattr(one, name), getattr(packed, name)
            assert (mine is None) == (theirs is None)
            if mine is not None:
                np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-4)  # torch pads the batch


def test_a_call_of_several_steps_picks_what_one_step_calls_pick(tiny_pair):
    """A target step with num_steps 4 (greedy, and drawn with a seed), packed beside a verification, returns the
    tokens and features of four calls of one step each (the draws' seeds: specdec.sampling.step_seed)."""
    from specdec.sampling import SamplingParams, step_seed

    target_dir, _ = tiny_pair
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8, 1, 4, 4, 6, 2, 9, 9, 5, 1], [2, 4, 6]]

    def engine_with_prompts() -> TargetEngine:
        engine = TargetEngine(TorchLlamaRuntime(target_dir, num_slots=4, max_length=64), 60)
        engine.step([StepRequest(10 + i, input_ids=np.array(p), start=True) for i, p in enumerate(prompts)])
        return engine

    drawn = SamplingParams(temperature=1.0, top_k=20, seed=77)
    steps = [
        StepRequest(10, past_length=5, input_ids=np.array([3]), num_steps=4, num_hidden=1),
        StepRequest(11, past_length=12, input_ids=np.array([8, 1, 6]), num_logits=3, want_logits=True),
        StepRequest(12, past_length=3, input_ids=np.array([5]), num_steps=4, sampling=drawn),
    ]
    unpacked = unpack_steps(pack_steps(steps))
    assert [step.num_steps for step in unpacked] == [4, 1, 4]
    engine = engine_with_prompts()
    together = unpack_results(unpacked, pack_results(unpacked, engine.step(unpacked)))
    assert [len(result.token_ids) for result in together] == [4, 3, 4]
    assert together[0].hidden.shape[0] == 4
    one_at_a_time = engine_with_prompts()
    for i in (0, 2):
        past, token, hidden = steps[i].past_length, steps[i].input_ids, []
        for step in range(4):
            sampling = SamplingParams(drawn.temperature, drawn.top_k, seed=step_seed(drawn.seed, step)) \
                if i == 2 else SamplingParams()
            result = one_at_a_time.step([StepRequest(steps[i].sequence_id, past_length=past, input_ids=token,
                                                     sampling=sampling, num_hidden=steps[i].num_hidden)])[0]
            assert result.token_ids[-1] == together[i].token_ids[step], (i, step)
            if result.hidden is not None:
                hidden.append(result.hidden)
            past, token = past + 1, result.token_ids[-1:]
        if hidden:
            np.testing.assert_allclose(np.concatenate(hidden), together[i].hidden, rtol=0, atol=1e-4)
    assert engine.slots.lookup(10).written_length == 5 + 4  # the input and three further steps' tokens


def test_several_steps_are_refused_where_rows_come_back(tiny_pair):
    """num_steps > 1 picks one token a step: a step that scores several rows or wants logits rows is refused,
    naming the field, and so is num_steps < 1; the sequence's other steps still work."""
    target_dir, _ = tiny_pair
    engine = TargetEngine(TorchLlamaRuntime(target_dir, num_slots=2, max_length=64), 60)
    engine.step([StepRequest(1, input_ids=np.array([4, 5, 6]), start=True)])
    for step in (StepRequest(1, past_length=3, input_ids=np.array([1, 2]), num_logits=2, num_steps=2),
                 StepRequest(1, past_length=3, input_ids=np.array([1]), want_logits=True, num_steps=2),
                 StepRequest(1, past_length=3, input_ids=np.array([1]), num_steps=0)):
        error = engine.step([step])[0].error
        assert isinstance(error, InvalidRequestError) and error.field == "num_steps"
    assert engine.step([StepRequest(1, past_length=3, input_ids=np.array([1]), num_steps=2)])[0].error is None
