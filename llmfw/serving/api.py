"""The OpenAI-shaped front of the engine: request dict → jobs → response dict or chunk iterator.

:meth:`Engine.completion` and :meth:`Engine.chat_completion` call :func:`run_completion` /
:func:`run_chat_completion`; the HTTP server calls those two methods and nothing else. A non-streaming response
is assembled from exactly the events a stream would carry, so both always agree.

Usage counts: ``prompt_tokens`` is the prompt as decoded — for a chat, the conversation rendered with the
model's chat template and tokenized with ``add_special=True, parse_special=True`` (as ``llmfw run --chat``);
``completion_tokens`` counts every sampled token, the end-of-generation token included (llama-server's rule).
With ``n`` > 1 the prompt is counted once per prompt, completions per choice.
"""
from __future__ import annotations

import base64
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator

import numpy as np

from ..core.errors import ConfigError, ContextError, EngineStopped, LLMFWError, RequestError
from ..core.generation.generate import tokenize_prompt
from ..core.generation.sampling import Sampler, SamplerChain
from .tool_calls import ToolCallFormat, parse_tool_calls, tool_call_stream
from .chat_options import chat_template_of, render_chat_prompt
from .constraints import Constraint, request_constraint
from .jobs import Cancel, ErrorEvent, Event, FinishEvent, Job, ServedEngine, TokenEvent
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, GenerationFields, parse_request
from .reasoning import ReasoningSetup, reasoning_setup, split_reasoning

#: how often a waiting consumer checks that the engine is still alive, seconds
POLL_S = 1.0


# -- tokenizing within bounds ---------------------------------------------------------------------------------
def tokenize_request_text(engine: ServedEngine, text: str, param: str) -> list[int]:
    """Tokenize (``add_special``, ``parse_special``) a prompt, refusing at once text that cannot fit a slot."""
    check_text_fits(engine, text, param)
    return tokenize_prompt(engine.model, text, parse_special=True, add_special=True)


def check_text_fits(engine: ServedEngine, text: str, param: str) -> None:
    """More bytes than a slot's tokens times the longest token piece can never tokenize into the slot: refused
    before the tokenizer spends time on it."""
    if len(text.encode("utf-8", errors="replace")) > engine.n_ctx_slot * engine.max_piece_bytes:
        raise RequestError(f"the {param} is far longer than the context of a slot ({engine.n_ctx_slot} tokens); "
                           "shorten it", param)


def token_ids(engine: ServedEngine, ids: list[int]) -> list[int]:
    try:
        return tokenize_prompt(engine.model, ids)
    except ContextError as exc:
        raise RequestError(str(exc), "prompt") from None


# -- accumulating a choice ---------------------------------------------------------------------------------------
@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None
    n_generated: int = 0
    stop_sequence: str | None = None  # the stop string that ended it (None: end of generation, length)


def _piece(engine: ServedEngine, token: int) -> bytes:
    return engine.model.vocab.token_to_piece(token, special=True)


