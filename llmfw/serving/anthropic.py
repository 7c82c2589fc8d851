"""Anthropic's Messages API over the engine: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request is read as Anthropic defines it (``system``, ``messages`` of text / ``tool_use`` / ``tool_result`` /
``thinking`` blocks, ``tools`` with ``input_schema``, ``tool_choice`` auto / any / tool / none, ``max_tokens``,
``stop_sequences``, ``temperature`` / ``top_p`` / ``top_k``, ``metadata``, ``thinking``), turned into the chat
request the OpenAI endpoint runs (:func:`chat_request`), and planned and executed by the same code
(:func:`llmfw.serving.api.plan_chat`), so the prompt, grammars, tool-call parsing and the reasoning split are
one implementation. Only the answer's shape differs: :class:`MessagesShape` turns the chat deltas into content
blocks — a ``thinking`` block, a ``text`` block, ``tool_use`` blocks — whole, or streamed as Anthropic's events
(``message_start``, ``content_block_start`` / ``content_block_delta`` (``thinking_delta``, ``text_delta``,
``input_json_delta``) / ``content_block_stop``, ``message_delta`` with the stop reason and usage,
``message_stop``), as the tokens arrive.

``thinking: {"type": "enabled", "budget_tokens": N}`` sets the template's ``enable_thinking`` and the thinking
budget; ``{"type": "disabled"}`` clears ``enable_thinking``. Every error is Anthropic's shape
``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Literal, Union

from pydantic import Field

from ..core.errors import RequestError
from .api import ChatShape, ChoiceState, execute_chat, plan_chat
from .engine import Engine
from .http_common import BadBody, finite_json, on_model, read_json, response_for_error, sse_events
from .jobs import TokenEvent
from .protocol import GRAMMAR_SCHEMA, JSON_SCHEMA_SCHEMA, MODEL_SCHEMA, ChatCompletionRequest, _Body, described, \
    parse_request

#: Anthropic's error type per HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 501: "api_error", 503: "overloaded_error"}
#: OpenAI finish reason -> Anthropic stop reason
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# -- the request ---------------------------------------------------------------------------------------------------
class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str | None = None


Block = Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    """``enabled`` (with a budget), ``adaptive`` / ``between_tools`` (thinking on, the model decides how much),
    ``disabled``."""

    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """``effort`` reaches the template as ``reasoning_effort`` (gpt-oss); ``format`` constrains the reply to a
    JSON schema."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: what decides the prompt."""

    model: Any = described(MODEL_SCHEMA)
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # accepted (user_id); nothing in it changes the reply
    stream: bool = False
    output_config: OutputConfig | None = None
    # llama-server's extensions: constrain the raw output (thinking tags included)
    grammar: Any = described(GRAMMAR_SCHEMA)
    json_schema: Any = described(JSON_SCHEMA_SCHEMA)


