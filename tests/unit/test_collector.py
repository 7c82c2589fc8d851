"""The cyclic collector paused while a model loads and a graph is planned (llmfw/core/runtime/collector.py): it
runs again afterwards exactly when it ran before, whether the block ends normally or by an exception, and a
caller that switched it off keeps it off."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_gen.arch_testing import model_file

import llmfw
from llmfw.core.errors import GGUFError
from llmfw.core.runtime.collector import collector_paused


@pytest.fixture
def collector_state() -> Iterator[None]:
    """Whatever a test does to the collector, the next test finds it as this one did."""
    was_enabled = gc.isenabled()
    yield
    if was_enabled:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_running_after(collector_state):
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_running_again_after_an_exception(collector_state):
    gc.enable()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("inside")
    assert gc.isenabled()


def test_a_caller_that_switched_it_off_keeps_it_off(collector_state):
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_nested_pauses_resume_only_at_the_outermost(collector_state):
    gc.enable()
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_load_and_first_decode_leave_it_running(collector_state, tmp_path):
    gc.enable()
    path = model_file("qwen3", tmp_path)
    with llmfw.load_model(path, backend="numpy") as model:
        assert gc.isenabled()
        ctx = model.new_context(n_ctx=64)
        assert ctx.decode(llmfw.Batch([1, 2, 3])) == 0
        assert gc.isenabled()


def test_a_failed_load_leaves_it_running(collector_state, tmp_path):
    gc.enable()
    broken: Path = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    with pytest.raises(GGUFError):
        llmfw.load_model(broken)
    assert gc.isenabled()