class ResponseShape:
    """What one endpoint's responses look like (ids, objects, where the text and logprobs go)."""

    object_name = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, engine: ServedEngine, request: GenerationFields, n_choices: int):
        self.engine = engine
        self.request = request
        self.n_choices = n_choices
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        #: the choices' progress, set by the run that uses this shape
        self.choices: list[ChoiceState] = []
        #: the reply's text must show control tokens (markers the parsers look for)
        self.renders_special = False

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.engine.alias,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        out = self._envelope(self.chunk_object, choices)
        if self.request.include_usage:
            out["usage"] = usage
        return out

    # per endpoint
    def start_chunks(self, index: int) -> list[dict[str, Any]]:
        return []

    def token_chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish_chunks(self, index: int, reason: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def response(self, choices: list[ChoiceState], usage: dict[str, int]) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, engine: ServedEngine, request: CompletionRequest, n_choices: int, echo_texts: list[str]):
        super().__init__(engine, request, n_choices)
        self.echo_texts = echo_texts  # per choice ("" without echo)

    def _logprobs(self, events: list[TokenEvent], offset: int) -> dict[str, Any] | None:
        if self.request.logprobs is None:  # type: ignore[attr-defined]
            return None
        tokens, offsets = [], []
        for e in events:
            offsets.append(offset)
            text = _piece(self.engine, e.token).decode("utf-8", errors="replace")  # type: ignore[arg-type]
            tokens.append(text)
            offset += len(e.text)
        top = [{_piece(self.engine, t).decode("utf-8", errors="replace"): lp for t, lp in e.top} for e in events]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in events], "top_logprobs": top,
                "text_offset": offsets}

    def _choice(self, index: int, text: str, logprobs: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def start_chunks(self, index: int) -> list[dict[str, Any]]:
        echo = self.echo_texts[index]
        return [self.chunk([self._choice(index, echo, None, None)])] if echo else []

    def token_chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        with_lp = event.token is not None and self.request.logprobs is not None  # type: ignore[attr-defined]
        if not event.text and not with_lp:
            return []
        logprobs = self._logprobs([event], 0) if with_lp else None
        return [self.chunk([self._choice(event.index, event.text, logprobs, None)])]

    def finish_chunks(self, index: int, reason: str) -> list[dict[str, Any]]:
        return [self.chunk([self._choice(index, "", None, reason)])]

    def response(self, choices: list[ChoiceState], usage: dict[str, int]) -> dict[str, Any]:
        out = self._envelope(self.object_name, [
            self._choice(i, self.echo_texts[i] + "".join(c.text),
                         self._logprobs(c.logprobs, len(self.echo_texts[i])), c.finish_reason)
            for i, c in enumerate(choices)])
        out["usage"] = usage
        return out


class ChatShape(ResponseShape):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, engine: ServedEngine, request: ChatCompletionRequest, n_choices: int,
                 tool_format: ToolCallFormat | None = None, warnings: list[str] | None = None,
                 reasoning: ReasoningSetup | None = None):
        super().__init__(engine, request, n_choices)
        self.tool_format = tool_format
        self.reasoning = reasoning
        #: per choice, the splitter of thinking from answer (none with --reasoning-format none)
        self.splitters = [reasoning.splitter() for _ in range(n_choices)] if reasoning else [None] * n_choices
        # markers that may be control tokens (DeepSeek's, Mistral's, Harmony's): the parsers must see them, as
        # llama-server keeps a format's "preserved tokens"
        self.renders_special = bool(tool_format and tool_format not in (ToolCallFormat.HERMES,
                                                                        ToolCallFormat.LLAMA3_JSON)) \
            or bool(reasoning and reasoning.tags.special)
        #: sent as a top-level "warnings" list in the response and the first chunk (clients ignore unknown keys)
        self.warnings = list(warnings or [])
        #: per choice, the parser turning a streamed reply into content and tool-call deltas
        self.tool_streams = [tool_call_stream(tool_format) for _ in range(n_choices)] if tool_format else []

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece = _piece(self.engine, token)
        return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece)}

    def _logprobs(self, events: list[TokenEvent]) -> dict[str, Any] | None:
        if not self.request.logprobs:  # type: ignore[attr-defined]
            return None
        content = [{**self._entry(e.token, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]}
                   for e in events if e.token is not None and e.logprob is not None]
        return {"content": content, "refusal": None}

    def _choice(self, index: int, delta: dict[str, Any], logprobs: Any, reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def start_chunks(self, index: int) -> list[dict[str, Any]]:
        first = self.chunk([self._choice(index, {"role": "assistant", "content": ""}, None, None)])
        return [{**first, "warnings": self.warnings} if self.warnings and index == 0 else first]

    def token_chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        with_lp = event.token is not None and bool(self.request.logprobs)  # type: ignore[attr-defined]
        logprobs = self._logprobs([event]) if with_lp else None
        deltas = self._deltas(event.index, event.text)
        if not deltas and logprobs is not None:
            deltas = [{"content": ""}]  # the token's logprobs still go out, with the text it held back
        # the logprobs ride on the first delta of their token
        return [self.chunk([self._choice(event.index, d, logprobs if k == 0 else None, None)])
                for k, d in enumerate(deltas)]

    def _content_deltas(self, index: int, text: str) -> list[dict[str, Any]]:
        if self.tool_streams:
            deltas: list[dict[str, Any]] = self.tool_streams[index].feed(text)
            return deltas
        return [{"content": text}] if text else []

    def _deltas(self, index: int, text: str, last: bool = False) -> list[dict[str, Any]]:
        """The deltas of a piece of reply text: thinking as ``reasoning_content``, the rest as content or
        tool-call pieces (``last``: the reply ended, flush what the splitter held back)."""
        splitter = self.splitters[index]
        if splitter is None:
            return self._content_deltas(index, text)
        deltas: list[dict[str, Any]] = []
        for kind, piece in splitter.feed(text) + (splitter.finish() if last else []):
            deltas += [{"reasoning_content": piece}] if kind == "reasoning" else self._content_deltas(index, piece)
        return deltas

    def finish_chunks(self, index: int, reason: str) -> list[dict[str, Any]]:
        chunks = [self.chunk([self._choice(index, d, None, None)]) for d in self._deltas(index, "", last=True)]
        if self.tool_streams:
            stream = self.tool_streams[index]
            chunks += [self.chunk([self._choice(index, d, None, None)]) for d in stream.finish()]
            reason = "tool_calls" if stream.calls and reason == "stop" else reason  # cut short: "length"
        return chunks + [self.chunk([self._choice(index, {}, None, reason)])]

    def _message(self, choice: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole reply and its finish reason (``tool_calls`` when it made calls)."""
        text, reasoning = "".join(choice.text), None
        if self.reasoning is not None and self.reasoning.split:
            reasoning, text = split_reasoning(text, self.reasoning.tags, self.reasoning.inside)
        thought = {"reasoning_content": reasoning} if reasoning is not None else {}
        content, calls = parse_tool_calls(text, self.tool_format)
        if not calls:
            return {"role": "assistant", "content": content, **thought}, choice.finish_reason
        reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason  # cut short: "length"
        return ({"role": "assistant", "content": content or None, **thought,
                 "tool_calls": [c.to_openai() for c in calls]}, reason)

    def response(self, choices: list[ChoiceState], usage: dict[str, int]) -> dict[str, Any]:
        out_choices = []
        for i, c in enumerate(choices):
            message, reason = self._message(c)
            out_choices.append({"index": i, "message": message, "logprobs": self._logprobs(c.logprobs),
                                "finish_reason": reason})
        out = self._envelope(self.object_name, out_choices)
        out["usage"] = usage
        if self.warnings:
            out["warnings"] = self.warnings
        return out


# -- running a request -----------------------------------------------------------------------------------------------
class ChunkStream:
    """The chunks of a streaming request, as an iterator; :meth:`close` (or dropping out of a ``for`` loop
    and closing) cancels the generation, which frees its slots at the engine's next step."""

    def __init__(self, run: "RequestRun"):
        self._run = run
        self._chunks = self._generate()

    def __iter__(self) -> "ChunkStream":
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._chunks)

    def close(self) -> None:
        """Cancel the generation; safe from any thread, also while another thread waits in ``next``."""
        self._run.cancel_now()
        try:
            self._chunks.close()
        except ValueError:
            pass  # another thread is inside next(): it wakes on the engine's cancellation event and ends

    def _generate(self) -> Generator[dict[str, Any], None, None]:
        run, shape = self._run, self._run.shape
        try:
            for i in range(shape.n_choices):
                yield from shape.start_chunks(i)
            for event in run.events():
                if isinstance(event, TokenEvent):
                    yield from shape.token_chunks(event)
                else:
                    yield from shape.finish_chunks(event.index, event.reason)
            if shape.request.include_usage:
                yield {**shape.chunk([], run.usage())}
        finally:
            run.cancel_now()


class RequestRun:
    """The jobs of one request and the event queue they share."""

    def __init__(self, engine: ServedEngine, shape: ResponseShape, prompts: list[list[int]], limits: list[int],
                 n_logprobs: int | None, constraint: Constraint,
                 more_samplers: Callable[[], list[Sampler]] | None = None):
        self.engine, self.shape = engine, shape
        self.cancel = Cancel()
        self.queue: "queue.Queue[Event]" = queue.Queue()
        self.n_prompt = sum(len(p) for p in prompts)
        request = shape.request
        self.jobs = []
        for p, (tokens, limit) in enumerate(zip(prompts, limits)):
            for i in range(request.n):
                index = p * request.n + i
                chain = SamplerChain.from_params(request.sampler_params(engine.model.n_vocab, index),
                                                 model=engine.model, n_ctx=engine.n_ctx_slot)
                # the grammar first (it sees the raw output, thinking tags included), then e.g. the thinking budget
                chain.samplers[:0] = [*constraint.samplers(engine.model, engine.n_ctx_slot),
                                      *(more_samplers() if more_samplers else [])]
                self.jobs.append(Job(index, tokens, chain, limit, list(request.stop or []), n_logprobs,
                                     self.queue, self.cancel, special=shape.renders_special))
        self.choices = [ChoiceState() for _ in self.jobs]
        shape.choices = self.choices  # a shape may report what a finished choice did (its stop string)

    def start(self) -> None:
        self.engine.submit(self.jobs)

    def cancel_now(self) -> None:
        if not self.cancel.is_set and any(c.finish_reason is None for c in self.choices):
            self.cancel.set()
            self.engine.wake()

    def _next_event(self) -> Event:
        while True:
            try:
                return self.queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self.engine.running:
                    raise EngineStopped("the server is shutting down") from None

    def events(self) -> Iterator[TokenEvent | FinishEvent]:
        """Token and finish events until every choice finished; an error event raises."""
        n_open = len(self.jobs)
        while n_open:
            event = self._next_event()
            if isinstance(event, ErrorEvent):
                if event.stopped:
                    raise EngineStopped(event.message)
                raise LLMFWError(event.message)
            choice = self.choices[event.index]
            if isinstance(event, TokenEvent):
                choice.text.append(event.text)
                if event.token is not None:
                    choice.logprobs.append(event)
            else:
                choice.finish_reason, choice.n_generated = event.reason, event.n_generated
                choice.stop_sequence = event.stop_sequence
                n_open -= 1
            yield event

    def usage(self) -> dict[str, int]:
        completion = sum(c.n_generated for c in self.choices)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": completion,
                "total_tokens": self.n_prompt + completion}

    def result(self) -> dict[str, Any]:
        try:
            for _ in self.events():
                pass
        finally:
            self.cancel_now()
        return self.shape.response(self.choices, self.usage())


