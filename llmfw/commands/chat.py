"""`llmfw chat`: an interactive multi-turn conversation over stdin/stdout.

Each turn re-renders the whole conversation with the model's chat template and hands it to
:func:`llmfw.generate`, which finds the part already in the KV cache and decodes only the new turn.
Ctrl-C stops the current answer (the partial answer stays in the conversation); ``/exit``, ``/quit`` or
end of input (Ctrl-D) ends the session; ``/reset`` starts a new conversation.
"""
from __future__ import annotations

import sys
from typing import Any, TextIO

import click

from ..core.errors import LLMFWError
from .run import build_pipeline, describe_setup, load_model_with_progress, model_and_sampling_options

PROMPT = "> "
EXIT_COMMANDS = ("/exit", "/quit")


class ChatSession:
    """The conversation, its context (KV cache) and sampler; :meth:`answer` streams one reply."""

    def __init__(self, pipeline: Any, model: Any, out: TextIO):
        from ..core.generate import GenerationStats, context_int

        self.pipeline, self.model, self.out = pipeline, model, out
        self.ctx = pipeline.new_context(model)
        self.sampler = pipeline.make_sampler(model, context_int(self.ctx, "n_ctx"))
        self.messages: list[dict[str, str]] = []
        self.last_stats = GenerationStats()
        self.reset()

    def reset(self) -> None:
        """A new conversation (the KV cache is reused for whatever prefix the new one shares)."""
        system = self.pipeline.config.chat.system
        self.messages = [{"role": "system", "content": system}] if system else []
        self.sampler.reset()

    def answer(self, user_text: str) -> str:
        from ..core.generate import GenerationStats, generate

        self.last_stats = GenerationStats()
        self.messages.append({"role": "user", "content": user_text})
        gen, tok = self.pipeline.config.generation, self.pipeline.config.tokenizer
        pieces: list[str] = []
        try:
            prompt = self.pipeline.render_messages(self.messages, self.model)
            for piece in generate(self.ctx, prompt, self.sampler, max_tokens=gen.max_tokens, stop=gen.stop,
                                  parse_special=tok.parse_special, add_special=tok.add_special,
                                  stats=self.last_stats):
                pieces.append(piece)
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        except LLMFWError:
            self.messages.pop()  # the turn did not happen; the conversation stays usable
            raise
        self.out.write("\n")
        self.out.flush()
        reply = "".join(pieces)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def _read_line(out: TextIO) -> str | None:
    """One line of input, or None at end of input; Ctrl-C at the prompt just asks again."""
    while True:
        out.write(PROMPT)
        out.flush()
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if not line:
            return None
        return line.rstrip("\n")


@click.command("chat")
@model_and_sampling_options
def chat(**opts: Any) -> None:
    """Chat with a model: type a message, get an answer; /exit or Ctrl-D quits, Ctrl-C stops an answer."""
    pipeline = build_pipeline(opts, {"chat.enabled": True})
    model = load_model_with_progress(pipeline, not opts["no_progress"])
    out = sys.stdout
    session = ChatSession(pipeline, model, out)
    if opts["verbose"]:
        describe_setup(model, session.ctx, session.sampler, pipeline)
    click.echo("llmfw chat: /exit or Ctrl-D quits, Ctrl-C stops an answer, /reset starts over.", err=True)
    while True:
        line = _read_line(out)
        if line is None:
            out.write("\n")
            break
        text = line.strip()
        if text in EXIT_COMMANDS:
            break
        if text == "/reset":
            session.reset()
            continue
        if not text:
            continue
        try:
            session.answer(line)
        except LLMFWError as exc:
            click.echo(f"llmfw: error: {exc}", err=True)
            continue
        if opts["verbose"]:
            click.echo(session.last_stats.summary(), err=True)
