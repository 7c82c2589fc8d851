"""Structured output from the command line and YAML pipelines: `llmfw run` / `llmfw chat` with --grammar,
--grammar-file, -j/--json-schema, -jf/--json-schema-file, --json and --regex; `sampling.grammar` /
`sampling.json_schema` as text, a file path (relative to the YAML file) or an inline mapping."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from llmfw.core.errors import ConfigError
from llmfw.core.pipeline import Pipeline, load_pipeline
from support.cli import llmfw_in_process

ROOT = Path(__file__).resolve().parents[2]
GRAMMARS = Path(__file__).parents[1] / "data" / "grammars"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}


def llmfw(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmfw.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          input=stdin, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)


def test_run_with_a_json_schema_prints_valid_json():
    result = llmfw("run", "-m", "smollm2", "--no-progress", "--chat", "-n", "48", "--temp", "1", "-s", "4",
                   "-j", json.dumps(SCHEMA), "Name a city as JSON.")
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), SCHEMA)
    assert "stop: eog" in result.stderr


def test_run_with_a_grammar_file_and_regex(tmp_path):
    result = llmfw("run", "-m", "smollm2", "--no-progress", "-n", "24", "--grammar-file", str(GRAMMARS / "list.gbnf"),
                   "My shopping list:\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("- ")
    result = llmfw("run", "-m", "smollm2", "--no-progress", "-n", "8", "--regex", "[0-9]{2}", "Two digits:")
    assert result.returncode == 0 and re.fullmatch(r"[0-9]{2}\n", result.stdout), result.stdout


def test_chat_answers_each_turn_under_the_schema():
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    # -n leaves room for the worst case the schema allows (20 characters of 4 byte tokens each, then the
    # closing quote and brace), so that whatever is sampled the object closes; the seed keeps the run repeatable
    result = llmfw("chat", "-m", "smollm2", "--no-progress", "-n", "100", "-s", "7", "-j", json.dumps(schema),
                   stdin="Say hello.\nSay goodbye.\n")
    assert result.returncode == 0, result.stderr
    answers = [chunk.strip() for chunk in re.split(r"(?m)^> ", result.stdout) if chunk.strip()]
    assert len(answers) == 2, result.stdout
    for answer in answers:
        jsonschema.validate(json.loads(answer), schema)


def test_run_with_json_gives_an_object():
    result = llmfw("run", "-m", "smollm2", "--no-progress", "--chat", "-n", "64", "--json",
                   "Reply with a JSON object with one key.")
    assert result.returncode == 0, result.stderr
    assert result.stdout.lstrip().startswith("{")
    if "stop: eog" in result.stderr:
        assert isinstance(json.loads(result.stdout), dict)


@pytest.mark.parametrize("args, words", [
    (["--grammar", 'root ::= "a'], "line 1, column 12"),
    (["-j", '{"type": "nope"}'], "Invalid type"),
    (["--regex", "(abc"], "unclosed group"),
    (["--grammar-file", "/nonexistent.gbnf"], "cannot read"),
    (["--json", "--regex", "a"], "at most one output constraint"),
])
def test_bad_constraints_are_one_line_errors(args, words):
    result = llmfw_in_process("run", "-m", "smollm2", "--no-progress", "-n", "4", *args, "hi")
    assert result.returncode != 0
    assert words in result.stderr and "Traceback" not in result.stderr


@pytest.mark.fast
def test_help_lists_the_flags():
    result = llmfw_in_process("run", "--help")
    for flag in ("--grammar", "--grammar-file", "--json-schema", "-jf", "--json", "--regex"):
        assert flag in result.stdout


# -- YAML ------------------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_yaml_grammar_and_schema_files_are_relative_to_the_yaml_file(tmp_path):
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "yes.gbnf").write_text('root ::= "yes" | "no"\n')
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "a.yaml").write_text("sampling:\n  grammar: g/yes.gbnf\n")
    (tmp_path / "b.yaml").write_text("sampling:\n  json_schema: s.json\n")
    assert load_pipeline(tmp_path / "a.yaml").config.sampling.grammar == 'root ::= "yes" | "no"\n'
    assert json.loads(load_pipeline(tmp_path / "b.yaml").config.sampling.json_schema) == SCHEMA


@pytest.mark.fast
def test_yaml_inline_schema_mapping_and_grammar_text(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("sampling:\n  json_schema:\n    type: object\n    properties: {n: {type: integer}}\n")
    assert load_pipeline(path).config.sampling.json_schema == {"type": "object",
                                                               "properties": {"n": {"type": "integer"}}}
    pipeline = Pipeline.from_dict({"sampling": {"grammar": 'root ::= "a" | "b"'}})
    assert pipeline.config.sampling.grammar_spec().kind == "gbnf"


@pytest.mark.fast
def test_yaml_bad_grammar_or_missing_file_names_the_key(tmp_path):
    (tmp_path / "a.yaml").write_text("sampling:\n  grammar: missing.gbnf\n")
    with pytest.raises(ConfigError, match=r"sampling\.grammar: cannot read"):
        load_pipeline(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("sampling:\n  json_schema: {type: nope}\n")
    with pytest.raises(ConfigError, match=r"sampling.*Invalid type"):
        load_pipeline(tmp_path / "b.yaml")


# -- bench -----------------------------------------------------------------------------------------------------
def test_bench_with_a_json_schema_reports_constrained_tg(smollm2_path):
    from click.testing import CliRunner

    from llmfw.cli import cli

    schema = ROOT / "benchmarks" / "schemas" / "person.json"
    result = CliRunner().invoke(cli, ["bench", str(smollm2_path), "-p", "0", "-n", "4", "-r", "1", "--backend",
                                      "numpy", "-t", "1", "--json", "-jf", str(schema)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    tests = json.loads(result.stdout)["llmfw"][0]["tests"]
    assert set(tests) == {"tg4", "tg4+sample", "tg4+json"}
    constrained = tests["tg4+json"]
    assert constrained["tps_median"] > 0 and constrained["n_tokens"] == 4
    assert constrained["mask_ms_per_token"] > 0 and constrained["grammar_compile_ms"] > 0


def test_bench_refuses_a_bad_schema_before_loading(tmp_path, smollm2_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "nope"}')
    result = llmfw_in_process("bench", str(smollm2_path), "-n", "4", "-p", "0", "-jf", str(bad))
    assert result.returncode != 0 and "Invalid type" in result.stderr and "Traceback" not in result.stderr