def _execute(engine: ServedEngine, shape: ResponseShape, prompts: list[list[int]], n_logprobs: int | None,
             constraint: Constraint, more_samplers: Callable[[], list[Sampler]] | None = None) -> Any:
    request = shape.request
    param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    limits = [engine.check_fits(len(p), request.token_limit(), param) for p in prompts]
    run = RequestRun(engine, shape, prompts, limits, n_logprobs, constraint, more_samplers)
    run.start()
    return ChunkStream(run) if request.stream else run.result()


def run_completion(engine: ServedEngine, params: dict[str, Any]) -> Any:
    request: CompletionRequest = parse_request(CompletionRequest, params)
    if request.echo and request.logprobs is not None:
        raise RequestError("echo together with logprobs (prompt logprobs) is not supported", "echo")
    constraint = request_constraint(request, engine.model)
    prompts, echo_texts = [], []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            prompts.append(tokenize_request_text(engine, prompt, "prompt"))
            echo_texts += [prompt] * request.n
        else:
            prompts.append(token_ids(engine, prompt))
            echo_texts += [engine.model.vocab.detokenize(prompts[-1])] * request.n
    if not request.echo:
        echo_texts = [""] * len(echo_texts)
    return _execute(engine, CompletionShape(engine, request, len(echo_texts), echo_texts), prompts,
                    request.logprobs, constraint)


