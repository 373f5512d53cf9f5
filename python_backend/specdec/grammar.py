"""Structured outputs: a request's guide (any JSON, a JSON schema, a regex, an EBNF grammar) as the tokens its
output may take next, through llguidance.

llguidance, not xgrammar: it builds masks lazily (an Earley parser over the tokenizer's trie), so a guide costs
~1 ms to prepare and a mask tens of microseconds on this CPU, with no torch; it rolls consumed tokens back, says
how many tokens of a draft a grammar admits without consuming them, and which bytes the grammar forces next.
That is what speculation needs: drafts the grammar forbids are cut before verification, every row a
verification scores is masked with the grammar's state after that row's path, and forced bytes are drafted at
no model cost (`Constraint.forced`). TensorRT-LLM offers it as its second guided-decoding backend.

JSON is written compactly with fixed separators (", " and ": "): a schema's keys, quotes and separators are then
forced, and drafted for free.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from specdec.errors import InvalidRequestError, UnsupportedError

# TensorRT-LLM's guided_decoding_guide_type values this server implements ("json": any JSON value, no guide).
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
UNSUPPORTED_GUIDE_TYPES = ("structural_tag",)  # TensorRT-LLM's, refused with 400
GUIDE_FIELD = "guided_decoding_guide"
MAX_GUIDE_BYTES = 64 * 1024
MAX_ERROR_CHARS = 400
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The compile budget: llguidance's limits on a grammar's size and on the work of one mask (its defaults, named
# here so a deployment reads them in one place). A guide over them is refused; a step over them ends its request.
PARSER_LIMITS = {"max_grammar_size": 500_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
                 "step_max_items": 50_000}


@dataclass(frozen=True)
class Guide:
    """What a request's output must match: `type` one of GUIDE_TYPES, `text` the schema, regex or grammar."""

    type: str
    text: str = ""


class Grammars:
    """Guides compiled for one tokenizer, cached by their text (a matcher made once per guide and copied per
    request). The grammar engine reads the tokenizer at the first guide: a tokenizer it cannot read (a WordPiece
    one) refuses constrained requests with 400 and serves every other."""

    def __init__(self, tokenizer_json: str, vocab_size: int, end_ids: Iterable[int], cache_size: int = 256) -> None:
        self.end_ids = sorted(end_ids)
        self.vocab_size = vocab_size
        self.tokenizer_json = tokenizer_json
        self._tokenizer: LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self.limits = LLParserLimits(**PARSER_LIMITS)
        self.cache_size = cache_size
        self._matchers: OrderedDict[Guide, LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None and self._tokenizer_error is None:
            try:
                self._tokenizer = LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                              eos_token=self.end_ids or None)
            except Exception as exc:  # noqa: BLE001 - a tokenizer the engine cannot read
                self._tokenizer_error = _brief(exc)
        if self._tokenizer is None:
            raise UnsupportedError(f"{GUIDE_FIELD}_type", f"guided decoding is not available for this model's "
                                   f"tokenizer ({self._tokenizer_error})")
        return self._tokenizer

    def constraint(self, guide: Guide, end_ids: Iterable[int] | None = None) -> Constraint:
        """A fresh state of `guide` for one sequence; raises InvalidRequestError naming guided_decoding_guide
        (or _type) for a guide that is not valid or too large. `end_ids`: the request's end tokens, allowed
        wherever the grammar can end (the tokenizer's by default)."""
        matcher = self._matchers.get(guide)
        if matcher is None:
            matcher = self._compile(guide)
            self._matchers[guide] = matcher
            if len(self._matchers) > self.cache_size:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(guide)
        return Constraint(matcher.deep_copy(), self.vocab_size, self.end_ids,
                          self.end_ids if end_ids is None else sorted(end_ids), self.tokenizer)

    def _compile(self, guide: Guide) -> LLMatcher:
        if guide.type in UNSUPPORTED_GUIDE_TYPES:
            raise UnsupportedError(f"{GUIDE_FIELD}_type", f"{guide.type} is not supported by this server")
        if guide.type not in GUIDE_TYPES:
            raise InvalidRequestError(f"{GUIDE_FIELD}_type", f"must be one of {', '.join(GUIDE_TYPES)}; got "
                                      f"{guide.type!r}")
        if len(guide.text.encode()) > MAX_GUIDE_BYTES:
            raise InvalidRequestError(GUIDE_FIELD, f"at most {MAX_GUIDE_BYTES} bytes")
        if guide.type != "json" and not guide.text.strip():
            raise InvalidRequestError(GUIDE_FIELD, f"is required for {guide.type}")
        try:
            if guide.type == "json":
                grammar = LLMatcher.grammar_from_json_schema("{}", overrides=JSON_OPTIONS)
            elif guide.type == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(_json_object(guide.text), overrides=JSON_OPTIONS)
            elif guide.type == "regex":
                grammar = LLMatcher.grammar_from_regex(guide.text)
            else:
                grammar = LLMatcher.grammar_from_lark(any_to_lark(guide.text))
        except Exception as exc:  # a schema that is not JSON, a grammar that does not parse
            raise InvalidRequestError(GUIDE_FIELD, f"is not a valid {guide.type}: {_brief(exc)}") from exc
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise InvalidRequestError(GUIDE_FIELD, f"is not a valid {guide.type}: {_brief(matcher.get_error())}")
        return matcher


