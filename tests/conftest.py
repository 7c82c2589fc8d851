"""Shared fixtures: the real models (fetched through the catalog, cached; loaded once per session and backend)
and llama.cpp's reference outputs (``tests/data/reference/``, inside the repository); the test tiers.

Tiers are folders (docs/testing.md): ``unit/`` (no model file), ``tiny/`` (random-weight models built on the fly
by ``support/models.py``), ``cli/`` (the command line), ``reference/`` (the real models). Every test in ``unit/``
and ``tiny/`` is marked ``fast``, and so is a ``cli/`` test that carries ``@pytest.mark.fast`` itself;
``bash scripts/test.sh --fast`` runs ``-m fast``. A fast test may not ask for a real model."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from llmfw.core.exec.weight_cache import cache_dir_variable
from llmfw.core.format.catalog import SHA256_MEMO_VARIABLE

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# whatever folder a test module sits in: ``support`` and ``reference_gen`` import from tests/, ``benchmarks``
# from the checkout's root
for _folder in (TESTS, ROOT):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

#: the folders whose every test is in the fast tier (no download)
FAST_TIERS = ("unit", "tiny")
#: the fixtures that need a real model's file
REAL_MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path", "shared_models"})


#: the caches (variable: subfolder) the session points at a folder of its own: each backend keeps its last four
#: converted-weight entries under ``<models_dir>/.<backend>``, and the many throw-away model files the tests load
#: would push the user's own models' entries out (their next load would convert them again); the files' sha256
#: memo would fill with the throw-away files' entries
SESSION_CACHE_VARIABLES = {**{cache_dir_variable(backend): backend for backend in ("native", "onnx")},
                           SHA256_MEMO_VARIABLE: "sha256"}
_SESSION_CACHES = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """Give the session's converted-weight caches and sha256 memo a fresh folder, unless the caller chose one
    (tests of the default folders set ``LLMFW_MODELS_DIR`` and drop these variables themselves); subprocesses
    inherit it."""
    unset = [name for name in SESSION_CACHE_VARIABLES if not os.environ.get(name)]
    if not unset:
        return
    folder = Path(tempfile.mkdtemp(prefix="llmfw-test-caches-"))
    config.stash[_SESSION_CACHES] = folder
    for name in unset:
        os.environ[name] = str(folder / SESSION_CACHE_VARIABLES[name])


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_SESSION_CACHES, None)
    if folder is None:
        return
    for name, subfolder in SESSION_CACHE_VARIABLES.items():
        if os.environ.get(name) == str(folder / subfolder):
            del os.environ[name]
    shutil.rmtree(folder, ignore_errors=True)


def _tier(item: pytest.Item) -> str | None:
    try:
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT).parts
    except ValueError:  # a test outside the checkout
        return None
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its tier's name (``-m tiny``) and the fast ones ``fast``; a fast test that asks
    for a real model is a mistake in its folder, reported at collection."""
    misplaced = []
    for item in items:
        tier = _tier(item)
        if tier is not None:
            item.add_marker(tier)
        if tier in FAST_TIERS:
            item.add_marker("fast")
        if item.get_closest_marker("fast") and REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError("fast-tier tests that need a real model (move them to tests/reference/ or "
                                "drop their `fast` mark): " + ", ".join(misplaced))


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
def shared_models(request):
    """The real models loaded once for the whole session (``shared_models.get("smollm2", "numpy")``), one per
    name, backend and vocab_only; closed at the session's end. Only for tests that leave the model as they
    found it (contexts of their own are fine)."""
    from support.real_models import SharedModels

    fixture_of = {"smollm2": "smollm2_path", "gemma3": "gemma3_path"}
    models = SharedModels(lambda name: request.getfixturevalue(fixture_of[name]))
    yield models
    models.close()


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
