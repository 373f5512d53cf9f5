"""Transport-free engines behind `target_model` and `draft_model`.

Each engine owns a runtime (the KV cache) and a SlotTable, and serves a batch of step requests of
different sequences with as few padded forwards as possible: one for the target; one catch-up forward plus
one per further draft token for the draft. Rollback is by length (`past_length`); keeping an accepted tree
path (`commit_rows`) rides on the next step, so neither needs an extra round trip. Before its forward a
sequence's KV blocks are resized to the rows the step needs (specdec.kv_memory): rows past `past_length`
are dead, so rejected draft rows give their blocks back; a step the pool cannot hold fails alone with
CapacityError. Items of very different lengths (a prompt chunk beside decode steps) run in separate
forwards, so a decode step is not padded to the chunk's width.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from specdec.errors import InvalidRequestError, SpecDecError
from specdec.kv_cache import SlotEntry, SlotTable
from specdec.runtime.base import DecoderRuntime, ForwardItem, ForwardOutput, expand_to_vocab
from specdec.sampling import SamplingParams, make_rng, probabilities, sample, sample_rows, step_seed

EMPTY_IDS = np.zeros(0, dtype=np.int64)
PADDING_RATIO = 4  # an item joins a forward whose width is at most this many times its own (or PADDING_FLOOR)
PADDING_FLOOR = 16


def group_by_width(items: list[ForwardItem]) -> list[list[int]]:
    """Indices of `items` in forwards of similar widths: longest first, an item joins the current group
    while the group's width is at most max(PADDING_RATIO x its tokens, PADDING_FLOOR)."""
    order = sorted(range(len(items)), key=lambda i: -items[i].num_tokens)
    groups: list[list[int]] = []
    for i in order:
        n = items[i].num_tokens
        if groups and items[groups[-1][0]].num_tokens <= max(PADDING_RATIO * n, PADDING_FLOOR):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class StepRequest:
    """One sequence's call to a model: append `input_ids` after `past_length` valid cached tokens.

    `commit_rows` (relative to `commit_base`) first moves the rows of an accepted tree path so they are
    contiguous from `commit_base`. `end` frees the slot after the step; a step with no input only commits
    and/or ends.
    """

    sequence_id: int
    past_length: int = 0
    input_ids: np.ndarray = field(default_factory=lambda: EMPTY_IDS)
    start: bool = False
    end: bool = False
    num_logits: int = 1
    tree_parents: np.ndarray | None = None
    commit_base: int = 0
    commit_rows: np.ndarray | None = None
    num_draft_tokens: int = 0
    num_candidates: int = 1
    # Draft: how it drafts. Target: greedy, or the token after the last input (token_ids[-1]) is drawn from it.
    sampling: SamplingParams = field(default_factory=SamplingParams)
    want_logits: bool = False
    num_hidden: int = 0  # target: also return the features (final-normed hidden states) of the last N inputs
    features: np.ndarray | None = None  # EAGLE draft: [len(input_ids), feature_size], each input token's feature
    min_confidence: float = 0.0  # a dynamic tree (tree_nodes): no node whose path probability is below this
    # Draft: > 0 grows a dynamic tree (EAGLE-2) of at most this many nodes instead of `num_candidates` chains:
    # `num_candidates` nodes expanded per level, `num_draft_tokens` levels deep (greedy drafting only).
    tree_nodes: int = 0
    # Target, plain decoding: pick this many tokens in one call, each further one after a one-token step on the
    # token picked before it (greedy, or drawn with `step_seed(seed, step)`); token_ids then ends with them all.
    # The calls of plain decoding under load then cost one round trip per `num_steps` tokens.
    num_steps: int = 1


@dataclass
class StepResult:
    """Target: greedy token after each scored position, the last one drawn when the step samples (and
    `hidden`: the features asked for). Draft: the proposed tokens."""

    token_ids: np.ndarray = field(default_factory=lambda: EMPTY_IDS)
    logits: np.ndarray | None = None
    error: SpecDecError | None = None
    hidden: np.ndarray | None = None
    parents: np.ndarray | None = None  # draft, dynamic tree: each proposed node's parent (-1: the root)


