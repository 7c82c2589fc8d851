"""`llmfw chat`: an interactive multi-turn conversation, like llama-cli's conversation mode or ollama's REPL.

Each turn re-renders the whole conversation with the model's chat template and hands it to
:func:`llmfw.generate`, which finds the part already in the KV cache and decodes only the new turn.

Sampling is on by default with llama.cpp's defaults (temp 0.8, top-k 40, top-p 0.95, min-p 0.05, a random
seed): a small model answering greedily loops. ``--temp 0`` makes it greedy. On a terminal, input goes through
``readline`` (arrow keys edit the line, Up/Down walk this session's history). Commands: ``/help``, ``/reset``
(a new conversation, confirmed), ``/exit`` or ``/quit`` (or Ctrl-D). Ctrl-C stops the current answer (the
partial answer stays in the conversation); at the prompt, Ctrl-C twice in a row quits.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, TextIO

import click

from ..core.errors import LLMFWError
from .run import (build_pipeline, describe_setup, draw_random_seed, load_model_with_progress,
                  model_and_sampling_options)

PROMPT = "> "
EXIT_COMMANDS = ("/exit", "/quit")
#: command -> what /help says about it
COMMANDS_HELP = {
    "/help": "show this list",
    "/reset": "forget the conversation and start a new one (the system prompt stays)",
    "/exit, /quit": "end the session (or Ctrl-D)",
}
CTRL_C_AGAIN = "(Ctrl-C again to quit, or /exit)"
#: what a second Ctrl-C in a row at the prompt exits with (like llama-cli: the status of a SIGINT)
EXIT_INTERRUPTED = 130


class ChatSession:
    """The conversation, its context (KV cache) and sampler; :meth:`answer` streams one reply."""

    def __init__(self, pipeline: Any, model: Any, out: TextIO):
        from ..core.generation.generate import GenerationStats

        self.pipeline, self.model, self.out = pipeline, model, out
        self.ctx = pipeline.new_context(model)
        self.sampler = pipeline.make_sampler(model, self.ctx.n_ctx)
        self.messages: list[dict[str, str]] = []
        self.last_stats = GenerationStats()
        self.reset()

    def reset(self) -> None:
        """A new conversation (the KV cache is reused for whatever prefix the new one shares)."""
        system = self.pipeline.config.chat.system
        self.messages = [{"role": "system", "content": system}] if system else []
        self.sampler.reset()

    def answer(self, user_text: str) -> str:
        from ..core.generation.generate import GenerationStats, generate

        self.last_stats = GenerationStats()
        self.messages.append({"role": "user", "content": user_text})
        gen, tok = self.pipeline.config.generation, self.pipeline.config.tokenizer
        pieces: list[str] = []
        try:
            prompt = self.pipeline.render_messages(self.messages, self.model)
            for piece in generate(self.ctx, prompt, self.sampler, max_tokens=gen.max_tokens, stop=gen.stop,
                                  parse_special=tok.parse_special, add_special=tok.add_special,
                                  stats=self.last_stats, special=tok.special):
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


def enable_line_editing() -> None:
    """``input()`` on a terminal goes through readline: the arrow keys edit the line and walk the history
    (Up does not print ``^[[A``). The history lives only as long as the session."""
    if not sys.stdin.isatty():
        return
    try:
        import readline  # noqa: F401 - importing it is what turns line editing on for input()
    except ImportError:  # a Python built without readline (Windows): plain input still works
        return


class LineReader:
    """Reads the user's lines: ``None`` at end of input or after Ctrl-C twice in a row at the prompt."""

    def __init__(self, out: TextIO, read: Callable[[str], str] = input):
        self.out, self.read = out, read
        self.interrupted = False  # True when the session ended by Ctrl-C twice

    def __call__(self) -> str | None:
        pressed_ctrl_c = False
        while True:
            try:
                return self.read(PROMPT)
            except EOFError:
                self.out.write("\n")  # Ctrl-D leaves the cursor after the prompt: end the line for the shell
                return None
            except KeyboardInterrupt:
                if pressed_ctrl_c:
                    self.out.write("\n")
                    self.interrupted = True
                    return None
                pressed_ctrl_c = True
                self.out.write(f"\n{CTRL_C_AGAIN}\n")
            finally:
                self.out.flush()


def help_text() -> str:
    width = max(len(name) for name in COMMANDS_HELP)
    lines = [f"  {name:{width}}  {what}" for name, what in COMMANDS_HELP.items()]
    lines.append(f"  {'Ctrl-C':{width}}  stop the current answer; twice at the prompt quits")
    return "commands:\n" + "\n".join(lines)


def run_command(text: str, session: ChatSession, out: TextIO) -> bool:
    """Handle a ``/command`` line; False when it is not one (the line goes to the model)."""
    if text == "/help":
        out.write(help_text() + "\n")
    elif text == "/reset":
        n_turns = sum(1 for m in session.messages if m["role"] == "user")
        session.reset()
        out.write(f"(conversation reset: {n_turns} turn{'s' if n_turns != 1 else ''} forgotten)\n")
    elif text.startswith("/") and " " not in text:  # a one-word /typo; "/etc is a folder?" goes to the model
        out.write(f"unknown command {text}; /help lists the commands\n")
    else:
        return False
    out.flush()
    return True


def warn_without_chat_template(pipeline: Any, model: Any) -> None:
    """A model whose file has no chat template (most often a base model) is chatted with through ChatML, which
    it was not trained on: say so, and point to `run`, which continues a text."""
    if pipeline.chat_template() is not None or model.metadata.get("tokenizer.chat_template"):
        return
    name = Path(str(model.path)).name
    click.echo(f"warning: {name} has no chat template (a base model?): its answers come through ChatML, which it "
               f"was not trained on; `llmfw run -m {model.path} \"TEXT\"` continues a text instead", err=True)


@click.command("chat")
@model_and_sampling_options
def chat(**opts: Any) -> None:
    """Chat with a model: type a message, get an answer; /help lists the commands, /exit or Ctrl-D quits,
    Ctrl-C stops an answer (twice at the prompt quits).

    Samples with llama.cpp's defaults (temp 0.8, top-k 40, top-p 0.95, min-p 0.05, random seed); --temp 0 is
    greedy.
    """
    pipeline = build_pipeline(opts, {"chat.enabled": True}, greedy_default=False)
    model = load_model_with_progress(pipeline, not opts["no_progress"], verbose=opts["verbose"])
    warn_without_chat_template(pipeline, model)
    out = sys.stdout
    seed_drawn = draw_random_seed(pipeline)
    session = ChatSession(pipeline, model, out)
    if opts["verbose"]:
        describe_setup(model, session.ctx, session.sampler, pipeline, seed_drawn=seed_drawn)
    click.echo("llmfw chat: /help lists the commands, /exit or Ctrl-D quits, Ctrl-C stops an answer.", err=True)
    enable_line_editing()
    read_line = LineReader(out)
    while True:
        line = read_line()
        if line is None:
            break
        text = line.strip()
        if text in EXIT_COMMANDS:
            break
        if not text or run_command(text, session, out):
            continue
        try:
            session.answer(line)
        except LLMFWError as exc:
            click.echo(f"llmfw: error: {exc}", err=True)
            continue
        if opts["verbose"]:
            click.echo(session.last_stats.summary(), err=True)
    if read_line.interrupted:
        sys.exit(EXIT_INTERRUPTED)