def _json_object(text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema is an object")
    return text


def _brief(error: object) -> str:
    """An engine's error on one line (its messages draw the faulty spot over several)."""
    text = " ".join(str(error).split())
    return text[:MAX_ERROR_CHARS] if text else "rejected"


class GrammarError(RuntimeError):
    """A sequence's grammar state failed (a step over the parser's limits): its request ends with this error."""


class Constraint:
    """One sequence's grammar state: it has consumed the output so far (`consume`). Rows of a verification
    are masked with the state after each row's path (`allowed`); drafts are cut where the grammar stops
    admitting them (`admitted`)."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, grammar_end_ids: Sequence[int],
                 end_ids: Sequence[int], tokenizer: LLTokenizer) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.grammar_end_ids = list(grammar_end_ids)
        self.end_ids = list(end_ids)
        self.tokenizer = tokenizer
        self.forced_tokens = 0  # output tokens the grammar drafted (`forced`) and the target accepted

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"guided decoding stopped: {_brief(self.matcher.get_error())}")

    def _mask(self) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        self._check()
        mask = bits[: self.vocab_size].astype(bool)
        if self.grammar_end_ids != self.end_ids:  # the request's end tokens stand for the grammar's
            can_end = bool(mask[self.grammar_end_ids].any())
            mask[self.grammar_end_ids] = False
            mask[[t for t in self.end_ids if t < self.vocab_size]] = can_end
        return mask

    def allowed(self, paths: Sequence[Sequence[int]], width: int) -> np.ndarray:
        """`[len(paths), width]` bools: the tokens the grammar admits after the output + `paths[r]`. A row whose
        path the grammar does not admit is never reached (its path is rejected first): all True. Columns past
        the tokenizer's vocabulary (padding of the model's) are never admitted."""
        out = np.zeros((len(paths), width), dtype=bool)
        for r, path in enumerate(paths):
            consumed = self.matcher.try_consume_tokens(list(path)) if len(path) else 0
            if consumed == len(path):
                out[r, : self.vocab_size] = self._mask()
            else:
                out[r] = True
            if consumed:
                self.matcher.rollback(consumed)
        return out

    def admitted(self, paths: Sequence[Sequence[int]]) -> list[bool]:
        """Whether the grammar admits each path (from the output so far) in full."""
        return [self.matcher.validate_tokens(list(path)) == len(path) for path in paths]

    def forced(self, limit: int, after: Sequence[int] = ()) -> list[int]:
        """Up to `limit` tokens spelling the bytes the grammar forces next, after the output + `after` (a draft
        chain the grammar admits; [] where it does not): a key, its quotes and separator, the rest of an enum
        value, drafted at no model cost. The tokens are the tokenizer's own spelling of those bytes, which the
        model almost always follows; the target still verifies them."""
        if limit <= 0:
            return []
        consumed = self.matcher.try_consume_tokens(list(after)) if after else 0
        try:
            if consumed < len(after) or self.matcher.is_stopped():
                return []
            forced = self.matcher.compute_ff_bytes()
            if not forced:
                return []
            tokens = self.tokenizer.tokenize_bytes(forced)[:limit]
            return tokens[: self.matcher.validate_tokens(tokens)]
        finally:
            if consumed:
                self.matcher.rollback(consumed)

    def consume(self, token: int) -> None:
        """The output's next token (one the mask admitted)."""
        if not self.matcher.consume_token(token):
            self._check()
            raise GrammarError(f"guided decoding stopped: token {token} is not admitted by the grammar")

    @property
    def done(self) -> bool:
        """Whether the grammar admits nothing more but the end of the output."""
        return self.matcher.is_stopped()