class _Engine:
    def __init__(self, runtime: DecoderRuntime, idle_timeout_s: float) -> None:
        self.runtime = runtime
        self.slots = SlotTable(runtime.num_slots, idle_timeout_s, on_release=runtime.release)

    def _prepare(self, request: StepRequest, extra_rows: int = 0) -> SlotEntry:
        """Resolve the slot, check lengths, apply the commit. Raises SpecDecError for this request only."""
        entry = self.slots.acquire(request.sequence_id) if request.start else self.slots.lookup(request.sequence_id)
        if request.commit_rows is not None and len(request.commit_rows):
            rows = np.asarray(request.commit_rows, dtype=np.int64)
            if request.commit_base < 0 or request.commit_base + rows.max(initial=0) >= max(entry.written_length, 1):
                raise InvalidRequestError("commit_rows", "rows past the written cache")
            self.runtime.move_rows(entry.slot, request.commit_base + rows, request.commit_base)
            entry.written_length = request.commit_base + len(rows)
        if not 0 <= request.past_length <= entry.written_length:
            raise InvalidRequestError(
                "past_length", f"{request.past_length} is outside the {entry.written_length} cached tokens"
            )
        needed = request.past_length + len(request.input_ids) + extra_rows
        if needed > self.runtime.max_length:
            raise InvalidRequestError(
                "input_ids", f"sequence would need {needed} cache rows; the limit is {self.runtime.max_length}"
            )
        if len(request.input_ids):
            entry.written_length = request.past_length  # rows past it are dead (rollback by length)
            self.runtime.resize_rows(entry.slot, needed)  # CapacityError when the pool is full
        return entry

    def _forward(self, items: list[ForwardItem]) -> list[ForwardOutput]:
        """One forward per group of similar widths (group_by_width); outputs in the order of `items`."""
        outputs: list[ForwardOutput] = [ForwardOutput(np.zeros(0))] * len(items)
        for group in group_by_width(items):
            for i, output in zip(group, self.runtime.forward_outputs([items[i] for i in group]), strict=True):
                outputs[i] = output
        return outputs

    def step(self, requests: list[StepRequest]) -> list[StepResult]:
        """Serve one batch of steps; sequences that asked to END are released even if the forward failed."""
        try:
            return self._step(requests)
        finally:
            self._finish(requests)

    def _step(self, requests: list[StepRequest]) -> list[StepResult]:
        raise NotImplementedError

    def _finish(self, requests: list[StepRequest]) -> None:
        for request in requests:
            if request.end:
                self.slots.release(request.sequence_id)

    @property
    def slots_in_use(self) -> int:
        return self.slots.in_use

    @property
    def kv_blocks_in_use(self) -> int:
        return self.runtime.kv.blocks_in_use

    @property
    def kv_bytes_in_use(self) -> int:
        return self.runtime.kv_bytes_in_use


