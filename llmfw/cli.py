"""The ``llmfw`` command line. Each command lives in its own module under ``llmfw.commands`` and is imported
only when it runs, so ``llmfw --help`` stays fast; plugins add commands through ``register_commands``."""
from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from .core.errors import LLMFWError

#: command name -> "module:function" (a click.Command)
COMMANDS = {
    "run": "llmfw.commands.run:run",
    "chat": "llmfw.commands.chat:chat",
    "inspect": "llmfw.commands.inspect:inspect_cmd",
    "tokenize": "llmfw.commands.tokenize:tokenize_cmd",
    "plugins": "llmfw.commands.plugins:plugins_cmd",
    "pull": "llmfw.commands.models:pull_cmd",
    "models": "llmfw.commands.models:models_cmd",
    "bench": "llmfw.commands.bench:bench",
    "serve": "llmfw.commands.serve:serve",
    "bench-serve": "llmfw.commands.bench_serve:bench_serve",
    "perplexity": "llmfw.commands.perplexity:perplexity_cmd",
    "embed": "llmfw.commands.embed:embed_cmd",
}

_HELP = {
    "run": "Generate text from a prompt.",
    "chat": "Chat with a model interactively.",
    "inspect": "Show a GGUF file's metadata, hyperparameters and tensors.",
    "tokenize": "Tokenize text with a model's vocabulary.",
    "plugins": "List the registered plugins and where they come from.",
    "pull": "Fetch a catalog model into the local cache.",
    "models": "List catalog models and which are cached.",
    "bench": "Benchmark prompt processing and generation (llama-bench style).",
    "serve": "Serve a model over an OpenAI-compatible HTTP API (continuous batching).",
    "bench-serve": "Benchmark an OpenAI-compatible server under concurrent requests.",
    "perplexity": "Perplexity of a text file, as llama-perplexity computes it.",
    "embed": "Embeddings of texts as JSON (llama.cpp pooling).",
}


class LazyGroup(click.Group):
    """A group whose built-in commands are imported on first use; plugin commands are added eagerly."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plugins_added = False

    def _add_plugin_commands(self, ctx: click.Context) -> None:
        if self._plugins_added or ctx.resilient_parsing:
            return
        self._plugins_added = True
        from .core.plugins import get_plugin_manager

        get_plugin_manager().register_commands(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        ref = COMMANDS.get(name)
        if ref is None:
            self._add_plugin_commands(ctx)
            return self.commands.get(name)
        module_name, _, attr = ref.partition(":")
        try:
            command: click.Command = getattr(importlib.import_module(module_name), attr)
            return command
        except (ImportError, AttributeError):
            return None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _HELP.get(name, "")) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llmfw", prog_name="llmfw")
def cli() -> None:
    """llmfw — run GGUF language models the way llama.cpp does, built from plugins."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: project errors become one clear line on stderr and exit code 1."""
    try:
        cli.main(args=argv, prog_name="llmfw", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except LLMFWError as exc:
        click.echo(f"llmfw: error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
