"""Request parameters of the public contract (TensorRT-LLM ensemble names), parsed and validated.

Transport-free: takes a mapping of input name -> numpy array (as any Triton adapter can produce) and
returns typed options, or raises InvalidRequestError naming the field. Parameters that would change the
output in a way this server does not implement are rejected, never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from specdec.acceptance import ACCEPTANCE_MODES
from specdec.config import DRAFTERS, TASKS
from specdec.errors import InvalidRequestError, UnsupportedError
from specdec.grammar import GUIDE_FIELD, Guide
from specdec.logits_processing import LogitsOptions
from specdec.logprobs import MAX_TOP_LOGPROBS
from specdec.sampling import SamplingParams

REQUEST_TASKS = ("auto", *TASKS)
MAX_TOP_K = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_tokens_limit: int = 1024
    max_draft_tokens: int = 16
    max_candidates: int = 8
    # The deployment's default when a request leaves exclude_input_in_output out (TensorRT-LLM's default is to
    # echo the prompt in a non-streamed answer; Triton's OpenAI frontend never sends it for chat requests).
    exclude_input_in_output: bool = False


@dataclass
class RequestOptions:
    """A request's parameters; None means "as the task's profile says"."""

    max_tokens: int
    stream: bool = False
    end_id: int | None = None
    min_length: int = 0
    exclude_input_in_output: bool = False
    task: str = "auto"
    num_draft_tokens: int | None = None
    num_candidates: int | None = None
    acceptance: str | None = None
    verify_threshold: float | None = None
    drafter: str | None = None
    sampling: SamplingParams = SamplingParams()
    # return_num_output_tokens (Triton's OpenAI frontend): num_output_tokens counts each response's tokens
    # instead of the running total.
    output_tokens_per_response: bool = False
    # Penalties and the logit bias; bad words are added once tokenized (`bad_words`).
    logits: LogitsOptions = LogitsOptions()
    bad_words: tuple[str, ...] = ()  # TensorRT-LLM's: never completed
    stop_words: tuple[str, ...] = ()  # the output ends at the token that completes one of these texts (kept)
    guide: Guide | None = None  # structured output (TensorRT-LLM's guided_decoding_guide_type / _guide)
    # return_log_probs: the output tokens' log-probabilities, with this many top alternatives each (None: none).
    logprobs: int | None = None


def _scalar(inputs: Mapping[str, np.ndarray], name: str) -> object | None:
    value = inputs.get(name)
    if value is None:
        return None
    array = np.asarray(value)
    if array.size != 1:
        raise InvalidRequestError(name, f"expected one value, got shape {list(array.shape)}")
    item = array.reshape(-1)[0]
    return item.decode("utf-8", errors="strict") if isinstance(item, bytes) else item.item()