class TargetEngine(_Engine):
    """Scores proposals: logits (and greedy tokens) for the last `num_logits` positions of each input."""

    def _step(self, requests: list[StepRequest]) -> list[StepResult]:
        self.slots.evict_idle()
        results = [StepResult() for _ in requests]
        batch: list[tuple[int, SlotEntry, ForwardItem]] = []
        for i, request in enumerate(requests):
            try:
                one_row = request.num_logits == 1 and not request.want_logits and request.tree_parents is None
                if request.num_steps < 1 or (request.num_steps > 1 and not (one_row and len(request.input_ids))):
                    raise InvalidRequestError("num_steps", f"{request.num_steps}: must be 1, or more for a step that "
                                              "scores one position and returns no logits rows (no tree)")
                entry = self._prepare(request, extra_rows=request.num_steps - 1)
                if len(request.input_ids):
                    if not 1 <= request.num_logits <= len(request.input_ids):
                        raise InvalidRequestError("num_logits", f"must be in 1..{len(request.input_ids)}")
                    if not 0 <= request.num_hidden <= len(request.input_ids):
                        raise InvalidRequestError("num_hidden", f"must be in 0..{len(request.input_ids)}")
                    item = ForwardItem(entry.slot, request.past_length, np.asarray(request.input_ids),
                                       request.num_logits, request.tree_parents, num_hidden=request.num_hidden)
                    batch.append((i, entry, item))
            except SpecDecError as exc:
                results[i].error = exc
        if batch:
            outputs = self._forward([item for _, _, item in batch])
            drawn: list[tuple[int, np.ndarray]] = []  # (request, its last row's logits) to draw from
            for (i, entry, item), output in zip(batch, outputs, strict=True):
                entry.written_length = item.past_length + item.num_tokens
                logits = expand_to_vocab(output.logits, self.runtime.logit_ids, self.runtime.vocab_size)
                results[i].token_ids = logits.argmax(axis=-1).astype(np.int64)
                results[i].hidden = output.hidden
                if requests[i].want_logits:
                    results[i].logits = logits
                if not requests[i].sampling.greedy:
                    drawn.append((i, logits[-1]))
            if drawn:  # every sampled row of the batch at once
                draws = sample_rows(np.stack([row for _, row in drawn]), [requests[i].sampling for i, _ in drawn])
                for (i, _), token in zip(drawn, draws, strict=True):
                    results[i].token_ids[-1] = token
            self._further_steps(requests, [(i, entry) for i, entry, _ in batch if requests[i].num_steps > 1],
                                results)
        return results

    def _further_steps(self, requests: list[StepRequest], going: list[tuple[int, SlotEntry]],
                       results: list[StepResult]) -> None:
        """The one-token steps of the requests with num_steps > 1, all of them in one forward a step."""
        step = 1
        while going := [(i, entry) for i, entry in going if requests[i].num_steps > step]:
            items = [ForwardItem(entry.slot, entry.written_length, results[i].token_ids[-1:],
                                 num_hidden=1 if requests[i].num_hidden else 0) for i, entry in going]
            outputs = self.runtime.forward_outputs(items)
            rows = np.stack([expand_to_vocab(output.logits, self.runtime.logit_ids, self.runtime.vocab_size)[-1]
                             for output in outputs])
            tokens = rows.argmax(axis=-1).astype(np.int64)
            drawing = [(n, requests[i].sampling) for n, (i, _) in enumerate(going) if not requests[i].sampling.greedy]
            if drawing:
                at = [n for n, _ in drawing]
                tokens[at] = sample_rows(rows[at], [replace(p, seed=step_seed(p.seed, step)) for _, p in drawing])
            for (i, entry), token, output in zip(going, tokens, outputs, strict=True):
                entry.written_length += 1
                results[i].token_ids = np.append(results[i].token_ids, token)
                if requests[i].num_hidden:
                    results[i].hidden = np.concatenate([results[i].hidden, output.hidden])
            step += 1


def tree_draft_parents(num_candidates: int, depth: int) -> list[int]:
    """Parents of a draft tree of `num_candidates` chains of `depth` nodes, listed depth-major:
    node i sits at depth i // c + 1; its parent is node i - c (or the root for the first c nodes)."""
    c = num_candidates
    return [i - c if i >= c else -1 for i in range(c * depth)]


@dataclass
class _Growth:
    """A draft tree (or chain) being grown for one request."""

    index: int
    entry: SlotEntry
    request: StepRequest
    base: int  # first row after the catch-up input
    rng: np.random.Generator
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    features: np.ndarray | None = None  # EAGLE: the features of the newest level's tokens (the head's own)
    # The token id of each logits column when choose() reads the runtime's proposal-vocabulary columns (a
    # greedy chain that keeps no logits); None: the logits it is given span the vocabulary.
    columns: np.ndarray | None = None

    @property
    def width(self) -> int:
        return self.request.num_candidates

    @property
    def depth(self) -> int:
        return len(self.tokens) // self.width

    def choose(self, logits: np.ndarray, count: int) -> list[int]:
        """Next tokens from logits rows: the top `count` of one row, or one per row (greedy or sampled)."""
        sampling = self.request.sampling
        if count > 1:  # the first level of a tree: distinct top tokens, or independent draws from q
            row = logits[-1]
            if sampling.greedy:
                return self._token_ids(np.argsort(-row, kind="stable")[:count])
            q = probabilities(row, sampling)[0]
            return [sample(q, self.rng) for _ in range(count)]
        if sampling.greedy:
            return self._token_ids(logits.argmax(axis=-1))
        return [sample(q, self.rng) for q in probabilities(logits, sampling)]

    def _token_ids(self, columns: np.ndarray) -> list[int]:
        return [int(t) for t in (columns if self.columns is None else self.columns[columns])]


