"""Shared fixtures: the real models (fetched through the catalog, cached) and llama.cpp's reference outputs
(``tests/data/reference/``, inside the repository)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


#: llama.cpp's reference outputs, copied into the repository (provenance: tests/data/reference/README.md);
#: the suite reads nothing outside the checkout
REFERENCE_DIR = ROOT / "tests" / "data" / "reference"


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return REFERENCE_DIR


def load_reference(name: str) -> dict:
    return json.loads((REFERENCE_DIR / name).read_text())


@pytest.fixture(scope="session")
def smollm2_ref() -> dict:
    return load_reference("smollm2-135m-instruct-q4_1.json")


@pytest.fixture(scope="session")
def gemma3_ref() -> dict:
    return load_reference("gemma-3-270m-q4_k_m.json")


@pytest.fixture(scope="session")
def bpe_pre_ref() -> dict:
    return load_reference("bpe-pretokenizers.json")


@pytest.fixture(scope="session")
def score():
    """llama.cpp's scoring function from tests/data/reference/compare.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llmfw_reference_compare", REFERENCE_DIR / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.score


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from llmfw.core.catalog import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from llmfw.core.catalog import resolve_model

    return resolve_model("gemma-3-270m")


@pytest.fixture(scope="session")
def confident_prefix():
    """``count(prompt_record, margin=0.5)``: how many tokens of llama.cpp's greedy continuation come before its
    first close call (best logit ahead of the second by less than ``margin``). Up to there a correct engine's
    greedy output must equal llama.cpp's; after it, correct engines may legitimately diverge."""

    def count(record: dict, margin: float = 0.5) -> int:
        start = len(record["prompt_ids"]) - 1
        n = 0
        for pos in range(start, len(record["sequence"]) - 1):
            top = record["positions"][pos]["top_logits"]
            if top[0] - top[1] < margin:
                break
            n += 1
        return n

    return count
