"""`llmfw chat` driven through a pseudo-terminal: two turns, Ctrl-C during an answer, /exit."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "> "


class PtySession:
    def __init__(self, args: list[str], stderr_path: Path):
        self.master, slave = pty.openpty()
        self.stderr = stderr_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "llmfw.cli", *args], stdin=slave, stdout=slave,
                                     stderr=self.stderr, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a job
        # started in the background inherits SIGINT ignored, and the Ctrl-C below would then do nothing
        os.close(slave)
        self.buffer = ""

    def read_until(self, predicate, timeout: float = 600) -> str:
        """Read until predicate(buffer) holds; return the whole buffer and clear it."""
        deadline = time.monotonic() + timeout
        while not predicate(self.buffer):
            if time.monotonic() > deadline or self.proc.poll() is not None and not self._ready(0):
                raise AssertionError(f"chat did not produce the expected output; got {self.buffer!r}")
            if self._ready(1.0):
                try:
                    self.buffer += os.read(self.master, 4096).decode("utf-8", errors="replace")
                except OSError:
                    break
        text, self.buffer = self.buffer, ""
        return text.replace("\r\n", "\n")

    def _ready(self, timeout: float) -> bool:
        return bool(select.select([self.master], [], [], timeout)[0])

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self.master)
        self.stderr.close()


def at_prompt(buffer: str) -> bool:
    return buffer.replace("\r\n", "\n").endswith("\n" + PROMPT) or buffer == PROMPT


def answer_of(text: str, question: str) -> str:
    """The answer between the echoed question and the next prompt."""
    after = text.split(question, 1)[1]
    return after.rsplit("\n" + PROMPT, 1)[0].strip("\n")


@pytest.mark.slow
def test_chat_two_turns_interrupt_and_exit(smollm2_path, tmp_path):
    session = PtySession(["chat", "-m", str(smollm2_path), "-n", "24", "-c", "512", "--no-progress", "-v",
                          "--system", "You are a terse assistant."], tmp_path / "stderr.txt")
    try:
        session.read_until(lambda b: b.endswith(PROMPT))
        session.send("What is 2+2?")
        first = answer_of(session.read_until(at_prompt), "What is 2+2?")
        session.send("And 3+3?")
        second = answer_of(session.read_until(at_prompt), "And 3+3?")
        assert first.strip() and second.strip()

        # Ctrl-C while an answer streams stops that answer only
        session.send("Tell me a very long story about a dragon.")
        session.read_until(lambda b: "dragon." in b and len(b.split("dragon.", 1)[1].strip()) > 0)
        session.proc.send_signal(signal.SIGINT)
        interrupted = session.read_until(at_prompt)
        session.send("/exit")
        assert session.proc.wait(timeout=120) == 0
    finally:
        session.close()
    stderr = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert "Traceback" not in stderr
    assert "[stopped]" in interrupted
    # per-turn stats (-v): the second turn reused the first turn's tokens from the KV cache
    cached = [int(n) for n in re.findall(r"\((?:[\d.]+) tok/s, (\d+) cached\)", stderr)]
    assert len(cached) >= 2 and cached[0] == 0 and cached[1] > 20
