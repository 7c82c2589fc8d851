"""The OpenAI request bodies (pydantic) and how they map onto llmfw's sampling parameters.

Field names, types and meanings follow OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, with the
llama-server additions ``top_k``, ``min_p`` and ``repeat_penalty``. Unknown fields are ignored, as OpenAI does;
a field that llmfw knows but does not implement yet is refused by :mod:`llmfw.serving.constraints` rather than
ignored. Sampling defaults are llama.cpp's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05).
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..core.errors import RequestError, SamplerError
from ..core.generation.sampling import DEFAULT_SEED, SamplerParams, validation_problems

#: most choices one request may ask for (``n``)
MAX_CHOICES = 16
#: most alternatives per token (``logprobs`` / ``top_logprobs``), OpenAI's limit
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def described(schema: dict[str, Any], default: Any = None) -> Any:
    """A field checked by its own code (not pydantic), published in ``/openapi.json`` with the shape ``schema``
    (so fuzzers and client generators build meaningful values; a value outside it is still refused by that
    code with a 400 naming the field)."""
    return Field(default, json_schema_extra=schema)


_NULLABLE_OBJECT: dict[str, Any] = {"anyOf": [{"type": "object"}, {"type": "null"}]}
_FUNCTION_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
        "parameters": {"type": "object"}}}}}
#: OpenAI's response_format: text, json_object (llama-server: with an optional schema), json_schema
RESPONSE_FORMAT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"},
                                                            "schema": {"type": "object"}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
    {"type": "null"}]}
GRAMMAR_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string", "description": "GBNF (llama.cpp's grammar format)",
                                             "examples": ['root ::= "yes" | "no"']}, {"type": "null"}]}
JSON_SCHEMA_SCHEMA: dict[str, Any] = {**_NULLABLE_OBJECT, "description": "a JSON schema the output must match"}
TOOLS_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "array", "items": _FUNCTION_TOOL}, {"type": "null"}]}
TOOL_CHOICE_SCHEMA: dict[str, Any] = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    {"type": "null"}]}
MODEL_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "null"}],
                                "description": "accepted whatever its value: the server's one model answers"}


class StreamOptions(_Body):
    include_usage: bool = False


class GenerationFields(_Body):
    """The fields both endpoints share."""

    model: Any = described(MODEL_SCHEMA)  # accepted whatever its value (llama-server's rule)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repeat_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # constrained decoding: handed to llmfw.serving.constraints, never ignored
    response_format: Any = described(RESPONSE_FORMAT_SCHEMA)
    grammar: Any = described(GRAMMAR_SCHEMA)
    json_schema: Any = described(JSON_SCHEMA_SCHEMA)
    tools: Any = described(TOOLS_SCHEMA)
    tool_choice: Any = described(TOOL_CHOICE_SCHEMA)

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(stops)}")
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def sampler_params(self, n_vocab: int, choice: int = 0) -> SamplerParams:
        """llama.cpp's sampling parameters for this request; choice ``i`` of ``n`` uses ``seed + i``."""
        fields: dict[str, Any] = {}
        for ours, theirs in (("temp", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                             ("penalty_present", "presence_penalty"), ("penalty_freq", "frequency_penalty"),
                             ("penalty_repeat", "repeat_penalty")):
            value = getattr(self, theirs)
            if value is not None:
                fields[ours] = value
        fields["seed"] = DEFAULT_SEED if self.seed is None else (self.seed + choice) & 0xFFFFFFFF
        fields["logit_bias"] = self._token_biases(n_vocab)
        if fields.get("temp", 1.0) <= 0.0:
            # greedy: the truncation samplers always keep the best token, so only the ones that change
            # logits matter (same token, without sorting the vocabulary for every request at every step)
            fields["samplers"] = ["penalties"] if self._penalized() else []
        try:
            return SamplerParams(**fields)
        except SamplerError as exc:
            raise RequestError(str(exc)) from None

    def _penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or (self.repeat_penalty is not None and self.repeat_penalty != 1.0))

    def _token_biases(self, n_vocab: int) -> dict[int, float]:
        biases: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not 0 <= token < n_vocab:
                raise RequestError(f"logit_bias token {token} is outside the vocabulary (0..{n_vocab - 1})",
                                   "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
            biases[token] = bias
        return biases


PromptType = Union[str, list[str], list[int], list[list[int]]]


def _unsupported(value: object, what: str) -> None:
    """A validator's answer for a field llmfw does not implement: given at all, it is an error (else the field
    stays None)."""
    if value is not None:
        raise ValueError(f"{what} is not supported")


class CompletionRequest(GenerationFields):
    """``POST /v1/completions``. The OpenAI default for ``max_tokens`` is 16."""

    prompt: PromptType
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        _unsupported(value or None, "suffix (insertion)")

    def prompts(self) -> list[str | list[int]]:
        """One prompt per entry: a string, a list of strings, token ids, or a list of token-id lists."""
        return prompt_entries(self.prompt, "prompt")


def prompt_entries(value: Any, param: str, limit: int | None = None) -> list[str | list[int]]:
    """A ``prompt`` / ``input`` field as one entry per text: a string, strings, token ids, or lists of them."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise RequestError(f"{param} is empty", param)
    entries: list[str | list[int]] = [list(value)] if all(isinstance(v, int) for v in value) else list(value)
    if limit is not None and len(entries) > limit:
        raise RequestError(f"{param} has {len(entries)} entries; at most {limit} per request", param)
    return entries


#: most inputs one ``/v1/embeddings`` request may carry (OpenAI's limit)
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``. ``pooling`` (llama-server's extension) overrides the model's pooling; a model
    whose GGUF says none is pooled by mean, since the endpoint returns one vector per input."""

    input: PromptType
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "cls", "last"] | None = None
    dimensions: int | None = None

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, value: int | None) -> None:
        _unsupported(value, "dimensions (shortened embeddings)")

    def inputs(self) -> list[str | list[int]]:
        """One entry per text: a string, a list of strings, token ids, or a list of token-id lists."""
        return prompt_entries(self.input, "input", MAX_EMBEDDING_INPUTS)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' shape); ``developer`` is OpenAI's new name for
        ``system``. A call's ``arguments`` string becomes the object it encodes, as templates such as Qwen's
        write ``arguments | tojson`` (llama.cpp does the same)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    parallel_tool_calls: bool = False  # llama-server's default: one call per reply
    #: variables for this request's template render (over the server's --chat-template-kwargs)
    chat_template_kwargs: dict[str, Any] | None = None
    #: thinking: split into reasoning_content ("deepseek") or left in the content ("none"); None: the server's
    reasoning_format: Literal["deepseek", "none"] | None = None
    #: most thinking tokens before the closing tag is forced (-1: no limit); None: the server's
    reasoning_budget: int | None = Field(None, ge=-1)
    #: gpt-oss: handed to the chat template as ``reasoning_effort``
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The request's own template variables (``chat_template_kwargs``, ``reasoning_effort``)."""
        extra = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            extra.setdefault("reasoning_effort", self.reasoning_effort)
        return extra

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def n_top_logprobs(self) -> int | None:
        """None = no logprobs; else how many alternatives per token."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it."""
        return [m.template_message() for m in self.messages]


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # not JSON: the template gets the text as it came


def parse_request(model: type[_Body], params: dict[str, Any]) -> Any:
    """Validate a request body; every problem becomes one :class:`RequestError` naming the first field."""
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        problems = validation_problems(exc)
        param = problems[0][0].split(".")[0] if problems else None
        raise RequestError("invalid request: " + "; ".join(f"{k}: {m}" for k, m in problems), param) from None


# -- llama-server's tokenizer endpoints ----------------------------------------------------------------------
class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Any = None  # which model's vocabulary, when the server serves several
    content: str
    add_special: bool = False
    parse_special: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Any = None  # which model's vocabulary, when the server serves several
    tokens: list[int] = Field(max_length=1 << 20)