@dataclass
class _TreeNode:
    token: int
    parent: int  # node index; -1: the root (the last committed token)
    score: float  # log probability of the path from the root under the drafter
    depth: int
    feature: np.ndarray | None  # EAGLE: the feature this node's row is fed (its parent row's output)
    row: int = -1  # its index among the tree nodes written into the slot, once expanded


@dataclass
class _DynamicTree:
    """A dynamic draft tree (EAGLE-2, Li et al. 2024): each level scores the children of the `num_candidates`
    most likely nodes of the level before (by the drafter's path probability, the product of its softmax along
    the path), `num_draft_tokens` levels deep; the proposal is the `tree_nodes` most likely nodes of all that
    were scored.
    A chain spends every verification row on one guess per position; this spends them where the drafter's
    probability mass is, so an unsure first token gets its runners-up and a sure one a long path.

    With `min_confidence` > 0 a node whose path probability is below it is neither proposed nor expanded
    (but for the most probable first token: a proposal is never empty), so the tree spends rows only on
    nodes likely enough to pay for their verification. Only the expanded nodes are forwarded (written to the
    slot as scratch tree rows, like a fixed tree's); growth stops early once no unexpanded node can still
    enter the proposal (a child never scores above its parent)."""

    index: int
    entry: SlotEntry
    request: StepRequest
    base: int  # first row after the catch-up input
    columns: np.ndarray | None = None  # the token id of each logits column (None: they span the vocabulary)
    nodes: list[_TreeNode] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # the nodes the last forward scored the children of
    written: list[int] = field(default_factory=list)  # expanded nodes, in the slot's row order

    @property
    def width(self) -> int:
        return self.request.num_candidates

    def advance(self, output: ForwardOutput, drafted_features) -> ForwardItem | None:
        """Score the children of the nodes the forward just read; the next forward, or None when done."""
        parents = self.frontier or [-1]
        rows = output.logits[-len(parents):].astype(np.float64)
        log_probs = rows - rows.max(axis=-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(axis=-1, keepdims=True))
        hidden = drafted_features(output.hidden[-len(parents):]) if output.hidden is not None else None
        depth = 1 if parents[0] < 0 else self.nodes[parents[0]].depth + 1
        first_new = len(self.nodes)
        count = min(self.width, log_probs.shape[-1])
        for r, parent in enumerate(parents):
            top = np.argpartition(-log_probs[r], count - 1)[:count]
            prior = self.nodes[parent].score if parent >= 0 else 0.0
            feature = hidden[r] if hidden is not None else None
            for column in top[np.argsort(-log_probs[r, top], kind="stable")]:
                token = int(column if self.columns is None else self.columns[column])
                self.nodes.append(_TreeNode(token, parent, prior + float(log_probs[r, column]), depth, feature))
        if depth >= self.request.num_draft_tokens:
            return None
        scores = sorted((node.score for node in self.nodes), reverse=True)
        floor = scores[self.request.tree_nodes - 1] if len(scores) >= self.request.tree_nodes else -np.inf
        floor = max(floor, self._least_score)  # no child of a node at the floor can score above it
        new = sorted(range(first_new, len(self.nodes)), key=lambda i: -self.nodes[i].score)[:self.width]
        self.frontier = [i for i in new if self.nodes[i].score > floor]
        if not self.frontier:
            return None
        cached = len(self.written)
        for i in self.frontier:
            self.nodes[i].row = len(self.written)
            self.written.append(i)
        tree_parents = [self.nodes[self.nodes[i].parent].row if self.nodes[i].parent >= 0 else -1
                        for i in self.written]
        features = None if hidden is None else np.stack([self.nodes[i].feature for i in self.frontier])
        return ForwardItem(self.entry.slot, self.base, np.array([self.nodes[i].token for i in self.frontier]),
                           num_logits=len(self.frontier), tree_parents=np.array(tree_parents),
                           num_cached_nodes=cached, num_hidden=0 if features is None else len(self.frontier),
                           features=features)

    @property
    def _least_score(self) -> float:
        """The lowest path log probability a proposed node may have (min_confidence; -inf: none)."""
        floor = self.request.min_confidence
        return float(np.log(floor)) if floor > 0 else -np.inf

    def proposal(self) -> tuple[np.ndarray, np.ndarray]:
        """The best `tree_nodes` nodes at or above min_confidence (at least one), parents first:
        (token ids, parents)."""
        nodes = self.nodes
        best = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))
        likely = [i for i in best[:self.request.tree_nodes] if nodes[i].score >= self._least_score]
        chosen = set(likely or best[:1])
        for i in list(chosen):  # a parent scores at least its child, so this adds nothing but for rounding
            while nodes[i].parent >= 0 and nodes[i].parent not in chosen:
                i = nodes[i].parent
                chosen.add(i)
        keep = sorted(chosen, key=lambda i: (nodes[i].depth, i))
        position = {node: j for j, node in enumerate(keep)}
        parents = [position[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep]
        return np.asarray([nodes[i].token for i in keep], dtype=np.int64), np.asarray(parents, dtype=np.int64)


class DraftEngine(_Engine):
    """Proposes a chain (num_candidates = 1) or a tree of `num_candidates` chains of `num_draft_tokens`
    tokens per sequence in one call, looping inside, or a dynamic tree (`tree_nodes`, `min_confidence`).
    Tree rows are scratch: the caller's next `past_length` drops them, and the accepted tokens come back as
    catch-up input. A step with input and `num_draft_tokens` 0 only writes the input's rows (a chunk of a long
    prompt) and proposes nothing.

    Over an EAGLE head (runtime.feature_size > 0) every input token comes with its feature (the target's, from
    verification); each drafted token's row is fed the head's own output feature at its parent's row."""

    def _drafted_features(self, outputs: np.ndarray) -> np.ndarray:
        """The features of drafted rows: the head's own outputs, zero-padded where its feature fuses target
        layers (specdec.checkpoint.FEATURE_LAYERS_KEY) that a drafted token has no outputs of."""
        missing = self.runtime.feature_size - outputs.shape[-1]
        return np.pad(outputs, ((0, 0), (0, missing))) if missing > 0 else outputs

    def _greedy_columns(self, request: StepRequest) -> np.ndarray | None:
        """The runtime's logits columns where a chain can choose among them alone: greedy, no logits kept. Other
        chains get logits spread over the vocabulary, exactly what they sampled from and what the rejection
        sampler reads back."""
        plain = request.sampling.greedy and not request.want_logits
        return self.runtime.logit_ids if plain else None

    def _features(self, request: StepRequest) -> np.ndarray | None:
        size = self.runtime.feature_size
        if not size:
            return None
        shape = (len(request.input_ids), size)
        if request.features is None or request.features.shape != shape:
            got = None if request.features is None else request.features.shape
            raise InvalidRequestError("features", f"an EAGLE draft needs features of shape {shape}, got {got}")
        return np.asarray(request.features, dtype=np.float32)

    def _step(self, requests: list[StepRequest]) -> list[StepResult]:
        self.slots.evict_idle()
        results = [StepResult() for _ in requests]
        growing: list[_Growth] = []
        items: list[ForwardItem] = []
        catch_up: list[tuple[SlotEntry, ForwardItem]] = []
        for i, request in enumerate(requests):
            try:
                k, c = request.num_draft_tokens, request.num_candidates
                if k < 0:
                    raise InvalidRequestError("num_draft_tokens", "must be >= 0")
                if c < 1:
                    raise InvalidRequestError("num_candidates", "must be >= 1")
                entry = self._prepare(request, extra_rows=max(c * k - 1, 0))
                if k and not len(request.input_ids):
                    raise InvalidRequestError("input_ids", "drafting needs at least one new token")
                features = self._features(request) if len(request.input_ids) else None
                eagle = features is not None
                if request.tree_nodes and (not request.sampling.greedy or request.want_logits):
                    raise InvalidRequestError("tree_nodes", "a dynamic tree is drafted greedily, without logits")
                if request.min_confidence and not request.tree_nodes:
                    raise InvalidRequestError("min_confidence", "floors a dynamic tree's nodes (tree_nodes > 0)")
                if k:
                    base = request.past_length + len(request.input_ids)
                    growing.append(_DynamicTree(i, entry, request, base, self.runtime.logit_ids)
                                   if request.tree_nodes > 0 else
                                   _Growth(i, entry, request, base, make_rng(request.sampling.seed),
                                           columns=self._greedy_columns(request)))
                    items.append(ForwardItem(entry.slot, request.past_length, np.asarray(request.input_ids),
                                             num_hidden=int(eagle), features=features))
                elif len(request.input_ids):
                    catch_up.append((entry, ForwardItem(entry.slot, request.past_length,
                                                        np.asarray(request.input_ids), features=features)))
            except SpecDecError as exc:
                results[i].error = exc
        if catch_up:
            self._forward([item for _, item in catch_up])
            for entry, item in catch_up:
                entry.written_length = item.end_row
        while growing:
            outputs = self._forward(items)
            next_growing, next_items = [], []
            for growth, item, output in zip(growing, items, outputs, strict=True):
                logits = output.logits
                if isinstance(growth, _Growth) and growth.columns is None:
                    logits = expand_to_vocab(logits, self.runtime.logit_ids, self.runtime.vocab_size)
                growth.entry.written_length = item.end_row
                if isinstance(growth, _DynamicTree):
                    follow = growth.advance(output, self._drafted_features)
                    if follow is None:
                        result = results[growth.index]
                        result.token_ids, result.parents = growth.proposal()
                    else:
                        next_growing.append(growth)
                        next_items.append(follow)
                    continue
                first_level = not growth.tokens
                count = growth.width if first_level else 1
                new = growth.choose(logits, count)
                growth.tokens.extend(new)
                if output.hidden is not None:  # EAGLE: a new token's feature is its parent row's output
                    drafted = self._drafted_features(output.hidden)
                    growth.features = np.repeat(drafted[-1:], count, axis=0) if first_level else drafted
                if growth.request.want_logits:
                    growth.logits.extend([logits[-1]] * count if first_level else list(logits))
                if growth.depth < growth.request.num_draft_tokens:
                    next_growing.append(growth)
                    next_items.append(self._extend(growth, new))
                else:
                    result = results[growth.index]
                    result.token_ids = np.asarray(growth.tokens, dtype=np.int64)
                    if growth.request.want_logits:
                        result.logits = np.stack(growth.logits)
            growing, items = next_growing, next_items
        return results

    @staticmethod
    def _extend(growth: _Growth, new: list[int]) -> ForwardItem:
        """The forward that scores the newest level of a growing chain or tree."""
        features = growth.features
        num_hidden = 0 if features is None else len(new)
        if growth.width == 1:
            row = growth.base + growth.depth - 1
            return ForwardItem(growth.entry.slot, row, np.array(new), num_hidden=num_hidden, features=features)
        cached = len(growth.tokens) - growth.width
        return ForwardItem(growth.entry.slot, growth.base, np.array(new), num_logits=len(new),
                           tree_parents=np.array(tree_draft_parents(growth.width, growth.depth)),
                           num_cached_nodes=cached, num_hidden=num_hidden, features=features)
