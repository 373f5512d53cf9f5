"""The speculate -> verify -> accept loop, independent of any transport.

`SpeculativeGenerator.generate` drives one sequence through a `ModelBackend` (BLS calls inside Triton, or
in-process engines in tests) and yields the tokens each iteration adds. Speculation off (length 0, or the
profile fallen back) is plain autoregressive decoding through the same target: the baseline and the
fallback.

Cache bookkeeping (rollback by length): `target_valid` counts the leading tokens whose KV rows are valid
in the target's slot; every call sends `tokens[target_valid:]` (normally just the last token) plus the
proposal after `past_length=target_valid`. After a tree verification the accepted path's rows are made
contiguous by a commit that rides on the next target call.

Rows: a generation's sequence never holds more than prompt + max_tokens rows in either decoder (the length
of each proposal is bounded by that), which is what admission reserves for it in KV memory
(specdec.admission).

Chunked prefill: a prompt longer than `prefill_chunk` tokens goes to the target (and the draft model) in
chunks of that many tokens, one call each. Every call is an await, so other sequences' steps run between
the chunks (inside Triton, the sequence batcher puts them into the same execute() as the next chunk): a
long prompt delays a running stream by one chunk per step, not by its whole prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from specdec.acceptance import Verdict, greedy_verify, typical_verify
from specdec.adaptive import AcceptanceEstimate, CostModel, choose_length, choose_lookup_length
from specdec.config import DynamicTree, SpeculationSettings
from specdec.drafting.base import ModelDrafter, Proposal, extended, pruned
from specdec.drafting.models import build_model_drafter
from specdec.drafting.ngram import NgramDrafter
from specdec.drafting.spec import DRAFTER_MODELS, ModelDrafterName
from specdec.engines import StepRequest, StepResult
from specdec.errors import InvalidRequestError
from specdec.fallback import FallbackMonitor
from specdec.grammar import Constraint
from specdec.logits_processing import LogitsOptions
from specdec.logprobs import TokenLogprob, token_logprobs
from specdec.rejection_sampler import rejection_verify
from specdec.sampling import SamplingParams, make_rng, probabilities, sample, step_seed
from specdec.waves import WaveGate

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per prefill call (0: the whole prompt in one call)


class ModelBackend(Protocol):
    async def target_step(self, request: StepRequest) -> StepResult: ...

    async def target_steps(self, requests: list[StepRequest]) -> list[StepResult]:
        """A wave of steps of different sequences, served together where the backend can."""
        ...

    async def drafter_step(self, drafter: ModelDrafterName, request: StepRequest) -> StepResult:
        """A step of a model drafter's model (`model`: the draft model, `eagle`: the EAGLE head)."""
        ...


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    end_ids: frozenset[int] = frozenset()
    num_draft_tokens: int = 0  # a fixed chain from the draft model, when `settings` is not given
    min_tokens: int = 0  # end tokens are ignored until this many tokens were generated
    settings: SpeculationSettings | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logits_options: LogitsOptions = field(default_factory=LogitsOptions)  # penalties, logit bias, bad words
    # The output ends at the token that completes one of these texts (kept, as TensorRT-LLM's stop_words);
    # `decode` turns output tokens into text (the tokenizer's).
    stop_texts: tuple[str, ...] = ()
    decode: Callable[[list[int]], str] | None = None
    # Structured output: the output follows this grammar state (specdec.grammar); it masks every row the target
    # scores, cuts drafts where the grammar stops admitting them, and drafts what the grammar forces.
    grammar: Constraint | None = None
    # Log-probabilities of the emitted tokens, each with this many of its row's most probable tokens (None: none).
    logprobs: int | None = None

    @property
    def rows_needed(self) -> int:
        """The most KV rows its sequence holds in a decoder: prompt + max_tokens."""
        return len(self.prompt_ids) + self.max_tokens

    def speculation(self) -> SpeculationSettings:
        if self.settings is not None:
            return self.settings
        k = self.num_draft_tokens
        return SpeculationSettings(task="text", drafter="model", min_length=k, max_length=k, num_candidates=1,
                                   acceptance="greedy" if self.sampling.greedy else "rejection",
                                   verify_threshold=0.7, explicit_length=True)


