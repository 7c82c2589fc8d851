"""A clone alone passes its tests: the reference data lives in the repository, no test reads outside it, and
``scripts/test.sh`` runs what its arguments name."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

from conftest import REFERENCE_DIR

ROOT = Path(__file__).resolve().parents[2]


def test_reference_data_is_inside_the_repository_with_its_provenance():
    assert REFERENCE_DIR.is_relative_to(ROOT)
    readme = (REFERENCE_DIR / "README.md").read_text()
    listed = dict(re.findall(r"\| `([\w.-]+)` \| `([0-9a-f]{64})` \|", readme))
    assert set(listed) == {"bpe-pretokenizers.json", "compare.py", "gemma-3-270m-q4_k_m.json",
                           "smollm2-135m-instruct-q4_1.json"}
    for name, digest in listed.items():  # the data is what the README says it is
        assert hashlib.sha256((REFERENCE_DIR / name).read_bytes()).hexdigest() == digest, name


def test_no_test_builds_a_path_outside_the_checkout():
    """A test that reaches beside the checkout (``ROOT.parent``, ``../shared``) passes only on our machines."""
    offenders = []
    for folder in (ROOT / "tests", ROOT / "examples"):
        for path in folder.rglob("*.py"):
            if "reference_gen" in path.parts or path == Path(__file__):
                continue  # the generators run by hand next to llama.cpp; this file names the patterns
            text = path.read_text(encoding="utf-8")
            for pattern in ("ROOT.parent", "../shared", "LLMFW_REFERENCE_DIR", '"shared" /', '"/work/', "'/work/"):
                if pattern in text:
                    offenders.append(f"{path.relative_to(ROOT)}: {pattern}")
    assert offenders == []


def _run_test_script(tmp_path: Path, *args: str) -> list[list[str]]:
    """Run scripts/test.sh with PYTHON set to a recorder: every interpreter call is logged, none runs."""
    log = tmp_path / "calls.txt"
    recorder = tmp_path / "python"
    recorder.write_text(f'#!/bin/sh\nprintf "%s\\037" "$@" >> {log}\nprintf "\\n" >> {log}\n')
    recorder.chmod(0o755)
    result = subprocess.run(["bash", "scripts/test.sh", *args], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHON=str(recorder)), timeout=60)
    assert result.returncode == 0, result.stderr
    return [line.split("\x1f")[:-1] for line in log.read_text().splitlines()]


def test_test_script_arguments_replace_the_default_paths(tmp_path):
    pytest_call = _run_test_script(tmp_path, "tests/cli/test_run_cli.py", "-x")[-1]
    assert pytest_call[:2] == ["-m", "pytest"]
    assert pytest_call[-2:] == ["tests/cli/test_run_cli.py", "-x"]
    assert "tests" not in pytest_call and "examples/llmfw-olmo/tests" not in pytest_call
    assert "examples/llmfw-toyconv/tests" not in pytest_call


def test_test_script_runs_every_suite_without_paths(tmp_path):
    calls = _run_test_script(tmp_path)
    assert calls[-1][-3:] == ["tests", "examples/llmfw-olmo/tests", "examples/llmfw-toyconv/tests"]
    assert ["-m", "llmfw.cli", "pull", "smollm2"] in calls  # the models are fetched before the tests run
    options_only = _run_test_script(tmp_path, "-x")[-1]
    assert options_only[-4:] == ["tests", "examples/llmfw-olmo/tests", "examples/llmfw-toyconv/tests", "-x"]


#: a clone has no design notes or shared folder beside it: the repository must not send a reader there
_OUTSIDE_DOCUMENTS = re.compile("DESIGN" + r"\.md|(?<![\w-])" + "shared" + "/|PERF" + "-NOTES")
_TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".txt", ".cfg", ".ini", ".jinja", ".gbnf", ".lark"}


def test_nothing_refers_to_documents_outside_the_repository():
    """Code comments, docstrings, tests, benchmarks and docs name only what a clone holds (docs/design.md is the
    design)."""
    offenders = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if path.suffix not in _TEXT_SUFFIXES or not path.is_file() or parts[0].startswith(".") or "site" in parts[:1]:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if _OUTSIDE_DOCUMENTS.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]}")
    assert offenders == []


def test_test_script_fast_runs_the_fast_tier_alone(tmp_path):
    """--fast: one pytest call on the fast tier's folders, selecting ``-m fast``; no install, pull or mypy."""
    calls = _run_test_script(tmp_path, "--fast")
    assert len(calls) == 1
    assert calls[0][:2] == ["-m", "pytest"] and calls[0][-3:] == ["tests/unit", "tests/tiny", "tests/cli"]
    assert calls[0][calls[0].index("-m", 1) + 1] == "fast"
    one_file = _run_test_script(tmp_path, "--fast", "tests/tiny/test_kv_cache.py", "-x")
    assert one_file[-1][-2:] == ["tests/tiny/test_kv_cache.py", "-x"] and "tests/unit" not in one_file[-1]
