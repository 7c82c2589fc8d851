"""`llmfw bench`: a tiny configuration (-p 16 -n 4 -r 1) checked for structure, never for speed."""
from __future__ import annotations

import json
import os
import sys

import pytest
from click.testing import CliRunner

from llmfw.cli import cli
from llmfw.commands.bench import PEERS, TURN_MARK, Job, format_table, peer_script, run_taking_turns
from llmfw.core.errors import LLMFWError

TINY = ["-p", "16", "-n", "4", "-r", "1"]


def invoke(*args: str):
    return CliRunner().invoke(cli, ["bench", *args], catch_exceptions=False)


def check_record(record: dict, backend: str) -> None:
    assert record["engine"] == "llmfw" and record["backend"] == backend
    assert "error" not in record, record
    assert set(record["tests"]) == {"pp16", "tg4"}
    for name, n_tokens in (("pp16", 16), ("tg4", 4)):
        test = record["tests"][name]
        assert test["n_tokens"] == n_tokens and len(test["runs_s"]) == len(test["runs_wall"]) == 1
        (start, end), = test["runs_wall"]
        # the span is ``start + seconds`` in Unix time, whose float64 step is ~2.4e-7 s today: a microsecond apart
        # at most, not pytest.approx's default relative 1e-6 (5.7e-8 s of a 57 ms run failed by one step)
        assert end - start == pytest.approx(test["runs_s"][0], rel=0, abs=1e-6)
        assert test["tps_median"] > 0 and test["tps_min"] <= test["tps_median"] <= test["tps_max"]
    # one ubatch per pp16 run, from the same empty cache as the warm-up: its graph is reused
    assert (record["tests"]["pp16"]["graph_builds"], record["tests"]["pp16"]["graph_reuses"]) == (0, 1)
    # the one-token graph is built during the warm-up and reused by every timed decode
    assert record["tests"]["tg4"]["graph_builds"] == 0 and record["tests"]["tg4"]["graph_reuses"] == 4
    assert record["n_ctx"] >= 20 and record["kv_bytes"] > 0 and record["weight_bytes"] > 0
    assert 0 < record["rss_base"] <= record["rss_after_load"] <= record["rss_peak"]
    # load counts the context and the first one-token decode (what a backend builds lazily) on top of the model
    assert 0 < record["load_model_s"] < record["load_s"]


@pytest.mark.parametrize("backends", [["numpy", "torch"]])
def test_bench_json_structure(smollm2_path, backends) -> None:
    if "torch" in backends:
        pytest.importorskip("torch")
    result = invoke(str(smollm2_path), *TINY, "--backend", ",".join(backends), "--json", "-t", "1")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["params"]["n_prompt"] == 16 and report["params"]["n_threads"] == 1
    assert report["llama_cpp"] is None
    assert [r["backend"] for r in report["llmfw"]] == backends
    for record, backend in zip(report["llmfw"], backends):
        check_record(record, backend)
    table = format_table(report["llmfw"], None)
    assert table.splitlines()[0].startswith("| engine | backend | threads | test | t/s (median)")
    assert sum(line.startswith("| llmfw |") for line in table.splitlines()) == 2 * len(backends)


@pytest.mark.fast
def test_bench_table_with_a_reference_has_ratios() -> None:
    record = {"engine": "llmfw", "backend": "torch", "n_threads": 2, "load_s": 1.0, "rss_base": 1 << 20,
              "rss_after_load": 2 << 20, "rss_peak": 3 << 20, "weight_bytes": 1 << 20, "kv_bytes": 1 << 20,
              "n_ctx": 20, "tests": {"tg4": {"tps_median": 50.0, "tps_std": 1.0, "graph_builds": 0,
                                             "graph_reuses": 4}}}
    reference = {"engine": "llama.cpp", "backend": "llama-cpp-python", "n_threads": 2, "load_s": 0.1,
                 "rss_base": 1 << 20, "rss_after_load": 2 << 20, "rss_peak": 2 << 20,
                 "tests": {"tg4": {"tps_median": 100.0, "tps_std": 2.0}}}
    table = format_table([record], reference)
    assert "| llmfw | torch | 2 | tg4 | 50.00 | 1.00 | 100.00 | 0.50x | 0/4 |" in table
    assert "llama.cpp llama-cpp-python: load 0.10 s" in table


@pytest.mark.parametrize("peer, import_line", [("llama_cpp", "from llama_cpp import Llama"),
                                                 ("transformers", "from transformers import AutoModelForCausalLM")])
@pytest.mark.fast
def test_peer_scripts_are_self_contained(peer: str, import_line: str) -> None:
    """The script for the other interpreter must compile and must not import llmfw."""
    source = peer_script(PEERS[peer])
    compile(source, f"<{peer} bench>", "exec")
    assert "llmfw" not in source and import_line in source


@pytest.mark.parametrize("option, module", [("--compare-llama-cpp", "llama_cpp"),
                                            ("--compare-transformers", "transformers")])
def test_compare_with_an_interpreter_without_the_peer_is_a_clear_error(smollm2_path, option: str,
                                                                      module: str) -> None:
    try:
        __import__(module)
    except ImportError:
        pass
    else:
        pytest.skip(f"this interpreter has {module}")
    result = CliRunner().invoke(cli, ["bench", str(smollm2_path), *TINY, "--backend", "numpy", option,
                                      sys.executable])
    assert result.exit_code != 0
    assert f"cannot import {module}" in str(result.exception) and option in str(result.exception)