@dataclass
class GenerationStats:
    output_tokens: int = 0
    draft_tokens: int = 0  # per verification, the proposal's depth (the most it could accept)
    accepted_draft_tokens: int = 0
    verification_passes: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)  # [j]: verifications that accepted j drafts
    draft_failures: int = 0
    speculation_length: int = 0  # the k of the latest iteration (0 = plain step)
    fallback_active: bool = False
    task: str = ""
    drafter: str = ""  # model | eagle | ngram | model+ngram | eagle+ngram; "none": plain decoding
    lookup_draft_tokens: int = 0  # of draft_tokens, those prompt lookup proposed
    lookup_accepted_tokens: int = 0
    grammar_draft_tokens: int = 0  # of draft_tokens, those the grammar forced (drafted at no model cost)
    grammar_accepted_tokens: int = 0
    grammar_pruned_tokens: int = 0  # draft tokens cut before verification because the grammar forbids them
    load_plain_steps: int = 0  # plain steps taken because more sequences generated than the profile speculates for
    # Seconds per phase of the prefill and iterations (specdec.metrics.PHASES but "other"): draft, lookup, wait,
    # target, accept; and their whole time, of which "other" is what no phase took.
    phase_seconds: dict[str, float] = field(default_factory=dict)
    iteration_seconds: float = 0.0

    def add_time(self, phase: str, seconds: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.output_tokens / self.target_calls if self.target_calls else 0.0

    def record_verification(self, depth: int, accepted: int) -> None:
        self.verification_passes += 1
        self.draft_tokens += depth
        self.accepted_draft_tokens += accepted
        if len(self.accepted_per_position) < depth:
            self.accepted_per_position.extend([0] * (depth - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        if len(self.acceptance_histogram) <= accepted:
            self.acceptance_histogram.extend([0] * (accepted + 1 - len(self.acceptance_histogram)))
        self.acceptance_histogram[accepted] += 1


@dataclass
class GenerationUpdate:
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "context" | "cancelled"
    logprobs: list[TokenLogprob] | None = None  # one per token id, where the request asked for them


class StepError(RuntimeError):
    """A model call failed; carries the model's message."""


def _checked(result: StepResult, model: str) -> StepResult:
    if result.error is not None:
        raise StepError(f"{model}: {result.error}")
    return result


class SpeculativeGenerator:
    def __init__(self, backend: ModelBackend, max_context_length: int, costs: CostModel | None = None,
                 monitors: dict[str, FallbackMonitor] | None = None,
                 clock: Callable[[], float] = time.perf_counter, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        self.backend = backend
        self.max_context_length = max_context_length
        self.prefill_chunk = prefill_chunk
        self.costs = costs or CostModel()
        self.monitors = monitors or {}
        self._clock = clock
        self.sequences = 0  # generating now (the load a dynamic tree's max_sequences reads)
        # The target calls of concurrent sequences go out in waves, so one decoder execution serves them all.
        self.waves: WaveGate[StepRequest, StepResult] = WaveGate(lambda: self.sequences, backend.target_steps,
                                                                 clock=clock)

    def validate(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise InvalidRequestError("text_input", "the prompt is empty")
        if request.stop_texts and request.decode is None:
            raise ValueError("stop texts need a decode function")
        if len(request.prompt_ids) + request.max_tokens > self.max_context_length:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the "
                f"context window of {self.max_context_length} tokens",
            )

    async def generate(
        self,
        request: GenerationRequest,
        sequence_id: int,
        stats: GenerationStats | None = None,
        is_cancelled: Callable[[], bool] = lambda: False,
    ) -> AsyncIterator[GenerationUpdate]:
        self.validate(request)
        run = _Run(self, request, sequence_id, stats if stats is not None else GenerationStats())
        self.sequences += 1
        try:
            async for update in run.loop(is_cancelled):
                yield update
        finally:
            self.sequences -= 1
            self.waves.changed()
            await run.release()


class _Run:
    """One sequence's generation state."""

    def __init__(self, gen: SpeculativeGenerator, request: GenerationRequest, sequence_id: int,
                 stats: GenerationStats) -> None:
        self.gen = gen
        self.backend = gen.backend
        self.request = request
        self.sequence_id = sequence_id
        self.stats = stats
        self.settings = request.speculation()
        stats.task = self.settings.task
        stats.drafter = self.settings.drafter if self.settings.enabled else "none"
        if request.grammar is not None and self.settings.grammar_drafting:  # the grammar drafts in front
            stats.drafter = "grammar" if stats.drafter == "none" else f"grammar+{stats.drafter}"
        self.sampling = request.sampling
        self.rng = make_rng(self.sampling.seed, 0)
        # Penalties, a logit bias or bad words reshape the target's logits row by row (specdec.logits_processing):
        # every token is then chosen here from the processed rows.
        self.logits_options = request.logits_options
        self.grammar = request.grammar
        # Tokens are chosen here from processed rows (not by the target's own argmax or draw) when options or a
        # grammar reshape them.
        self.processes_rows = self.logits_options.active or self.grammar is not None or self.sampling.min_p > 0
        # Every step's rows come back where tokens are chosen here or their log-probabilities are asked for.
        self.rows_always = self.processes_rows or request.logprobs is not None
        self.need_target_logits = (not self.sampling.greedy or self.settings.acceptance != "greedy"
                                   or self.rows_always)
        self.estimate = AcceptanceEstimate()
        self.lookup_estimate = AcceptanceEstimate()  # prompt lookup's own acceptance: its adaptive length
        # A sampled request with a seed must give the same text on any load, and its text depends on what was
        # proposed (rejection sampling draws per proposal), so it chooses adaptive lengths from the cost model's
        # priors and its own acceptance only, not from the instance's measured call times, and drafts the
        # profile's dynamic tree whatever the number of sequences generating.
        self.load_independent = not self.sampling.greedy and self.sampling.seed is not None
        self.length_costs = CostModel() if self.load_independent else gen.costs
        self.monitor = gen.monitors.get(self.settings.task)
        self.speculate = self.settings.enabled
        # The drafter that runs a model and keeps a KV slot (specdec.drafting.base.ModelDrafter), if any.
        drafter = self.settings.drafter_spec
        self.model_drafter: ModelDrafter | None = (
            build_model_drafter(drafter.model, self.backend, sequence_id) if drafter.model is not None else None)
        # Prompt lookup: alone it proposes k tokens; in front of a model drafter it proposes first, up to
        # `lookup_length` tokens, and the model drafts only when the context's suffix has no earlier match.
        self.lookup: NgramDrafter | None = None
        self.lookup_length = 0
        if drafter.model is None:
            self.lookup = NgramDrafter()
        elif drafter.lookup:
            options = self.settings.prompt_lookup
            self.lookup = NgramDrafter(options.max_ngram, options.min_ngram)
            self.lookup_length = options.length
        self.tokens = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.target_valid = 0
        self.pending_commit: tuple[int, list[int]] | None = None
        # This iteration's tokens the grammar forced in front of prompt lookup's chain and after a drafter's chain.
        self.forced_head = self.forced_tail = 0
        self.iteration = 0

    async def loop(self, is_cancelled: Callable[[], bool]) -> AsyncIterator[GenerationUpdate]:
        started = self.gen._clock()
        result = await self._prefill(is_cancelled)
        self.stats.iteration_seconds += self.gen._clock() - started  # the prefill's target time is a phase too
        if result is None:
            yield GenerationUpdate([], finished=True, finish_reason="cancelled")
            return
        new = self._pick(result)
        while True:
            update = self._emit(*new)
            if not update.finished and is_cancelled():
                update.finished, update.finish_reason = True, "cancelled"
            yield update
            if update.finished:
                return
            self.iteration += 1
            started = self.gen._clock()
            new = await self._iterate()
            self.stats.iteration_seconds += self.gen._clock() - started

    def _prefill_chunks(self) -> list[tuple[int, int]]:
        chunk = self.gen.prefill_chunk
        if chunk <= 0 or self.prompt_len <= chunk:
            return [(0, self.prompt_len)]
        return [(start, min(start + chunk, self.prompt_len)) for start in range(0, self.prompt_len, chunk)]

    async def _prefill(self, is_cancelled: Callable[[], bool]) -> StepResult | None:
        """Write the prompt's rows in the target (and, chunked, the draft model); the result of its last
        chunk, or None when the client went away between chunks."""
        chunks = self._prefill_chunks()
        result = StepResult()
        for start, end in chunks:
            if start and is_cancelled():
                return None
            last = end == self.prompt_len
            step = self._target(StepRequest(
                self.sequence_id, past_length=start, input_ids=np.asarray(self.tokens[start:end]), start=not start,
                num_hidden=(end - start) if self._want_features else 0, want_logits=last and self.rows_always,
                sampling=self._plain_draw() if last else SamplingParams(),
            ), end - start)
            drafter = self.model_drafter if len(chunks) > 1 and self.speculate else None
            if drafter is not None and not drafter.reads_target_features:  # beside the target's chunk
                result, _ = await asyncio.gather(step, self._prefill_draft(end))
            else:
                result = await step
            self._keep_features(start, result.hidden)
            if drafter is not None and drafter.reads_target_features and not last:
                await self._prefill_draft(end)  # its rows of this chunk need the target's features: after it
            self.target_valid = end
        return result

    @property
    def _want_features(self) -> bool:
        """The target returns the features of its inputs while a drafter that reads them (the EAGLE head)
        drafts for this sequence."""
        return self.model_drafter is not None and self.model_drafter.reads_target_features and self.speculate

    def _keep_features(self, first_position: int, rows: np.ndarray | None) -> None:
        if self._want_features:
            if rows is None:
                raise StepError(f"target_model returned no hidden states for {self._drafter_model}")
            self.model_drafter.add_features(first_position, rows)

    async def _prefill_draft(self, end: int) -> None:
        """The model drafter's rows of the prompt up to `end` (a failure degrades to plain decoding)."""
        assert self.model_drafter is not None
        if not self.speculate:
            return
        try:
            await self.model_drafter.prefill(self.tokens[:end])
        except Exception as exc:
            log.warning("%s prefill failed (%s); sequence %d continues without speculation", self._drafter_model,
                        exc, self.sequence_id)
            self.stats.draft_failures += 1
            self.speculate = False

    async def _iterate(self) -> tuple[list[int], list[TokenLogprob] | None]:
        """This iteration's new tokens (and their log-probabilities, where asked)."""
        proposal, source = await self._propose()
        from_model = source == "model"
        self.stats.speculation_length = proposal.depth if proposal else 0
        pending = self.tokens[self.target_valid:]
        m = len(pending)
        nodes = proposal.tokens if proposal else []
        steps = self._plain_steps() if source == "none" else 1
        tree = proposal is not None and not proposal.is_chain
        step = StepRequest(self.sequence_id, past_length=self.target_valid, input_ids=np.asarray(pending + nodes),
                           num_logits=len(nodes) + 1,
                           want_logits=self.need_target_logits and (proposal is not None or self.rows_always),
                           num_hidden=m + len(nodes) if self._want_features else 0,
                           sampling=self._plain_draw() if proposal is None else SamplingParams(), num_steps=steps)
        if tree:
            step.tree_parents = np.asarray(
                [i - 1 for i in range(m)] + [m - 1 if p < 0 else p + m for p in proposal.parents]
            )
        if self.pending_commit is not None:
            step.commit_base, rows = self.pending_commit
            step.commit_rows = np.asarray(rows)
            self.pending_commit = None
        result = await self._target(step, m + len(nodes))
        if proposal is None:
            self._keep_features(self.target_valid, result.hidden)
            self.target_valid = len(self.tokens) + steps - 1  # the further steps' inputs are cached too
            started = self.gen._clock()
            picked = self._pick(result, steps)
            self.stats.add_time("accept", self.gen._clock() - started)
            return picked
        started = self.gen._clock()
        verdict, rows = self._verify(proposal, result)
        new = [proposal.tokens[node] for node in verdict.path] + [verdict.next_token]
        logprobs = self._logprobs(rows[[0, *(1 + node for node in verdict.path)]], new) if rows is not None else None
        self.stats.add_time("accept", self.gen._clock() - started)
        if self._want_features:  # the features of the pending tokens and of the accepted path
            self._keep_features(self.target_valid, result.hidden[list(range(m)) + [m + node for node in verdict.path]])
        self.stats.record_verification(proposal.depth, verdict.accepted)
        # The drafter's part and the grammar's: a whole grammar proposal, or the tokens it forced in front of
        # lookup's chain (`forced_head`) and after a drafter's chain (`forced_tail`). A drafter is judged only where
        # its tokens were reached (the forced ones in front of them accepted).
        head = proposal.depth if source == "grammar" else self.forced_head
        depth = proposal.depth - head - (0 if source == "grammar" else self.forced_tail)
        accepted = min(max(verdict.accepted - head, 0), depth)
        self.stats.grammar_draft_tokens += proposal.depth - depth
        self.stats.grammar_accepted_tokens += verdict.accepted - accepted
        reached = verdict.accepted >= head
        if source == "lookup":
            self.stats.lookup_draft_tokens += depth
            self.stats.lookup_accepted_tokens += accepted
            if reached:
                self.lookup_estimate.observe(accepted, depth)
        # The adaptive length and the fallback judge the profile's drafter: with lookup in front of a model
        # drafter, the model's proposals (lookup costs no model call and keeps proposing while fallen back).
        if reached and (from_model or (self.model_drafter is None and source == "lookup")):
            self.estimate.observe(accepted, depth)
            if self.monitor is not None:
                self.monitor.record(depth, accepted)
        if tree:
            rows = list(range(m)) + [m + node for node in verdict.path]
            self.pending_commit = (self.target_valid, rows)
        self.target_valid += m + verdict.accepted
        if from_model:
            self.model_drafter.verified(verdict.accepted)
        return new, logprobs

    def _length_cap(self) -> int:
        """The most draft tokens one chain may have: rows stay within prompt + max_tokens (what admission
        reserved) after the tokens so far and the target's bonus position, and no draft past max_tokens."""
        remaining = self.request.max_tokens - (len(self.tokens) - self.prompt_len)
        room = min(self.request.rows_needed, self.gen.max_context_length) - len(self.tokens) - 1
        return max(min(remaining - 1, room), 0)

    def _choose_length(self, tree: DynamicTree | None) -> int:
        """The profile drafter's k for this iteration (0: a plain step, or fallen back); a dynamic tree's depth
        where this iteration drafts `tree`."""
        s = self.settings
        if not self.speculate:
            return 0
        # A request that fixed its own length overrides the profile's automatic fallback (its results
        # still feed the monitor); everything else follows the profile's state.
        allowed = self.monitor.allow_speculation() if self.monitor is not None and not s.explicit_length else True
        self.stats.fallback_active = bool(self.monitor is not None and self.monitor.active and not s.explicit_length)
        if not allowed:
            return 0
        k = s.min_length
        if s.adaptive:
            k = choose_length(self.estimate.rate, s.min_length, s.max_length, s.num_candidates, self.length_costs)
        if tree is not None:  # its depth; at most its nodes (_propose_with_model)
            return min(tree.depth, self._length_cap())
        # A tree holds k x candidates nodes.
        return min(k, self._length_cap() // max(s.num_candidates, 1))

    def _dynamic_tree(self) -> DynamicTree | None:
        """The profile's dynamic tree where this request drafts one: with a drafter that drafts trees (the EAGLE
        head), drafting greedily (a sampled request under rejection sampling keeps the profile's chains), while
        no more sequences are generating than the tree's `max_sequences`."""
        tree = self.settings.tree
        greedy_drafting = self.settings.acceptance != "rejection" or self.sampling.greedy
        if tree is None or self.model_drafter is None or not self.model_drafter.drafts_trees or not greedy_drafting:
            return None
        return tree if self.load_independent or tree.serves(self.gen.sequences) else None

    def _lookup_length(self) -> int:
        """Prompt lookup's most tokens this iteration, in front of a model drafter (adaptive: PromptLookup)."""
        longest = min(self.lookup_length, self._length_cap())
        if not self.settings.prompt_lookup.adaptive:
            return longest
        return choose_lookup_length(self.lookup_estimate.rate, longest, self.length_costs)

    async def _propose(self) -> tuple[Proposal | None, str]:
        """This iteration's proposal (None: a plain step) and who made it: grammar, lookup or model (with, in
        `forced_head` / `forced_tail`, how many tokens the grammar forced in front of lookup's chain and after a
        drafter's chain)."""
        self.forced_head = self.forced_tail = 0
        if self.grammar is not None and self.settings.grammar_drafting:
            forced = self.grammar.forced(self._length_cap())
            if forced:  # what the grammar forces, at no model cost, in front of every drafter
                chain = Proposal(forced, list(range(-1, len(forced) - 1)), len(forced))
                after = await self._lookup_after(forced)
                if after is None:
                    return chain, "grammar"
                self.forced_head = len(forced)
                return self._within_grammar(extended(chain, after.tokens), "lookup")
        proposal, source = await self._propose_with_drafters()
        return self._within_grammar(proposal, source)

    async def _lookup_after(self, forced: list[int]) -> Proposal | None:
        """Prompt lookup's chain after the grammar's forced tokens (no model call), where the profile drafts by
        lookup and this iteration would speculate."""
        if self.lookup is None or not (self.load_independent or self.settings.speculates_under(self.gen.sequences)):
            return None
        k = self._lookup_length() if self.model_drafter is not None else self._choose_length(None)
        k = min(k, self._length_cap() - len(forced))
        return await self.lookup.propose(self.tokens, k, forced) if k > 0 else None

    def _within_grammar(self, proposal: Proposal | None, source: str) -> tuple[Proposal | None, str]:
        """A drafter's proposal cut where the grammar stops admitting it, and a chain extended by the tokens the
        grammar forces after it."""
        if proposal is None or self.grammar is None:
            return proposal, source
        if proposal.draft_probs is None:
            # A proposal drawn from q stays whole under rejection sampling: cutting the nodes the grammar forbids
            # would change what the residuals correct for (the masked target rejects them instead).
            kept = pruned(proposal, self.grammar.admitted(proposal.paths()[1:]))
            self.stats.grammar_pruned_tokens += len(proposal.tokens) - (len(kept.tokens) if kept else 0)
            if kept is None:
                if source == "model":
                    self.model_drafter.verified(0)
                return None, source
            proposal = kept
        if proposal.is_chain and self.settings.grammar_drafting:  # what the grammar forces after the chain
            tail = self.grammar.forced(self._length_cap() - proposal.depth, proposal.tokens)
            self.forced_tail = len(tail)
            proposal = extended(proposal, tail)
        return proposal, source

    async def _propose_with_drafters(self) -> tuple[Proposal | None, str]:
        """The profile's drafters' proposal (None: a plain step) and whether lookup or the model made it."""
        if not self.load_independent and not self.settings.speculates_under(self.gen.sequences):
            self.stats.load_plain_steps += 1  # above the profile's max_sequences: a plain step (features still kept)
            return None, "none"
        if self.lookup is not None and self.model_drafter is not None and self.settings.enabled:
            started = self.gen._clock()
            proposal = await self.lookup.propose(self.tokens, self._lookup_length())
            self.stats.add_time("lookup", self.gen._clock() - started)
            if proposal is not None:
                return proposal, "lookup"
        tree = self._dynamic_tree()  # decided once per iteration: the load can change at the next await
        k = self._choose_length(tree)
        if k <= 0:
            return None, "none"
        if self.model_drafter is None:
            return (await self.lookup.propose(self.tokens, k) if self.lookup is not None else None), "lookup"
        return await self._propose_with_model(k, tree), "model"

    async def _propose_with_model(self, k: int, tree: DynamicTree | None) -> Proposal | None:
        lossless_sampling = self.settings.acceptance == "rejection" and not self.sampling.greedy
        draft_sampling = SamplingParams(
            self.sampling.temperature, self.sampling.top_k, self.sampling.top_p,
            step_seed(self.sampling.seed, self.iteration),  # iteration >= 1 here: a seed derived per iteration
        ) if lossless_sampling else SamplingParams()
        started = self.gen._clock()
        try:
            if tree is not None:
                proposal = await self.model_drafter.propose(self.tokens, k, tree.width, draft_sampling,
                                                            want_probs=False, min_confidence=tree.min_probability,
                                                            tree_nodes=min(tree.nodes, self._length_cap()))
            else:
                proposal = await self.model_drafter.propose(self.tokens, k, self.settings.num_candidates,
                                                            draft_sampling, want_probs=lossless_sampling)
        except Exception as exc:  # a failing draft degrades to plain decoding, never to an error
            log.warning("%s failed (%s); sequence %d continues without speculation", self._drafter_model, exc,
                        self.sequence_id)
            self.stats.draft_failures += 1
            self.speculate = False
            return None
        self.stats.draft_calls += 1
        elapsed = self.gen._clock() - started
        self.stats.add_time("draft", elapsed)
        self.gen.costs.draft.observe(proposal.depth, elapsed)
        return proposal

    @property
    def _drafter_model(self) -> str:
        return DRAFTER_MODELS[self.model_drafter.name] if self.model_drafter is not None else "no model drafter"

    def _verify(self, proposal: Proposal, result: StepResult) -> tuple[Verdict, np.ndarray | None]:
        """The verdict, and the rows it read (processed; None where the target's greedy tokens sufficed)."""
        mode = self.settings.acceptance
        scored = len(proposal.tokens) + 1
        if self.processes_rows:
            logits = self._processed(result.logits[-scored:], proposal.paths())
        elif mode == "greedy" and result.logits is None:
            return greedy_verify(proposal.tokens, proposal.parents, result.token_ids[-scored:]), None
        else:
            logits = result.logits[-scored:]
        if mode == "greedy":
            verdict = greedy_verify(proposal.tokens, proposal.parents, logits.argmax(axis=-1))
        elif mode == "typical":
            verdict = typical_verify(proposal.tokens, proposal.parents, logits, self.settings.verify_threshold,
                                     self.sampling, self.rng)
        else:
            verdict = rejection_verify(proposal.tokens, proposal.parents, probabilities(logits, self.sampling),
                                       proposal.draft_probs, self.rng)
        return verdict, logits

    async def _target(self, step: StepRequest, scored: int) -> StepResult:
        started = self.gen._clock()
        result, called = await self.gen.waves.call(step)
        result = _checked(result, "target_model")
        self.stats.target_calls += 1
        elapsed = self.gen._clock() - called
        self.stats.add_time("wait", called - started)
        self.stats.add_time("target", elapsed)
        self.gen.costs.target.observe(scored, elapsed)
        return result

    def _plain_steps(self) -> int:
        """How many tokens a plain call picks (SpeculationConfig.plain_steps) when this iteration decodes plain
        because speculation is off (load, sampling, fallback): only where the target picks them itself (no rows
        come back: no logits options, grammar or log-probabilities), within max_tokens and the rows admission
        reserved."""
        if self.settings.plain_steps <= 1 or self.rows_always:
            return 1
        remaining = self.request.max_tokens - (len(self.tokens) - self.prompt_len)
        room = min(self.request.rows_needed, self.gen.max_context_length) - len(self.tokens)
        return max(1, min(self.settings.plain_steps, remaining, room))

    def _plain_draw(self) -> SamplingParams:
        """How the target picks a plain step's token: greedy, or drawn there from the request's sampling with a
        seed from this sequence's generator (so a seeded request's text does not depend on the load). With
        logits options the token is chosen here instead (`_pick`)."""
        if self.sampling.greedy or self.processes_rows:
            return SamplingParams()
        return replace(self.sampling, seed=int(self.rng.integers(0, 2**63)))

    def _pick(self, result: StepResult, steps: int = 1) -> tuple[list[int], list[TokenLogprob] | None]:
        """A plain call's tokens: the target's greedy choices or its draws (`_plain_draw`) after the last input
        and in its `steps` - 1 further steps, or with logits options, chosen from the processed last row; and
        their log-probabilities where asked (one step then)."""
        if not self.processes_rows:
            tokens = [int(token) for token in result.token_ids[-steps:]]
            return tokens, (self._logprobs(result.logits[-1:], tokens) if result.logits is not None else None)
        row = self._processed(result.logits[-1:], [[]])
        token = int(row[0].argmax()) if self.sampling.greedy else sample(probabilities(row, self.sampling)[0], self.rng)
        return [token], self._logprobs(row, [token])

    def _logprobs(self, rows: np.ndarray, tokens: list[int]) -> list[TokenLogprob] | None:
        top = self.request.logprobs
        return None if top is None else token_logprobs(rows, tokens, top)

    def _processed(self, rows: np.ndarray, paths: list[list[int]]) -> np.ndarray:
        """The target's rows after the request's logits options and its grammar: row r continues the output +
        `paths[r]`; a token the grammar does not admit there gets -inf."""
        if self.logits_options.active:
            rows = self.logits_options.apply(rows, self.tokens, self.prompt_len, paths)
        if self.grammar is not None:
            rows = np.where(self.grammar.allowed(paths, rows.shape[-1]), rows, -np.inf)
        return rows

    def _emit(self, new: list[int], logprobs: list[TokenLogprob] | None = None) -> GenerationUpdate:
        """Append `new` to the tokens, cut at an end token or max_tokens, and report what was added (with the
        log-probabilities of what was kept, where asked)."""
        request = self.request
        generated = len(self.tokens) - self.prompt_len
        kept: list[int] = []
        reason = None
        for token in new[: request.max_tokens - generated]:
            if token in request.end_ids and generated + len(kept) >= request.min_tokens:
                reason = "stop"
                break
            kept.append(token)
            if self.grammar is not None:
                self.grammar.consume(token)
                if self.grammar.done:  # nothing but the end can follow
                    reason = "stop"
                    break
            if request.stop_texts and self._completes_a_stop_text(kept):
                reason = "stop"
                break
        self.tokens.extend(kept)
        self.stats.output_tokens += len(kept)
        if reason is None and len(self.tokens) - self.prompt_len >= request.max_tokens:
            reason = "length"
        if reason is None and len(self.tokens) >= self.gen.max_context_length:
            reason = "context"
        kept_logprobs = None if self.request.logprobs is None else (logprobs or [])[:len(kept)]
        return GenerationUpdate(kept, finished=reason is not None, finish_reason=reason, logprobs=kept_logprobs)

    def _completes_a_stop_text(self, kept: list[int]) -> bool:
        """Whether the last of `kept` completes a stop text in the output: its text over the last few tokens
        contains one that the same tokens without it did not."""
        output = self.tokens[self.prompt_len:] + kept
        window = output[-(self._stop_window + 1):]
        assert self.request.decode is not None  # validate() checks it
        with_it, without = self.request.decode(window), self.request.decode(window[:-1])
        return any(stop in with_it and stop not in without for stop in self.request.stop_texts)

    @property
    def _stop_window(self) -> int:
        """Tokens enough to spell the longest stop text (a token spells at least one byte)."""
        return max(len(stop.encode()) for stop in self.request.stop_texts) + 1

    async def release(self) -> None:
        """END both sequences so their KV slots are freed now, not at the idle timeout."""
        # The target's START may have taken a slot even when its call failed: always END it.
        calls = [self.backend.target_step(StepRequest(self.sequence_id, end=True))]
        if self.model_drafter is not None and self.model_drafter.started:
            calls.append(self.model_drafter.release())
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                log.warning("releasing sequence %d failed: %s", self.sequence_id, outcome)
            elif isinstance(outcome, StepResult) and outcome.error is not None:
                log.warning("releasing sequence %d: %s", self.sequence_id, outcome.error)
