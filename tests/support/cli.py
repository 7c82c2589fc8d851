"""The ``llmfw`` command in-process, through click's CliRunner and the console entry point's own error
handling (``llmfw.cli.main``: a project error is one line on stderr and exit code 1), for tests of flags,
messages and exit codes. Tests where a real process matters (stdin on a pty, signals, the installed console
script, a server) start one instead."""
from __future__ import annotations

import subprocess

import click
from click.testing import CliRunner

from llmfw.cli import main


@click.command(add_help_option=False, context_settings={"ignore_unknown_options": True})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def _console(argv: tuple[str, ...]) -> None:
    main(list(argv))


def llmfw_in_process(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    """``llmfw ARGS`` run in this process: the exit status, stdout and stderr as a finished process has them."""
    result = CliRunner().invoke(_console, list(args), input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a crash, not an exit: the traceback is the test's failure
    return subprocess.CompletedProcess(["llmfw", *args], result.exit_code, result.stdout, result.stderr)