def test_bad_options_are_usage_errors(smollm2_path) -> None:
    result = CliRunner().invoke(cli, ["bench", str(smollm2_path), "-r", "0"])
    assert result.exit_code == 2 and "-r" in result.output


@pytest.mark.skipif(not os.environ.get("LLMFW_LLAMA_CPP_PYTHON"),
                    reason="set LLMFW_LLAMA_CPP_PYTHON to an interpreter with llama-cpp-python")
def test_compare_with_llama_cpp(smollm2_path) -> None:
    result = invoke(str(smollm2_path), *TINY, "--backend", "numpy", "--json",
                    "--compare-llama-cpp", os.environ["LLMFW_LLAMA_CPP_PYTHON"])
    assert result.exit_code == 0, result.output
    reference = json.loads(result.stdout)["llama_cpp"]
    assert reference["engine"] == "llama.cpp" and set(reference["tests"]) == {"pp16", "tg4"}
    assert reference["tests"]["tg4"]["tps_median"] > 0


@pytest.mark.skipif(not os.environ.get("LLMFW_TRANSFORMERS_PYTHON"),
                    reason="set LLMFW_TRANSFORMERS_PYTHON to an interpreter with transformers, torch and gguf")
def test_compare_with_transformers(smollm2_path) -> None:
    result = invoke(str(smollm2_path), *TINY, "--backend", "numpy",
                    "--compare-transformers", os.environ["LLMFW_TRANSFORMERS_PYTHON"])
    assert result.exit_code == 0, result.output
    assert "| transformers | transformers " in result.stdout and " f32 | 2 | tg4 |" in result.stdout


def test_batch_seqs_adds_an_aggregate_batched_decode_test(smollm2_path) -> None:
    result = invoke(str(smollm2_path), *TINY, "--backend", "numpy", "--batch-seqs", "3", "--json", "-t", "1")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)["llmfw"][0]
    batched = record["tests"]["tg4x3"]
    assert batched["n_tokens"] == 12  # every sequence's tokens count towards the aggregate rate
    # one graph shape (three one-token rows) built in the warm-up, reused by each timed step
    assert batched["graph_builds"] == 0 and batched["graph_reuses"] == 4
    assert record["n_ctx"] >= 12
    table = format_table([record], None)
    assert "| llmfw | numpy | 1 | tg4x3 |" in table and "tg4x3: aggregate" in table


def test_batch_seqs_out_of_range_is_a_usage_error(smollm2_path) -> None:
    result = CliRunner().invoke(cli, ["bench", str(smollm2_path), "--batch-seqs", "0"])
    assert result.exit_code == 2 and "--batch-seqs" in result.output


def _timed_spans(report: dict) -> list[tuple[float, float, str, str]]:
    """Every timed run of the report: (start, end, backend, test), in the order they ran."""
    return sorted((start, end, record["backend"], test) for record in report["llmfw"]
                  for test, result in record["tests"].items() for start, end in result["runs_wall"])


def test_engines_take_turns_one_repetition_at_a_time(smollm2_path) -> None:
    result = invoke(str(smollm2_path), "-p", "16", "-n", "4", "-r", "2", "--backend", "numpy,onnx", "--json",
                    "-t", "1")
    assert result.exit_code == 0, result.output
    spans = _timed_spans(json.loads(result.stdout))
    assert len(spans) == 8
    # never two engines measuring at once, and their repetitions alternate: numpy, onnx, numpy, onnx per test
    assert all(end <= next_start for (_, end, *_), (next_start, *_) in zip(spans, spans[1:]))
    assert [(backend, test) for _, _, backend, test in spans] == [
        (backend, test) for test in ("pp16", "tg4") for _ in range(2) for backend in ("numpy", "onnx")]


def test_no_interleave_runs_the_engines_one_after_another(smollm2_path) -> None:
    result = invoke(str(smollm2_path), "-p", "16", "-n", "4", "-r", "2", "--backend", "numpy,onnx", "--json",
                    "-t", "1", "--no-interleave")
    assert result.exit_code == 0, result.output
    order = [backend for _, _, backend, _ in _timed_spans(json.loads(result.stdout))]
    assert order == ["numpy"] * 4 + ["onnx"] * 4


@pytest.mark.fast
def test_a_job_that_fails_while_others_take_turns_is_a_clear_error_not_a_hang() -> None:
    waits_twice = (f"import sys\nfor _ in range(2):\n    print({TURN_MARK!r}, flush=True)\n"
                   "    sys.stdin.readline()\nprint('{\"ok\": 1}')")
    jobs = [Job(what="a job that waits twice", cmd=[sys.executable, "-c", waits_twice]),
            Job(what="a job that crashes", cmd=[sys.executable, "-c", "import sys; sys.exit(3)"])]
    with pytest.raises(LLMFWError, match=r"a job that crashes failed \(exit code 3\)"):
        run_taking_turns(jobs)
    assert run_taking_turns(jobs[:1]) == [{"ok": 1}]


@pytest.mark.fast
def test_a_load_clock_without_pyc_files_is_pointed_out():
    from llmfw.commands.bench import bytecode_note

    assert "PYTHONDONTWRITEBYTECODE" in bytecode_note({"PYTHONDONTWRITEBYTECODE": "1"})
    # Python writes .pyc files when the variable is unset or empty
    assert bytecode_note({}) is None and bytecode_note({"PYTHONDONTWRITEBYTECODE": ""}) is None
