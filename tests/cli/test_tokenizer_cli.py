"""`llmfw tokenize MODEL TEXT [--ids] [--pieces] [--no-special] [--parse-special]`."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llmfw.cli import cli


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, ["tokenize", *args], input=input)


def test_ids_by_catalog_name_match_llama_cpp(gemma3_ref):
    case = next(c for c in gemma3_ref["tokenize"] if c["text"] == "<start_of_turn>user\nhi<end_of_turn>")
    result = run("gemma-3-270m", case["text"], "--ids", "--parse-special")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == case["add_special=True,parse_special=True"]
    result = run("gemma-3-270m", case["text"], "--ids", "--no-special")
    assert json.loads(result.output) == case["add_special=False,parse_special=False"]


def test_default_output_lists_ids_and_pieces(smollm2_path):
    result = run(str(smollm2_path), "Hello world<|im_end|>", "--parse-special")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines == [" 19556 -> 'Hello'", "   905 -> ' world'", "     2 -> '<|im_end|>'"]


def test_pieces_show_partial_utf8_as_escapes(smollm2_path):
    result = run(str(smollm2_path), "😀", "--pieces")
    assert result.exit_code == 0, result.output
    pieces = [json.loads(line) for line in result.stdout.splitlines()]
    assert pieces == ["\\xf0\\x9f", "\\x98", "\\x80"]


def test_text_from_stdin(smollm2_path):
    result = run(str(smollm2_path), "-", "--ids", input="Hello world")
    assert json.loads(result.output) == [19556, 905]


@pytest.mark.fast
def test_bad_model_is_a_clear_error():
    result = run("/no/such/model.gguf", "x")
    assert result.exit_code != 0
    assert "neither a file nor a catalog model" in str(result.exception)


def test_ids_and_pieces_exclude_each_other(smollm2_path):
    result = run(str(smollm2_path), "x", "--ids", "--pieces")
    assert result.exit_code == 2
    assert "exclude each other" in result.output