def _chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation in OpenAI's chat shape: ``system`` first, each ``tool_result`` a ``tool`` message,
    each assistant ``tool_use`` a ``tool_calls`` entry (earlier thinking is dropped, as templates drop it)."""
    out: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "".join(b.text for b in request.system)
        out.append({"role": "system", "content": system})
    for message in request.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in message.content if isinstance(b, ToolUseBlock)]
        results = [b for b in message.content if isinstance(b, ToolResultBlock)]
        out += [{"role": "tool", "tool_call_id": b.tool_use_id,
                 "content": ("Error: " if b.is_error else "") + b.text()} for b in results]
        if text or calls or not results:
            out.append({"role": message.role, "content": text, **({"tool_calls": calls} if calls else {})})
    return out


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None or choice.type == "auto":
        return "auto"
    if choice.type == "any":
        return "required"
    if choice.type == "none":
        return "none"
    if not choice.name:
        raise RequestError('tool_choice of type "tool" needs a "name"', "tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request an Anthropic request amounts to (the reasoning split always on: thinking is a block)."""
    params: dict[str, Any] = {"messages": _chat_messages(request), "reasoning_format": "deepseek"}
    if request.tools:
        params["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}} for t in request.tools]
        params["parallel_tool_calls"] = not (request.tool_choice and request.tool_choice.disable_parallel_tool_use)
    if request.tools or request.tool_choice is not None:  # a forced choice without tools is an error
        params["tool_choice"] = _tool_choice(request.tool_choice)
    if request.thinking is not None:
        enabled = request.thinking.type != "disabled"
        params["chat_template_kwargs"] = {"enable_thinking": enabled}
        if enabled and request.thinking.budget_tokens is not None:
            params["reasoning_budget"] = request.thinking.budget_tokens
    if isinstance(request, MessagesRequest):
        params.update(max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature,
                      top_p=request.top_p, top_k=request.top_k, stream=request.stream, grammar=request.grammar,
                      json_schema=request.json_schema)
        output = request.output_config
        if output is not None and output.effort is not None:
            params["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(output.effort, output.effort)
        if output is not None and output.format is not None:
            if request.json_schema is not None:
                raise RequestError("give output_config.format or json_schema, not both", "output_config")
            params["json_schema"] = output.format.schema_
    chat: ChatCompletionRequest = parse_request(ChatCompletionRequest,
                                                {k: v for k, v in params.items() if v is not None})
    return chat


# -- the answer ----------------------------------------------------------------------------------------------------
class MessagesShape(ChatShape):
    """Anthropic's message and stream events, made from the chat deltas of the one choice."""

    def __init__(self, engine: Engine, request: ChatCompletionRequest, n_prompt: int, *args: Any):
        super().__init__(engine, request, 1, *args)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.n_prompt = n_prompt
        self._block: str | None = None  # the kind of the open content block
        self._n_blocks = 0
        self._tool_index = -1

    # -- streamed -----------------------------------------------------------------------------------------------
    def start_chunks(self, index: int) -> list[dict[str, Any]]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.engine.alias,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}}
        if self.warnings:  # e.g. tools offered to a template without tools (clients ignore unknown keys)
            message["warnings"] = self.warnings
        return [{"type": "message_start", "message": message}]

    def token_chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        return self._events(self._deltas(event.index, event.text))

    def finish_chunks(self, index: int, reason: str) -> list[dict[str, Any]]:
        deltas = self._deltas(index, "", last=True)
        if self.tool_streams:
            deltas += self.tool_streams[index].finish()
            reason = "tool_calls" if self.tool_streams[index].calls and reason == "stop" else reason
        events = self._events(deltas) + self._close_block()
        choice = self.choices[index] if self.choices else ChoiceState()
        stop_reason, stop_sequence = _stop(reason, choice)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return events + [{"type": "message_delta", "delta": delta, "usage": {"output_tokens": choice.n_generated}},
                         {"type": "message_stop"}]

    def _events(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            elif delta.get("content"):
                events += self._open("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                if call.get("id") and call["index"] != self._tool_index:
                    self._tool_index = call["index"]
                    events += self._open("tool_use", {"type": "tool_use", "id": _tool_id(call["id"]),
                                                      "name": call["function"]["name"], "input": {}}, new=True)
                fragment = call["function"].get("arguments")
                if fragment:
                    events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events

    def _open(self, kind: str, block: dict[str, Any], new: bool = False) -> list[dict[str, Any]]:
        if self._block == kind and not new:
            return []
        events = self._close_block()
        self._block = kind
        return events + [{"type": "content_block_start", "index": self._n_blocks, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._n_blocks, "delta": delta}

    def _close_block(self) -> list[dict[str, Any]]:
        if self._block is None:
            return []
        events = [{"type": "content_block_stop", "index": self._n_blocks}]
        self._block = None
        self._n_blocks += 1
        return events

    # -- whole ----------------------------------------------------------------------------------------------------
    def response(self, choices: list[ChoiceState], usage: dict[str, int]) -> dict[str, Any]:
        choice = choices[0]
        message, reason = self._message(choice)
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"],
                            "input": _arguments(call["function"]["arguments"])})
        stop_reason, stop_sequence = _stop(reason or "stop", choice)
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.engine.alias,
               "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
               "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}
        return {**out, "warnings": self.warnings} if self.warnings else out


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(reason: str, choice: ChoiceState) -> tuple[str, str | None]:
    if reason == "stop" and choice.stop_sequence is not None:
        return "stop_sequence", choice.stop_sequence
    return STOP_REASONS.get(reason, "end_turn"), None


# -- running --------------------------------------------------------------------------------------------------------
def run_messages(engine: Engine, params: dict[str, Any]) -> Any:
    """``/v1/messages``: a message dict, or an iterator of event dicts with ``stream: true``."""
    request: MessagesRequest = parse_request(MessagesRequest, params)
    chat = chat_request(request)
    plan = plan_chat(engine, chat)
    shape = MessagesShape(engine, chat, len(plan.tokens), plan.constraint.tool_format, plan.constraint.warnings,
                          plan.reasoning)
    return execute_chat(engine, plan, shape)


def count_tokens(engine: Engine, params: dict[str, Any]) -> dict[str, Any]:
    """``/v1/messages/count_tokens``: the tokens of the prompt the same request would decode."""
    request: CountTokensRequest = parse_request(CountTokensRequest, params)
    return {"input_tokens": len(plan_chat(engine, chat_request(request)).tokens)}


def sse_event(event: dict[str, Any]) -> str:
    """One Anthropic server-sent event: ``event: TYPE`` and its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def sse_error(exc: BaseException) -> str:
    """A failure after the stream started, as Anthropic's ``error`` event."""
    failed = response_for_error(exc)
    message = json.loads(failed.body)["error"]["message"]
    return sse_event(error_body(failed.status_code, message))


# -- HTTP ------------------------------------------------------------------------------------------------------------
def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def _anthropic_guarded(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Every failure of an Anthropic endpoint in Anthropic's error shape (status as the OpenAI side decides)."""
    import functools

    @functools.wraps(handler)
    async def run(request: Any) -> Any:
        try:
            return await handler(request)
        except BadBody as exc:
            return error_response(exc.status, exc.message)
        except Exception as exc:  # noqa: BLE001 - every failure answers in Anthropic's shape
            failed = response_for_error(exc)
            message = json.loads(failed.body)["error"]["message"]
            retry = {"Retry-After": failed.headers["retry-after"]} if "retry-after" in failed.headers else None
            return error_response(failed.status_code, message, retry)
    return run


@_anthropic_guarded
async def messages_endpoint(request: Any) -> Any:
    from starlette.responses import Response, StreamingResponse

    body = await read_json(request)
    result = await on_model(request, body, lambda engine: run_messages(engine, body))
    if isinstance(result, dict):
        return Response(finite_json(result), media_type="application/json")
    events = sse_events(result, sse_event, sse_error, done="")
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@_anthropic_guarded
async def count_tokens_endpoint(request: Any) -> Any:
    from starlette.responses import JSONResponse

    body = await read_json(request)
    return JSONResponse(await on_model(request, body, lambda engine: count_tokens(engine, body)))


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")
