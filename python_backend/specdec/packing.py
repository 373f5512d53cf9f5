"""A wave of target steps as one call: every step's fields in flat arrays, and the results likewise.

Sent one request per sequence, a wave of 64 steps is 64 submissions to Triton, and its sequence batcher cuts
them into batches as they trickle in (the target saw 15 sequences per execution at 64 streams). Packed, the
wave is one request, so the target serves the whole wave in one execution and needs no queue delay to merge
it. Only steps of sequences that already hold a KV slot and keep it pack (no START, no END): the packed
request travels under one of their sequence ids, so the sequence batcher routes it to the instance holding
that slot, which is why packing needs the target to have a single instance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.engines import StepRequest, StepResult
from specdec.errors import InvalidRequestError, SpecDecError
from specdec.sampling import SamplingParams

# The columns of a packed wave's step table, one row per step.
STEP_COLUMNS = ("sequence_id", "past_length", "num_tokens", "num_logits", "num_hidden", "want_logits",
                "num_tree_parents", "commit_base", "num_commit_rows", "top_k", "seed", "num_steps")
# ... and of its sampling table (float32, as the unpacked path's inputs: a draw does not depend on the packing).
SAMPLING_COLUMNS = ("temperature", "top_p")
NO_SEED = -1
_COLUMN = {name: i for i, name in enumerate(STEP_COLUMNS)}


def packable(step: StepRequest) -> bool:
    """Whether a target step can ride in a packed wave (a step that starts or ends a sequence goes alone)."""
    return not step.start and not step.end and len(step.input_ids) > 0 and step.features is None


@dataclass
class PackedSteps:
    """Target steps of several sequences: `table` [steps, STEP_COLUMNS] and the ragged fields concatenated."""

    table: np.ndarray
    input_ids: np.ndarray
    tree_parents: np.ndarray
    commit_rows: np.ndarray
    sampling: np.ndarray  # [steps, SAMPLING_COLUMNS] float32

    @property
    def sequence_ids(self) -> np.ndarray:
        return self.table[:, _COLUMN["sequence_id"]]


def pack_steps(steps: list[StepRequest]) -> PackedSteps:
    rows, sampling, ids, parents, commits = [], [], [], [], []
    for step in steps:
        if not packable(step):
            raise ValueError(f"sequence {step.sequence_id}: a step that starts or ends a sequence does not pack")
        tree = np.zeros(0, np.int64) if step.tree_parents is None else np.asarray(step.tree_parents, np.int64)
        commit = np.zeros(0, np.int64) if step.commit_rows is None else np.asarray(step.commit_rows, np.int64)
        rows.append((step.sequence_id, step.past_length, len(step.input_ids), step.num_logits, step.num_hidden,
                     int(step.want_logits), len(tree), step.commit_base, len(commit), step.sampling.top_k,
                     NO_SEED if step.sampling.seed is None else step.sampling.seed, step.num_steps))
        sampling.append((step.sampling.temperature, step.sampling.top_p))
        ids.append(np.asarray(step.input_ids, np.int64))
        parents.append(tree)
        commits.append(commit)
    return PackedSteps(np.asarray(rows, np.int64).reshape(-1, len(STEP_COLUMNS)), np.concatenate(ids),
                       np.concatenate(parents), np.concatenate(commits),
                       np.asarray(sampling, np.float32).reshape(-1, len(SAMPLING_COLUMNS)))


def _split(values: np.ndarray, counts: np.ndarray, field: str) -> list[np.ndarray]:
    if (counts < 0).any() or int(counts.sum()) != len(values):
        raise InvalidRequestError(field, f"{len(values)} values do not split into the steps' {counts.tolist()}")
    return np.split(values, np.cumsum(counts)[:-1])


def unpack_steps(packed: PackedSteps) -> list[StepRequest]:
    """The steps of a packed wave; raises InvalidRequestError naming the field when the arrays disagree."""
    table = np.asarray(packed.table, np.int64)
    if table.ndim != 2 or table.shape[1] != len(STEP_COLUMNS) or not len(table):
        raise InvalidRequestError("steps", f"must be [steps, {len(STEP_COLUMNS)}] ({', '.join(STEP_COLUMNS)})")
    sampling = np.asarray(packed.sampling, np.float32)
    if sampling.shape != (len(table), len(SAMPLING_COLUMNS)):
        raise InvalidRequestError("step_sampling", f"must be [{len(table)}, {len(SAMPLING_COLUMNS)}] "
                                  f"({', '.join(SAMPLING_COLUMNS)}), got {list(sampling.shape)}")
    column = {name: table[:, i] for name, i in _COLUMN.items()}
    ids = _split(np.asarray(packed.input_ids, np.int64).reshape(-1), column["num_tokens"], "input_ids")
    parents = _split(np.asarray(packed.tree_parents, np.int64).reshape(-1), column["num_tree_parents"],
                     "tree_parents")
    commits = _split(np.asarray(packed.commit_rows, np.int64).reshape(-1), column["num_commit_rows"], "commit_rows")
    steps = []
    for i in range(len(table)):
        steps.append(StepRequest(
            int(column["sequence_id"][i]), past_length=int(column["past_length"][i]), input_ids=ids[i],
            num_logits=int(column["num_logits"][i]), num_hidden=int(column["num_hidden"][i]),
            want_logits=bool(column["want_logits"][i]),
            tree_parents=parents[i] if len(parents[i]) else None,
            commit_base=int(column["commit_base"][i]), commit_rows=commits[i] if len(commits[i]) else None,
            sampling=SamplingParams(float(sampling[i, 0]), int(column["top_k"][i]), float(sampling[i, 1]),
                                    None if column["seed"][i] == NO_SEED else int(column["seed"][i])),
            num_steps=int(column["num_steps"][i]),
        ))
    return steps


@dataclass
class PackedResults:
    """The results of a packed wave, concatenated in step order: a step that failed adds no rows and its
    message to `errors` ("" for the others)."""

    token_ids: np.ndarray
    logits: np.ndarray | None  # rows of the steps that asked for logits
    hidden: np.ndarray | None  # rows of the steps that asked for features
    errors: list[str]


def pack_results(steps: list[StepRequest], results: list[StepResult]) -> PackedResults:
    ok = [(step, result) for step, result in zip(steps, results, strict=True) if result.error is None]
    logits = [result.logits for step, result in ok if step.want_logits]
    hidden = [result.hidden for step, result in ok if step.num_hidden]
    token_ids = [result.token_ids for _, result in ok]
    return PackedResults(
        np.concatenate(token_ids) if token_ids else np.zeros(0, np.int64),
        np.concatenate(logits) if logits else None,
        np.concatenate(hidden) if hidden else None,
        ["" if result.error is None else str(result.error) for result in results],
    )


def unpack_results(steps: list[StepRequest], packed: PackedResults) -> list[StepResult]:
    if len(packed.errors) != len(steps):
        raise SpecDecError(f"a packed wave of {len(steps)} steps came back with {len(packed.errors)} results")
    results = []
    token_at = logits_at = hidden_at = 0
    for step, error in zip(steps, packed.errors, strict=True):
        if error:
            results.append(StepResult(error=SpecDecError(error)))
            continue
        picked = step.num_logits + step.num_steps - 1  # a token per scored position, then one per further step
        result = StepResult(token_ids=packed.token_ids[token_at:token_at + picked])
        token_at += picked
        if step.want_logits:
            result.logits = packed.logits[logits_at:logits_at + step.num_logits]
            logits_at += step.num_logits
        if step.num_hidden:
            rows = step.num_hidden + step.num_steps - 1
            result.hidden = packed.hidden[hidden_at:hidden_at + rows]
            hidden_at += rows
        results.append(result)
    if token_at != len(packed.token_ids):
        raise SpecDecError(f"a packed wave returned {len(packed.token_ids)} token ids for {token_at} positions")
    return results