@dataclass
class ChatPlan:
    """A chat request made ready to run: its prompt tokens, constraint and reasoning handling."""

    request: ChatCompletionRequest
    tokens: list[int]
    constraint: Constraint
    reasoning: ReasoningSetup


def plan_chat(engine: ServedEngine, request: ChatCompletionRequest) -> ChatPlan:
    """Render, tokenize and check a chat request (shared by every API with a chat endpoint)."""
    template, template_name = chat_template_of(engine)
    constraint = request_constraint(request, engine.model, template, chat=True, template_name=template_name)
    text = render_chat_prompt(engine, request.template_messages(), request.tools, request.template_kwargs())
    tokens = tokenize_request_text(engine, text, "messages")
    options = engine.chat_options
    reasoning = reasoning_setup(template, text, request.reasoning_format or options.reasoning_format,
                                options.reasoning_budget if request.reasoning_budget is None
                                else request.reasoning_budget)
    return ChatPlan(request, tokens, constraint, reasoning)


def execute_chat(engine: ServedEngine, plan: ChatPlan, shape: ResponseShape) -> Any:
    """Run a planned chat with ``shape`` making its responses (a dict, or a chunk iterator when streaming)."""
    return _execute(engine, shape, [plan.tokens], plan.request.n_top_logprobs(), plan.constraint,
                    lambda: plan.reasoning.budget_sampler(engine.model.vocab))