def _int(inputs: Mapping[str, np.ndarray], name: str, lo: int, hi: int, default: int | None) -> int | None:
    value = _scalar(inputs, name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidRequestError(name, f"must be in [{lo}, {hi}], got {value}")
    return value


def _bool(inputs: Mapping[str, np.ndarray], name: str, default: bool) -> bool:
    value = _scalar(inputs, name)
    return default if value is None else bool(value)


def _float(inputs: Mapping[str, np.ndarray], name: str) -> float | None:
    value = _scalar(inputs, name)
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequestError(name, f"must be a finite number, got {value}")
    return value


def _choice(inputs: Mapping[str, np.ndarray], name: str, choices: tuple[str, ...], default: str | None) -> str | None:
    try:
        value = _scalar(inputs, name)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(name, "is not valid UTF-8") from exc
    if value is None or value == "":
        return default
    if value not in choices:
        raise InvalidRequestError(name, f"must be one of {', '.join(choices)}; got {value!r}")
    return str(value)


def _require_default(inputs: Mapping[str, np.ndarray], name: str, ok: object, what: str) -> None:
    """Accept a parameter only at its no-op value (clients send the defaults)."""
    value = _scalar(inputs, name)
    if value is not None and value != ok and not (isinstance(ok, float) and math.isclose(float(value), ok)):
        raise UnsupportedError(name, f"{what} is not supported by this server (got {value})")


def parse_request(inputs: Mapping[str, np.ndarray], limits: ServerLimits) -> RequestOptions:
    max_tokens = _int(inputs, "max_tokens", 1, limits.max_tokens_limit, None)
    if max_tokens is None:
        raise InvalidRequestError("max_tokens", "is required")
    for name in ("beam_width", "num_return_sequences"):
        _require_default(inputs, name, 1, f"{name} > 1")
    for name in ("return_context_logits", "return_generation_logits"):
        _require_default(inputs, name, False, name)
    top_log_probs = _int(inputs, "num_top_log_probs", 0, MAX_TOP_LOGPROBS, 0)
    logprobs = top_log_probs if _bool(inputs, "return_log_probs", False) else None
    if top_log_probs and logprobs is None:
        raise InvalidRequestError("num_top_log_probs", "needs return_log_probs")
    _require_default(inputs, "length_penalty", 1.0, "length_penalty (beam search)")
    verify_threshold = _float(inputs, "verify_threshold")
    if verify_threshold is not None and not 0 < verify_threshold <= 1:
        raise InvalidRequestError("verify_threshold", f"must be in (0, 1], got {verify_threshold}")
    return RequestOptions(
        max_tokens=max_tokens,
        stream=_bool(inputs, "stream", False),
        end_id=_int(inputs, "end_id", -1, 1 << 31, None),
        min_length=_int(inputs, "min_length", 0, limits.max_tokens_limit, 0) or 0,
        exclude_input_in_output=_bool(inputs, "exclude_input_in_output", limits.exclude_input_in_output),
        task=_choice(inputs, "task", REQUEST_TASKS, "auto") or "auto",
        num_draft_tokens=_int(inputs, "num_draft_tokens", 0, limits.max_draft_tokens, None),
        num_candidates=_int(inputs, "num_candidates", 1, limits.max_candidates, None),
        acceptance=_choice(inputs, "acceptance", ACCEPTANCE_MODES, None),
        verify_threshold=verify_threshold,
        drafter=_choice(inputs, "drafter", DRAFTERS, None),
        sampling=parse_sampling(inputs),
        output_tokens_per_response=_bool(inputs, "return_num_output_tokens", False),
        logits=parse_logits_options(inputs),
        bad_words=_words(inputs, "bad_words"),
        stop_words=_words(inputs, "stop_words"),
        guide=parse_guide(inputs),
        logprobs=logprobs,
    )


def parse_guide(inputs: Mapping[str, np.ndarray]) -> Guide | None:
    """TensorRT-LLM's guided decoding inputs: `guided_decoding_guide_type` (json, json_schema, regex,
    ebnf_grammar; absent or empty: none) and `guided_decoding_guide` (the schema, regex or grammar). The guide is
    compiled, and refused when invalid, by specdec.grammar."""
    type_field = f"{GUIDE_FIELD}_type"
    try:
        guide_type, text = _scalar(inputs, type_field), _scalar(inputs, GUIDE_FIELD)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(GUIDE_FIELD, "is not valid UTF-8") from exc
    if guide_type is None or guide_type == "":
        if text:
            raise InvalidRequestError(type_field, f"is required with {GUIDE_FIELD}")
        return None
    if not isinstance(guide_type, str) or (text is not None and not isinstance(text, str)):
        raise InvalidRequestError(type_field if not isinstance(guide_type, str) else GUIDE_FIELD, "must be a string")
    return Guide(guide_type, text or "")


MAX_PENALTY = 1e4  # beyond this a penalty only forbids (and overflows float32 logits)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 forbids a token, 100 forces it
MAX_WORDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024


def parse_logits_options(inputs: Mapping[str, np.ndarray]) -> LogitsOptions:
    """Penalties (TensorRT-LLM's names; presence and frequency as OpenAI defines them) and the logit bias
    (`logit_bias_ids` / `logit_bias_values`, OpenAI's logit_bias as two tensors; the ids are checked against
    the vocabulary by the caller)."""
    repetition = _float(inputs, "repetition_penalty")
    if repetition is not None and not 0 < repetition <= MAX_PENALTY:
        raise InvalidRequestError("repetition_penalty", f"must be in (0, {MAX_PENALTY:g}], got {repetition}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _float(inputs, name)
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequestError(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        penalties[name] = value or 0.0
    ids, values = inputs.get("logit_bias_ids"), inputs.get("logit_bias_values")
    bias: tuple[tuple[int, float], ...] = ()
    if ids is not None or values is not None:
        ids = np.asarray(ids if ids is not None else [], dtype=np.int64).reshape(-1)
        values = np.asarray(values if values is not None else [], dtype=np.float64).reshape(-1)
        if len(ids) != len(values):
            raise InvalidRequestError("logit_bias_values", f"{len(values)} values for {len(ids)} logit_bias_ids")
        if len(ids) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError("logit_bias_ids", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(ids)}")
        if len(values) and not (np.isfinite(values).all() and np.abs(values).max() <= MAX_LOGIT_BIAS):
            raise InvalidRequestError("logit_bias_values", f"must be finite and in [-{MAX_LOGIT_BIAS:g}, "
                                      f"{MAX_LOGIT_BIAS:g}]")
        if len(set(ids.tolist())) != len(ids):
            raise InvalidRequestError("logit_bias_ids", "a token id appears twice")
        bias = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return LogitsOptions(repetition_penalty=1.0 if repetition is None else repetition,
                         presence_penalty=penalties["presence_penalty"],
                         frequency_penalty=penalties["frequency_penalty"], logit_bias=bias)


def _words(inputs: Mapping[str, np.ndarray], name: str) -> tuple[str, ...]:
    """A list of strings (TensorRT-LLM's bad_words / stop_words); empty strings are ignored (clients send [""])."""
    value = inputs.get(name)
    if value is None:
        return ()
    words = []
    for item in np.asarray(value).reshape(-1):
        try:
            word = item.decode("utf-8", errors="strict") if isinstance(item, bytes) else str(item)
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(name, "is not valid UTF-8") from exc
        if word:
            words.append(word)
    if len(words) > MAX_WORDS:
        raise InvalidRequestError(name, f"at most {MAX_WORDS} words, got {len(words)}")
    return tuple(words)


def _one_of(inputs: Mapping[str, np.ndarray], names: tuple[str, str], read) -> object | None:
    """A value clients may send under either of two names (TensorRT-LLM's ensemble and its runtime spell some
    sampling inputs both ways): read with `read(name)`; both sent and different is an error naming both."""
    values = {name: read(name) for name in names}
    sent = {name: value for name, value in values.items() if value is not None}
    if len(set(sent.values())) > 1:
        raise InvalidRequestError(names[0], f"{names[0]} and {names[1]} disagree: {sent[names[0]]} vs {sent[names[1]]}")
    return next(iter(sent.values()), None)


def parse_sampling(inputs: Mapping[str, np.ndarray]) -> SamplingParams:
    """TensorRT-LLM's sampling semantics (its runtime's "Sampling Parameters"): `top_k` 0 and `top_p` 0, or
    absent, mean greedy search whatever the temperature; otherwise tokens are sampled at `temperature` (1.0
    when absent) from the top_k most probable (0: no limit) within the top_p nucleus (0: no limit).
    Temperature 0 is greedy too. OpenAI's semantics (temperature alone samples) are the OpenAI endpoint's
    to translate: it sends top_p explicitly."""
    temperature = _float(inputs, "temperature")
    if temperature is not None and not 0 <= temperature <= 100:
        raise InvalidRequestError("temperature", f"must be in [0, 100], got {temperature}")
    top_k = _one_of(inputs, ("top_k", "runtime_top_k"), lambda name: _int(inputs, name, 0, MAX_TOP_K, None))
    top_p = _one_of(inputs, ("top_p", "runtime_top_p"), lambda name: _float(inputs, name))
    if top_p is not None and not 0 <= top_p <= 1:
        raise InvalidRequestError("top_p", f"must be in [0, 1], got {top_p}")
    seed = _int(inputs, "seed", 0, (1 << 64) - 1, None)
    if seed is None:
        seed = _int(inputs, "random_seed", 0, (1 << 64) - 1, None)
    min_p = _float(inputs, "min_p")
    if min_p is not None and not 0 <= min_p <= 1:
        raise InvalidRequestError("min_p", f"must be in [0, 1], got {min_p}")
    if not top_k and not top_p:
        return SamplingParams(0.0, 0, 1.0, seed)
    return SamplingParams(1.0 if temperature is None else temperature, top_k or 0, top_p or 1.0, seed, min_p or 0.0)
