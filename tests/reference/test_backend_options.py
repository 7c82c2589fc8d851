"""Backends declare themselves (host, priority, devices, an options schema) and the core reads the declarations:
``ModelParams(backend_options={...})`` / a pipeline's ``backend_options`` reach the backend validated, a bad key
is a ConfigError that names it, threads follow each compute call, and the core names no backend."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import llmfw
from llmfw.core.backend import backend_class, backend_options_from_environment, merge_backend_options
from llmfw.core.batch import Batch
from llmfw.core.errors import ConfigError
from llmfw.core.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("options, message", [
    ({"numpy": {"n_thread": 2}}, r"backend 'numpy': n_thread: unknown option, did you mean 'n_threads'\?"),
    ({"nupmy": {"n_threads": 2}}, r"names backend 'nupmy', which is not registered; did you mean 'numpy'\?"),
    ({"numpy": {"n_threads": 0}}, r"backend 'numpy': n_threads: must be >= 1 \(got 0\)"),
    ({"numpy": {"n_threads": "many"}}, r"backend 'numpy': n_threads: must be an integer \(got 'many'\)"),
    ({"ggml": {"f16_kv_cach": False}}, r"backend 'ggml': f16_kv_cach: unknown option, did you mean 'f16_kv_cache'"),
    ({"numpy": ["n_threads"]}, r"backend_options.numpy: must be a mapping \(key: value\)"),
])
def test_bad_backend_options_name_the_key(smollm2_path, options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        llmfw.load_model(smollm2_path, backend="numpy", backend_options=options)


def test_options_of_an_unused_backend_are_checked_too(smollm2_path) -> None:
    with pytest.raises(ConfigError, match="'ggml': quantize_activation: unknown option"):
        llmfw.load_model(smollm2_path, backend="numpy", backend_options={"ggml": {"quantize_activation": False}})


def test_ggml_options_switch_its_emulations(smollm2_path) -> None:
    tokens = [1, 422, 1115, 314, 4135]
    logits = {}
    for f16_kv in (True, False):
        with llmfw.load_model(smollm2_path, backend="ggml", backend_options={"ggml": {"f16_kv_cache": f16_kv}}) as model:
            backend = model.backends["ggml"]
            assert backend.f16_kv_cache is f16_kv and backend.quantize_activations is True
            assert model.host_backend is backend  # a host backend placed by the caller holds the embedding itself
            ctx = model.new_context(n_ctx=256, n_threads=1)
            assert ctx.decode(Batch(tokens)) == 0
            logits[f16_kv] = ctx.get_logits_ith(-1)
    assert not np.array_equal(logits[True], logits[False])  # the f16 rounding of K and V is visible
    np.testing.assert_allclose(logits[True], logits[False], atol=1.0)  # ... and stays a rounding


def test_threads_follow_each_compute_call_not_the_last_context(smollm2_path) -> None:
    with llmfw.load_model(smollm2_path, backend="numpy", backend_options={"numpy": {"n_threads": 2}}) as model:
        backend = model.backends["numpy"]
        one = model.new_context(n_ctx=256, n_threads=1)
        default = model.new_context(n_ctx=256)
        assert backend.n_threads is None  # creating contexts changes nothing on the shared backend
        assert one.decode(Batch([1, 422])) == 0
        assert backend.n_threads == 1
        assert default.decode(Batch([1, 422])) == 0
        assert backend.n_threads == 2  # the model's option, not what the other context left behind


def test_pipeline_backend_options_reach_the_backend(smollm2_path, tmp_path) -> None:
    pipeline = Pipeline.from_dict({"model": str(smollm2_path), "backend": "ggml",
                                   "backend_options": {"ggml": {"f16_attention": False}}})
    backend = pipeline.load_model().backends["ggml"]
    assert backend.f16_attention is False and backend.f16_kv_cache is True
    bad = Pipeline.from_dict({"model": str(smollm2_path), "backend": "numpy",
                              "backend_options": {"ggml": {"f16_atention": False}}})
    with pytest.raises(ConfigError, match="did you mean 'f16_attention'"):
        bad.load_model()


def test_environment_options_merge_below_configured_ones() -> None:
    merged = merge_backend_options({"ggml": {"f16_kv_cache": "0", "f16_attention": "0"}},
                                   {"ggml": {"f16_kv_cache": True}, "numpy": {"n_threads": 1}})
    assert merged == {"ggml": {"f16_kv_cache": True, "f16_attention": "0"}, "numpy": {"n_threads": 1}}
    # a variable no backend declares maps onto nothing
    assert backend_options_from_environment({"LLMFW_NOT_AN_OPTION": "1"}) == {}


def test_backends_declare_host_priority_and_devices() -> None:
    numpy_cls, onnx_cls = backend_class("numpy"), backend_class("onnx")
    assert numpy_cls.is_host and not onnx_cls.is_host
    assert numpy_cls.devices() == ["cpu"]
    assert onnx_cls.devices() == ["cpu"]
    assert onnx_cls.default_priority["cpu"] > numpy_cls.default_priority["cpu"]


def test_torch_lists_the_cpu_and_each_cuda_device() -> None:
    torch = pytest.importorskip("torch")
    found = backend_class("torch").devices()
    assert found == ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]


def test_a_device_backend_model_gets_the_best_host(smollm2_path) -> None:
    with llmfw.load_model(smollm2_path, backend="onnx") as model:
        assert model.host_backend is not None and model.host_backend.is_host
        assert set(model.backends) == {"onnx", model.host_backend.spec}


def _string_literals_outside_docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_the_core_names_no_backend() -> None:
    from llmfw.core.plugins import registry

    names = set(registry("backends").names())
    assert {"numpy", "onnx"} <= names
    found = [f"{path.name}:{line}: {value!r}" for path in sorted((ROOT / "llmfw" / "core").rglob("*.py"))
             for line, value in _string_literals_outside_docstrings(path) if value.strip().split(":")[0] in names]
    assert found == []


def test_environment_variables_map_onto_the_declared_options() -> None:
    from llmfw.core.backend import create_backend

    options = backend_options_from_environment({"LLMFW_ONNX_SPIN": "0", "LLMFW_TORCH_MATMUL": "f32", "HOME": "/"})
    assert options == {"onnx": {"spin": "0"}, "torch": {"matmul": "f32"}}
    onnx = create_backend("onnx", options)
    assert onnx.onnx_options.spin is False and onnx.onnx_options.profile is None
    with pytest.raises(ConfigError, match="backend 'onnx': spin: must be true or false"):
        create_backend("onnx", {"onnx": {"spin": "sometimes"}})


def test_onnx_keeps_one_session_per_thread_count(smollm2_path) -> None:
    """Two contexts with different thread counts on one model take turns without rebuilding sessions."""
    with llmfw.load_model(smollm2_path, backend="onnx") as model:
        onnx = model.backends["onnx"]
        contexts = [model.new_context(n_ctx=256, n_threads=1), model.new_context(n_ctx=256, n_threads=2)]
        for ctx in contexts:
            assert ctx.decode(Batch([1, 422])) == 0 and ctx.decode(Batch([1115])) == 0
        built = onnx.sessions_built
        logits = []
        for token in (314, 4135):
            for ctx in contexts:
                assert ctx.decode(Batch([token])) == 0
                logits.append(ctx.get_logits_ith(-1))
        assert onnx.sessions_built == built
        np.testing.assert_allclose(logits[0], logits[1], atol=1e-3)  # the thread count does not change the result