def run_chat_completion(engine: ServedEngine, params: dict[str, Any]) -> Any:
    request: ChatCompletionRequest = parse_request(ChatCompletionRequest, params)
    plan = plan_chat(engine, request)
    shape = ChatShape(engine, request, request.n, plan.constraint.tool_format, plan.constraint.warnings,
                      plan.reasoning)
    return execute_chat(engine, plan, shape)


# -- embeddings ------------------------------------------------------------------------------------------------------
def run_embeddings(engine: ServedEngine, params: dict[str, Any]) -> dict[str, Any]:
    """``/v1/embeddings``: every input tokenized like a prompt, embedded on the engine thread, pooled per
    ``pooling`` (default: the GGUF's ``pooling_type``, mean when it says none), L2-normalized like llama-server."""
    from ..core.runtime.embedding import embed_texts, model_pooling

    request: EmbeddingRequest = parse_request(EmbeddingRequest, params)
    inputs = request.inputs()  # tokenized by embed_texts exactly as model.embed tokenizes them
    for item in inputs:
        if isinstance(item, str):
            check_text_fits(engine, item, "input")
    pooling = request.pooling or (model_pooling(engine.model) if model_pooling(engine.model) != "none" else "mean")
    try:
        result = engine.call_in_engine(lambda: embed_texts(engine.model, inputs, pooling=pooling))
    except (ContextError, ConfigError) as exc:
        raise RequestError(str(exc), "input") from None
    data = [{"object": "embedding", "index": i, "embedding": _encoded(vector, request.encoding_format)}
            for i, vector in enumerate(result.vectors)]
    usage = {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}
    return {"object": "list", "data": data, "model": engine.alias, "usage": usage}


def _encoded(vector: Any, encoding: str) -> Any:
    """A vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""

    values = np.asarray(vector, dtype="<f4")
    return base64.b64encode(values.tobytes()).decode("ascii") if encoding == "base64" else values.tolist()
