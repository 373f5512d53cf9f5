"""Tensor names and types of every model in the repository: the one place they are written down.

The public inputs follow TensorRT-LLM's ensemble so its clients, `/generate`, perf_analyzer and genai-perf
work unchanged. build/render_configs.py writes config.pbtxt files from these tables; the model.py
adapters read and write tensors by these names.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.drafting.spec import DRAFTER_MODELS


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton type without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)
    optional: bool = False
    ragged: bool = False


# ---- public contract (ensemble) ----
PUBLIC_INPUTS = (
    TensorSpec("text_input", "STRING"),
    TensorSpec("max_tokens", "INT32"),
    TensorSpec("stream", "BOOL", optional=True),
    TensorSpec("end_id", "INT32", optional=True),
    TensorSpec("pad_id", "INT32", optional=True),
    TensorSpec("temperature", "FP32", optional=True),
    TensorSpec("top_k", "INT32", optional=True),
    TensorSpec("top_p", "FP32", optional=True),
    TensorSpec("runtime_top_k", "INT32", optional=True),  # TensorRT-LLM's other names for top_k / top_p
    TensorSpec("runtime_top_p", "FP32", optional=True),
    TensorSpec("seed", "UINT64", optional=True),
    TensorSpec("random_seed", "UINT64", optional=True),
    TensorSpec("min_p", "FP32", optional=True),  # vLLM's (an extension of TensorRT-LLM's inputs)
    TensorSpec("min_length", "INT32", optional=True),
    TensorSpec("stop_words", "STRING", (-1,), optional=True),
    TensorSpec("bad_words", "STRING", (-1,), optional=True),
    TensorSpec("exclude_input_in_output", "BOOL", optional=True),
    TensorSpec("return_log_probs", "BOOL", optional=True),
    # With return_log_probs: this many of each token's most probable alternatives too (0-20; an extension).
    TensorSpec("num_top_log_probs", "INT32", optional=True),
    TensorSpec("return_context_logits", "BOOL", optional=True),
    TensorSpec("return_generation_logits", "BOOL", optional=True),
    TensorSpec("return_perf_metrics", "BOOL", optional=True),
    TensorSpec("beam_width", "INT32", optional=True),
    TensorSpec("num_return_sequences", "INT32", optional=True),
    TensorSpec("repetition_penalty", "FP32", optional=True),
    TensorSpec("presence_penalty", "FP32", optional=True),
    TensorSpec("frequency_penalty", "FP32", optional=True),
    # OpenAI's logit_bias as two tensors (an extension: TensorRT-LLM biases words, not token ids).
    TensorSpec("logit_bias_ids", "INT32", (-1,), optional=True),
    TensorSpec("logit_bias_values", "FP32", (-1,), optional=True),
    TensorSpec("length_penalty", "FP32", optional=True),
    TensorSpec("num_draft_tokens", "INT32", optional=True),
    TensorSpec("num_candidates", "INT32", optional=True),
    TensorSpec("acceptance", "STRING", optional=True),
    TensorSpec("verify_threshold", "FP32", optional=True),
    TensorSpec("task", "STRING", optional=True),
    TensorSpec("drafter", "STRING", optional=True),
    # TensorRT-LLM's guided decoding: json | json_schema | regex | ebnf_grammar, and the schema, regex or grammar.
    TensorSpec("guided_decoding_guide_type", "STRING", optional=True),
    TensorSpec("guided_decoding_guide", "STRING", optional=True),
    # Sent by Triton's OpenAI frontend on every request: with return_num_output_tokens, num_output_tokens counts
    # the tokens of each response (the frontend sums a stream's), as Triton's vLLM backend does.
    TensorSpec("return_num_input_tokens", "BOOL", optional=True),
    TensorSpec("return_num_output_tokens", "BOOL", optional=True),
)
STATS_OUTPUTS = (
    TensorSpec("acceptance_rate", "FP32"),
    TensorSpec("total_accepted_draft_tokens", "INT32"),
    TensorSpec("total_draft_tokens", "INT32"),
    TensorSpec("num_output_tokens", "INT32"),
    TensorSpec("fallback_active", "BOOL"),
    TensorSpec("num_input_tokens", "INT32"),
    TensorSpec("drafter_used", "STRING"),  # model | eagle | ngram, or none (plain decoding)
    # Per request as vLLM reports it per choice (speculative_decoding_stats): verifications so far, how many of
    # them accepted j draft tokens ([j]), and the deepest proposal verified (the most a verification could accept).
    TensorSpec("total_verification_passes", "INT32"),
    TensorSpec("acceptance_histogram", "INT32", (-1,)),
    TensorSpec("max_draft_depth", "INT32"),
)
# text_output as TensorRT-LLM's postprocessing returns it: flattened over batch x beam, shape [1] for one prompt
# (its end_to_end_grpc_client.py reads `as_numpy("text_output")[0].decode()`). batch_index and sequence_index are
# always 0 here (one prompt per request, num_return_sequences 1) and are declared because its clients ask for them.
TEXT_OUTPUT = TensorSpec("text_output", "STRING", (-1,))
INDEX_OUTPUTS = (TensorSpec("batch_index", "INT32"), TensorSpec("sequence_index", "INT32"))
# With return_log_probs, for the tokens each response adds (empty otherwise): TensorRT-LLM's output_log_probs
# [beam, tokens] and cum_log_probs [beam] (the running sum), and as extensions the tokens themselves and their
# rows' most probable alternatives (num_top_log_probs of them) [tokens, k].
LOGPROB_OUTPUTS = (TensorSpec("output_log_probs", "FP32", (-1, -1)), TensorSpec("cum_log_probs", "FP32", (-1,)),
                   TensorSpec("output_token_ids", "INT32", (-1,)), TensorSpec("top_log_prob_ids", "INT32", (-1, -1)),
                   TensorSpec("top_log_probs", "FP32", (-1, -1)))
PASSED_THROUGH = (*STATS_OUTPUTS, *LOGPROB_OUTPUTS)  # from speculative_decoding through postprocessing unchanged
PUBLIC_OUTPUTS = (TEXT_OUTPUT, *PASSED_THROUGH, *INDEX_OUTPUTS)

# ---- preprocessing ----
PREPROCESSING_INPUTS = (PUBLIC_INPUTS[0],)
PREPROCESSING_OUTPUTS = (TensorSpec("input_ids", "INT32", (-1,)), TensorSpec("input_lengths", "INT32"))

# ---- speculative_decoding: token ids in, token chunks out ----
GENERATION_INPUTS = (*PREPROCESSING_OUTPUTS, *PUBLIC_INPUTS[1:])
TOKEN_OUTPUTS = (TensorSpec("output_ids", "INT32", (-1,)), TensorSpec("prefix_ids", "INT32", (-1,)))
# Names the generation a chunk belongs to, so postprocessing can report it abandoned when the ensemble's client
# is gone (cancellation does not reach speculative_decoding through an ensemble on Triton 2.51).
GENERATION_ID = TensorSpec("generation_id", "UINT64", optional=True)
GENERATION_OUTPUTS = (*TOKEN_OUTPUTS, *PASSED_THROUGH, GENERATION_ID)

# ---- postprocessing: token chunks in, text out; statistics pass through ----
POSTPROCESSING_INPUTS = GENERATION_OUTPUTS
POSTPROCESSING_OUTPUTS = PUBLIC_OUTPUTS

# ---- BLS contract of target_model and draft_model (sequence-batched, one KV slot per sequence) ----
DECODER_INPUTS = (
    TensorSpec("input_ids", "INT32", (-1,), ragged=True),
    TensorSpec("past_length", "INT32", optional=True),  # 0 when absent
    TensorSpec("num_logits", "INT32", optional=True),
    TensorSpec("tree_parents", "INT32", (-1,), optional=True, ragged=True),
    TensorSpec("commit_base", "INT32", optional=True),
    TensorSpec("commit_rows", "INT32", (-1,), optional=True, ragged=True),
    # Return the features (final-normed hidden states) of the last num_hidden inputs as hidden_states: what an
    # EAGLE head drafts from.
    TensorSpec("num_hidden", "INT32", optional=True),
)
# How a draft drafts; on the target, how a plain step's token is drawn (the token after the last input).
SAMPLING_INPUTS = (TensorSpec("temperature", "FP32", optional=True), TensorSpec("top_k", "INT32", optional=True),
                   TensorSpec("top_p", "FP32", optional=True), TensorSpec("seed", "UINT64", optional=True))
DRAFT_INPUTS = (
    *DECODER_INPUTS,
    TensorSpec("num_draft_tokens", "INT32", optional=True),
    TensorSpec("num_candidates", "INT32", optional=True),
    *SAMPLING_INPUTS,
    # A chain stops before a token (past the first) the drafter gives less probability than this (0: never).
    TensorSpec("min_confidence", "FP32", optional=True),
    # > 0: a dynamic tree of at most this many nodes instead of num_candidates chains (its parents come back
    # as draft_parents).
    TensorSpec("tree_nodes", "INT32", optional=True),
)
# eagle_draft: the feature of every input token, [len(input_ids), feature_size] flattened (ragged like input_ids).
EAGLE_INPUTS = (*DRAFT_INPUTS, TensorSpec("features", "FP32", (-1,), optional=True, ragged=True))
DECODER_OUTPUTS = (TensorSpec("token_ids", "INT32", (-1,)), TensorSpec("logits", "FP32", (-1, -1)),
                   TensorSpec("hidden_states", "FP32", (-1, -1)))
DRAFT_OUTPUTS = (*DECODER_OUTPUTS, TensorSpec("draft_parents", "INT32", (-1,)))  # a dynamic tree's parents
# target_model also takes a wave of steps of several sequences in one request (specdec.packing): `steps` is the
# step table [steps, len(STEP_COLUMNS)], `step_sampling` [steps, len(SAMPLING_COLUMNS)], input_ids / tree_parents /
# commit_rows the steps' values concatenated; the outputs come back concatenated in step order, with step_errors
# ("" or the message) per step.
PACKED_STEPS = TensorSpec("steps", "INT64", (-1, -1), optional=True, ragged=True)
PACKED_SAMPLING = TensorSpec("step_sampling", "FP32", (-1, -1), optional=True, ragged=True)
# Plain decoding: pick this many tokens in one call, each further one after a one-token step on the token before
# (specdec.engines.StepRequest.num_steps); token_ids then ends with them all.
NUM_STEPS = TensorSpec("num_steps", "INT32", optional=True)
TARGET_INPUTS = (*DECODER_INPUTS, *SAMPLING_INPUTS, NUM_STEPS, PACKED_STEPS, PACKED_SAMPLING)
TARGET_OUTPUTS = (*DECODER_OUTPUTS, TensorSpec("step_errors", "STRING", (-1,)))

# Sequence-batcher control tensors delivered to target_model / draft_model.
CONTROL_START = "START"
CONTROL_END = "END"
CONTROL_CORRID = "CORRID"

MODEL_NAMES = {
    "ensemble": "ensemble",
    "preprocessing": "preprocessing",
    "speculative_decoding": "speculative_decoding",
    "postprocessing": "postprocessing",
    "target": "target_model",
    "draft": DRAFTER_MODELS["model"],
    "eagle": DRAFTER_MODELS["eagle"],
}
