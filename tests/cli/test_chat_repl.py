"""`llmfw chat` as llama-cli's conversation mode feels, driven through a real pseudo-terminal (pexpect) on the
real console script: sampling by default, readline editing and history, /help, /reset, Ctrl-C, clean exits."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")  # the `test` extra installs it

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_SCRIPT = Path(sys.executable).with_name("llmfw")
PROMPT = "> "
UP_ARROW = "\x1b[A"


def default_sigint() -> None:
    """Ctrl-C as in a terminal, however the suite was launched (a background job inherits SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_chat(model: Path, *args: str):
    child = pexpect.spawn(str(CONSOLE_SCRIPT), ["chat", "-m", str(model), "-c", "512", "--no-progress", *args],
                          cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)), encoding="utf-8",
                          timeout=300, dimensions=(40, 200), preexec_fn=default_sigint)
    return child


def until_prompt(child) -> str:
    """Everything printed up to the next prompt at the start of a line."""
    child.expect_exact("\r\n" + PROMPT)
    return child.before


def test_chat_samples_by_default_and_edits_lines(smollm2_path):
    child = spawn_chat(smollm2_path, "-n", "8", "-v")
    try:
        setup = until_prompt(child)
        assert "temp = 0.8" in setup and "top_k = 40" in setup and "min_p = 0.05" in setup
        assert "-> temperature -> dist" in setup  # sampling, not greedy

        child.sendline("/help")
        listed = until_prompt(child)
        for command in ("/help", "/reset", "/exit, /quit", "Ctrl-C"):
            assert command in listed
        child.sendline("/hlep")
        assert "unknown command /hlep; /help lists the commands" in until_prompt(child)

        child.sendline("Say hello.")
        first = until_prompt(child)
        assert "generation: " in first  # -v: an answer was generated and timed

        # Up recalls the last line through readline (no "^[[A" echoed), Enter sends it again
        child.send(UP_ARROW)
        child.expect_exact("Say hello.")
        child.send("\r")
        again = until_prompt(child)
        assert "^[[A" not in again and "generation: " in again

        child.sendline("/reset")
        assert "(conversation reset: 2 turns forgotten)" in until_prompt(child)

        child.sendintr()  # Ctrl-C once at the prompt: a hint, the session goes on
        child.expect_exact("(Ctrl-C again to quit, or /exit)")
        until_prompt(child)
        child.sendintr()  # ... twice in a row: quit, on a fresh line
        child.expect(pexpect.EOF)
        tail = child.before
    finally:
        child.close()
    assert child.exitstatus == 130
    assert tail.endswith("\r\n") and "Traceback" not in tail


@pytest.mark.parametrize("how", ["/exit", "ctrl-d"])
def test_greedy_with_temp_0_and_a_clean_exit(smollm2_path, how):
    child = spawn_chat(smollm2_path, "-n", "4", "--temp", "0", "-v")
    try:
        setup = until_prompt(child)
        assert "-> temperature -> greedy" in setup and "temp = 0.0" in setup
        if how == "/exit":
            child.sendline("/exit")
        else:
            child.sendeof()
        child.expect(pexpect.EOF)
        tail = child.before
    finally:
        child.close()
    assert child.exitstatus == 0
    assert tail.endswith("\r\n")  # the shell's prompt starts on its own line
    assert not tail.rstrip("\r\n").endswith(PROMPT.strip())
