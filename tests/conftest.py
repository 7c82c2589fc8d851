"""Shared fixtures: the real models (fetched through the catalog, cached) and llama.cpp's reference outputs
(``tests/data/reference/``, inside the repository)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
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


def install_example_package(name: str, tmp_path_factory) -> Path:
    """pip-install ``examples/<name>`` (no dependencies: llmfw comes from this checkout) into a fresh folder
    and return it; with that folder on the path, importlib.metadata finds the package's entry points exactly
    as after a real ``pip install``. Built from a copy, since setuptools writes build/ and *.egg-info next to
    the sources."""
    import shutil
    import subprocess
    import sys

    package = ROOT / "examples" / name
    target = tmp_path_factory.mktemp(f"{name}-site")
    source = shutil.copytree(package, tmp_path_factory.mktemp(f"{name}-src") / name,
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--target", str(target), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=target)
    assert result.returncode == 0, result.stderr
    return target


def _onnx_many_row_kernels_keep_rows_apart() -> str | None:
    """Why ONNX Runtime's many-row kernels do not give a row the same bits whatever the row count on this CPU,
    or None when they do. The onnx backend's batch invariance is built on that premise (a one-row product is
    padded where needed, one query head per KV head is scored twice): the tests asserting it check llmfw's
    design where the premise holds, and skip, saying why, on a CPU where ONNX Runtime's kernels break it."""
    import onnx
    import onnxruntime as ort

    from llmfw.plugins.backends.onnx.rows import PROBE_K, block_product_session

    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, PROBE_K)).astype(np.float32)
    for bits in (4, 8):
        session = block_product_session(ort, onnx, bits, 4, ["CPUExecutionProvider"], rng)
        five = session.run(None, {"x": x})[0]
        for rows in (2, 3):
            if not np.array_equal(session.run(None, {"x": x[:rows]})[0], five[:rows]):
                return f"ONNX Runtime's {bits}-bit MatMulNBits gives a row other bits among {rows} rows than among 5"
    keys = rng.standard_normal((2, 64, 48)).astype(np.float32)      # attention scores: [heads, rows, D] @ K^T
    helper, tensor = onnx.helper, onnx.TensorProto
    graph = helper.make_graph([helper.make_node("MatMul", ["q", "k"], ["s"])], "scores",
                              [helper.make_tensor_value_info("q", tensor.FLOAT, [2, None, 64])],
                              [helper.make_tensor_value_info("s", tensor.FLOAT, [2, None, 48])],
                              [onnx.numpy_helper.from_array(keys, "k")])
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                                   .SerializeToString(), providers=["CPUExecutionProvider"])
    q = rng.standard_normal((2, 5, 64)).astype(np.float32)
    five = session.run(None, {"q": q})[0]
    for rows in (2, 3):
        if not np.array_equal(session.run(None, {"q": q[:, :rows]})[0], five[:, :rows]):
            return f"ONNX Runtime's batched MatMul gives a score row other bits among {rows} rows than among 5"
    return None


@pytest.fixture(scope="session")
def onnx_batch_invariance_premise() -> None:
    """Skip a test of the onnx backend's bit-for-bit batch invariance on a CPU where ONNX Runtime's many-row
    kernels themselves depend on the row count (see ``_onnx_many_row_kernels_keep_rows_apart``)."""
    pytest.importorskip("onnxruntime")
    reason = _onnx_many_row_kernels_keep_rows_apart()
    if reason is not None:
        pytest.skip(f"batch invariance is not promised on this CPU: {reason}")
