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
from typing import Any, Generator, Iterator

import numpy as np

from ..core.tokenizer.chat import CHATML_TEMPLATE, apply_chat_template, model_chat_template
from ..core.errors import ConfigError, ContextError, EngineStopped, LLMFWError, RequestError
from ..core.generation.generate import tokenize_prompt
from ..core.generation.sampling import SamplerChain
from .tool_calls import ToolCallFormat, ToolCallStream, parse_tool_calls
from .constraints import Constraint, request_constraint
from .jobs import Cancel, ErrorEvent, Event, FinishEvent, Job, ServedEngine, TokenEvent
from .protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, GenerationFields, parse_request

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
                 tool_format: ToolCallFormat | None = None):
        super().__init__(engine, request, n_choices)
        self.tool_format = tool_format
        #: per choice, the parser turning a streamed reply into content and tool-call deltas
        self.tool_streams = [ToolCallStream(tool_format) for _ in range(n_choices)] if tool_format else []

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
        return [self.chunk([self._choice(index, {"role": "assistant", "content": ""}, None, None)])]

    def token_chunks(self, event: TokenEvent) -> list[dict[str, Any]]:
        with_lp = event.token is not None and bool(self.request.logprobs)  # type: ignore[attr-defined]
        logprobs = self._logprobs([event]) if with_lp else None
        deltas = self.tool_streams[event.index].feed(event.text) if self.tool_streams else \
            [{"content": event.text}] if event.text else []
        if not deltas and logprobs is not None:
            deltas = [{"content": ""}]  # the token's logprobs still go out, with the text it held back
        # the logprobs ride on the first delta of their token
        return [self.chunk([self._choice(event.index, d, logprobs if k == 0 else None, None)])
                for k, d in enumerate(deltas)]

    def finish_chunks(self, index: int, reason: str) -> list[dict[str, Any]]:
        chunks = []
        if self.tool_streams:
            stream = self.tool_streams[index]
            chunks = [self.chunk([self._choice(index, d, None, None)]) for d in stream.finish()]
            reason = "tool_calls" if stream.calls and reason == "stop" else reason  # cut short: "length"
        return chunks + [self.chunk([self._choice(index, {}, None, reason)])]

    def _message(self, choice: ChoiceState) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole reply and its finish reason (``tool_calls`` when it made calls)."""
        content, calls = parse_tool_calls("".join(choice.text), self.tool_format)
        if not calls:
            return {"role": "assistant", "content": content}, choice.finish_reason
        reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason  # cut short: "length"
        return ({"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]},
                reason)

    def response(self, choices: list[ChoiceState], usage: dict[str, int]) -> dict[str, Any]:
        out_choices = []
        for i, c in enumerate(choices):
            message, reason = self._message(c)
            out_choices.append({"index": i, "message": message, "logprobs": self._logprobs(c.logprobs),
                                "finish_reason": reason})
        out = self._envelope(self.object_name, out_choices)
        out["usage"] = usage
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
                 n_logprobs: int | None, constraint: Constraint):
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
                chain.samplers[:0] = constraint.samplers(engine.model, engine.n_ctx_slot)
                self.jobs.append(Job(index, tokens, chain, limit, list(request.stop or []), n_logprobs,
                                     self.queue, self.cancel))
        self.choices = [ChoiceState() for _ in self.jobs]

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
             constraint: Constraint) -> Any:
    request = shape.request
    limits = [engine.check_fits(len(p), request.token_limit()) for p in prompts]
    run = RequestRun(engine, shape, prompts, limits, n_logprobs, constraint)
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


def run_chat_completion(engine: ServedEngine, params: dict[str, Any]) -> Any:
    request: ChatCompletionRequest = parse_request(ChatCompletionRequest, params)
    template = engine.chat_template or model_chat_template(engine.model) or CHATML_TEMPLATE
    constraint = request_constraint(request, engine.model, template, chat=True)
    extra = {"tools": request.tools} if request.tools else {}  # tools reach the template as transformers passes them
    text = apply_chat_template(engine.model, request.template_messages(), template=template, **extra)
    tokens = tokenize_request_text(engine, text, "messages")
    return _execute(engine, ChatShape(engine, request, request.n, constraint.tool_format), [tokens],
                    request.n_top_logprobs(), constraint)


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
