"""The split-compiler skeleton the backends share (llmfw.core.exec.compiler): what every backend's compiler
does around its kernels, checked on the numpy backend's compiler (the reference) and on a backend with no
kernels at all — whose only errors then come from the shared skeleton."""
from __future__ import annotations

import numpy as np
import pytest

from llmfw.core.errors import ModelError
from llmfw.core.exec.backend import Split
from llmfw.core.exec.compiler import SplitCompilerBase
from llmfw.core.ir.graph import Graph, Node, last_uses
from llmfw.core.plugins import registry
from llmfw.plugins.backends.numpy.kernels import NumpyKV


def two_adds() -> tuple[Graph, Split]:
    """x (graph input) + y (another split's value) → a; a + a → b (the output); a is dead after b."""
    graph = Graph()
    x = graph.leaf("input", "x", (2,))
    y = graph.leaf("input", "y", (2,))
    a = graph.add("add", x, y)
    b = graph.add("add", a, a)
    nodes = [x, a, b]
    split = Split(registry("backends").get("numpy")(), nodes, input_ids=[y.id], output_ids=[b.id],
                  release_after=last_uses(nodes, {b.id}))
    return graph, split


class NoKernels(SplitCompilerBase[NumpyKV]):
    backend_name = "bare"
    kv_class = NumpyKV


def test_inputs_come_first_and_name_themselves() -> None:
    _, split = two_adds()
    compiler = NoKernels(split, {})
    x, a, b = split.nodes
    assert compiler.slot[split.input_ids[0]] == 0 and [compiler.s(n) for n in (x, a, b)] == [1, 2, 3]
    assert compiler.required_inputs() == [(split.input_ids[0], f"%{split.input_ids[0]}"), (x.id, "x")]


def test_an_op_without_a_kernel_and_a_missing_cache_are_clear_errors() -> None:
    _, split = two_adds()
    with pytest.raises(ModelError, match=r"bare backend cannot compile op 'add' \(node %\d+\)"):
        NoKernels(split, {}).walk()
    attention_like = Node(id=99, op="k_shift", attrs={"cache": "kv", "layer": 3})
    with pytest.raises(ModelError, match="bare backend: no KV storage of this backend for cache 'kv' layer 3"):
        NoKernels(split, {("kv", 3): object()}).kv_storage(attention_like)  # another backend's storage


def test_the_numpy_compiler_runs_on_the_skeleton() -> None:
    _, split = two_adds()
    (x, _, b), y_id = split.nodes, split.input_ids[0]
    run = split.backend.compile(split, {})
    out = run({x.id: np.ones(2, np.float32), y_id: np.full(2, 2.0, np.float32)})
    np.testing.assert_array_equal(out[b.id], np.full(2, 6.0, np.float32))
    with pytest.raises(ModelError, match="graph input 'x' was not set"):
        run({y_id: np.ones(2, np.float32)})
