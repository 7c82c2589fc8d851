"""llama.cpp's own tokenizer suite: every ``models/ggml-vocab-*.gguf`` with ``.inp`` / ``.out`` beside it.

The files come from the llama-cpp-python source distribution on the package registry (``pip download --no-deps
--no-binary :all: llama-cpp-python==0.3.36``), downloaded once into ``~/.cache/llmfw/llama-cpp-python-0.3.36``
(``LLMFW_CACHE_DIR`` moves it) and reused; the test skips, saying why, only when the registry cannot be reached.
The cases are read as llama.cpp's ``tests/test-tokenizer-0.cpp`` reads them: the inputs split on
``\\n__ggml_vocab_test__\\n``, one line of expected ids per input, ``add_special=False``, ``parse_special=False``.
The vocab files are loaded with ``load_model(path, vocab_only=True)``: their architectures (bert, command-r,
falcon, gemma4, gpt2, mpt, refact, starcoder2 ...) have no plugin, and a vocab-only load needs none.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

import llmfw

SDIST = "llama-cpp-python==0.3.36"
MODELS_IN_SDIST = "vendor/llama.cpp/models/"
SEPARATOR = "\n__ggml_vocab_test__\n"
#: the suite's files (15 with cases) and their case counts, so a truncated download cannot pass quietly
SUITE = {
    "bert-bge": 47, "command-r": 47, "deepseek-coder": 47, "deepseek-llm": 47, "falcon": 47, "gemma-4": 46,
    "gpt-2": 47, "llama-bpe": 47, "llama-spm": 47, "mpt": 47, "phi-3": 47, "qwen2": 47, "qwen35": 51,
    "refact": 47, "starcoder": 47,
}


def _cache_dir() -> Path:
    base = Path(os.environ.get("LLMFW_CACHE_DIR", Path.home() / ".cache" / "llmfw"))
    return base / "llama-cpp-python-0.3.36"


def _download_sdist(into: Path) -> Path:
    """The sdist archive, fetched with pip (skips the session when the registry cannot be reached)."""
    into.mkdir(parents=True, exist_ok=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if found:
        return found[0]
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                             "--disable-pip-version-check", "-q", "-d", str(into), SDIST],
                            capture_output=True, text=True, timeout=900)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if result.returncode != 0 or not found:
        pytest.skip(f"cannot download {SDIST} from the package registry: {result.stderr.strip()[-300:]}")
    return found[0]


def _extract_vocab_files(archive: Path, models: Path) -> None:
    """Only models/ggml-vocab-* leave the archive; written to a fresh folder first and renamed, so an interrupted
    run never leaves half a suite behind."""
    staging = Path(tempfile.mkdtemp(dir=models.parent, prefix="models-"))
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = member.name.split("/", 1)[-1]
            if member.isfile() and name.startswith(MODELS_IN_SDIST + "ggml-vocab-"):
                source = tar.extractfile(member)
                assert source is not None
                (staging / Path(name).name).write_bytes(source.read())
    shutil.rmtree(models, ignore_errors=True)
    os.replace(staging, models)


@pytest.fixture(scope="session")
def vocab_suite_dir() -> Path:
    cache = _cache_dir()
    models = cache / "models"
    if not all((models / f"ggml-vocab-{name}.gguf.out").is_file() for name in SUITE):
        archive = _download_sdist(cache)
        _extract_vocab_files(archive, models)
    return models


def read_cases(inp: Path, out: Path) -> list[tuple[str, list[int]]]:
    """The (text, expected ids) pairs of one vocab file."""
    texts = inp.read_text(encoding="utf-8").split(SEPARATOR)
    lines = out.read_text(encoding="utf-8").split("\n")
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]


@pytest.fixture(scope="session")
def suite_results(vocab_suite_dir):
    """name -> (tokenizer model, number of cases, mismatches)."""
    results = {}
    for name in SUITE:
        path = vocab_suite_dir / f"ggml-vocab-{name}.gguf"
        cases = read_cases(Path(f"{path}.inp"), Path(f"{path}.out"))
        vocab = llmfw.load_model(path, vocab_only=True).vocab
        mismatches = [(text, got, want) for text, want in cases
                      if (got := vocab.tokenize(text, add_special=False, parse_special=False)) != want]
        results[name] = (vocab.model, len(cases), mismatches)
    return results


def test_every_case_of_every_file_is_exact(suite_results):
    total = sum(n for _, n, _ in suite_results.values())
    wrong = {name: bad[:2] for name, (_, _, bad) in suite_results.items() if bad}
    assert total == 708
    assert not wrong, wrong


@pytest.mark.parametrize("name", sorted(SUITE))
def test_file_has_its_cases(name, suite_results):
    assert suite_results[name][1] == SUITE[name]


def test_the_suite_spans_four_tokenizer_types(suite_results):
    assert {model for model, _, _ in suite_results.values()} == {"bert", "gemma4", "gpt2", "llama"}


def test_ugm_nomic_bert_moe_matches_llama_cpp(vocab_suite_dir):
    """The suite's T5-style (UGM) vocab has no .inp / .out; llama.cpp's own tokenization of it, with every flag
    combination, is tests/data/ugm_nomic_bert_moe.json (tests/reference_gen/ugm_reference.py)."""
    reference = json.loads((Path(__file__).parents[1] / "data" / "ugm_nomic_bert_moe.json").read_text(encoding="utf-8"))
    vocab = llmfw.load_model(vocab_suite_dir / reference["vocab"], vocab_only=True).vocab
    assert vocab.model == "t5" and vocab.tokenizer.charsmap is not None and vocab.add_eos
    cases = reference["cases"]
    wrong = [(c["text"], c["add_special"], c["parse_special"]) for c in cases
             if vocab.tokenize(c["text"], c["add_special"], c["parse_special"]) != c["ids"]]
    assert len(cases) == 228
    assert not wrong, wrong[:3]
