"""Request bodies of the OpenAI API subset served here, validated with pydantic (wrong types and values: 400).

Fields OpenAI defines that would change the output in a way this server does not implement (tools,
best_of, ...) are accepted only at their no-op value and refused otherwise, never ignored. Unknown fields are
refused too. Speculation controls of the ensemble and vLLM's guided decoding fields ride along as extensions;
structured outputs (response_format, guided_*) reach the ensemble as one guided_decoding guide.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

MAX_STOP_SEQUENCES = 4
MAX_SEED = (1 << 64) - 1
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (top_logprobs; completions' logprobs is capped at 5 there, 20 here as vLLM)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (vLLM's guided_choice, as an ebnf_grammar guide)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Request(BaseModel):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1  # each choice its own generation (and seed)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=MAX_SEED)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    user: str | None = None
    # Extension fields: the ensemble's speculation controls (docs/SPECULATION.md).
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None  # vLLM's extension
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # as vLLM's extension: no end before this
    num_draft_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    num_candidates: Annotated[StrictInt, Field(ge=1)] | None = None
    acceptance: Literal["greedy", "rejection", "typical"] | None = None
    verify_threshold: Annotated[StrictFloat, Field(gt=0, le=1)] | None = None
    task: Literal["auto", "json", "code", "text"] | None = None
    drafter: str | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=1e4, allow_inf_nan=False)] | None = None  # vLLM's extension
    # vLLM's guided decoding extension: at most one; the ensemble's guided_decoding_guide_type / _guide.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops or None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids (as strings, JSON's object keys); the server checks them against the vocabulary."""
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
        if value and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        return value or None

    def guide(self) -> tuple[str, str] | None:
        """(guided_decoding_guide_type, guided_decoding_guide) of this request's structured output, if any."""
        guides = self._guides()
        if len(guides) > 1:
            raise ValueError(f"give one of {', '.join(name for name, _ in guides)}, not several")
        return guides[0][1] if guides else None

    def _guides(self) -> list[tuple[str, tuple[str, str]]]:
        guides = []
        if self.guided_json is not None:
            schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            guides.append(("guided_json", ("json_schema", schema)))
        if self.guided_regex is not None:
            guides.append(("guided_regex", ("regex", self.guided_regex)))
        if self.guided_choice is not None:
            guides.append(("guided_choice", ("ebnf_grammar", choice_grammar(self.guided_choice))))
        if self.guided_grammar is not None:
            guides.append(("guided_grammar", ("ebnf_grammar", self.guided_grammar)))
        return guides

    @model_validator(mode="after")
    def _one_guide(self) -> _Request:
        self.guide()
        return self

    def wants_logprobs(self) -> bool:
        return self.top_logprobs_asked() is not None

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token the request asks for (None: no log-probabilities)."""
        return None

    def stop_sequences(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def ensemble_inputs(self, choice: int = 0) -> dict[str, Any]:
        """Ensemble inputs this request sets (None: the server's default) for its choice `choice` (a seeded
        request's choice i samples with seed + i). OpenAI samples whenever the temperature is above 0; the
        ensemble follows TensorRT-LLM (top_k and top_p both 0 or absent: greedy), so a sampled request sends its
        top_p explicitly (1.0: no nucleus)."""
        sampled = self.temperature != 0 and (self.temperature, self.top_p, self.top_k) != (None, None, None)
        top_p = (self.top_p or 1.0) if sampled else self.top_p
        return {
            "temperature": self.temperature, "top_p": top_p, "top_k": self.top_k, "min_p": self.min_p,
            "seed": None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1),
            "min_length": self.min_tokens,
            "num_draft_tokens": self.num_draft_tokens, "num_candidates": self.num_candidates,
            "acceptance": self.acceptance, "verify_threshold": self.verify_threshold, "task": self.task,
            "drafter": self.drafter, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "logit_bias_ids": [int(key) for key in self.logit_bias] if self.logit_bias else None,
            "logit_bias_values": list(self.logit_bias.values()) if self.logit_bias else None,
            **dict(zip(("guided_decoding_guide_type", "guided_decoding_guide"), self.guide() or (None, None),
                       strict=True)),
            "return_log_probs": True if self.wants_logprobs() else None,
            "num_top_log_probs": self.top_logprobs_asked() or None,
        }


class CompletionRequest(_Request):
    prompt: str | list[str]
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # alternatives per token
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError(f"this server takes one prompt per request, got {len(value)}")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None  # the schema is always enforced (strict or not)


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    def guide(self) -> tuple[str, str] | None:
        if self.type == "json_object":
            return "json_schema", '{"type": "object"}'
        if self.type == "json_schema":
            return "json_schema", json.dumps(self.json_schema.json_schema)
        return None


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _guides(self) -> list[tuple[str, tuple[str, str]]]:
        guides = super()._guides()
        if self.response_format is not None and (guide := self.response_format.guide()) is not None:
            guides.append(("response_format", guide))
        return guides

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        # "developer" is the newer name of "system"; chat templates know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
