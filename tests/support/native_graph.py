"""The native backend's program tests' hand-built splits (tests/unit/test_native_program.py,
test_native_recurrent.py): a split of inputs with values, weights and op nodes, compiled and run on a backend, and
the native backend beside the numpy oracle."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from llmfw.core.exec.backend import Split
from llmfw.core.ir.graph import Node
from llmfw.plugins.backends.numpy.runtime import NumpyBackend


class Graph:
    """A hand-built split: inputs with values, weights, and op nodes in order."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: dict[int, np.ndarray] = {}
        self.weights: dict[str, np.ndarray] = {}

    def input(self, value: np.ndarray) -> Node:
        dtype = {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}[value.dtype]
        node = Node(len(self.inputs) + 1000, "input", attrs={"name": f"in{len(self.inputs)}"}, shape=value.shape,
                    dtype=dtype)
        self.inputs[node.id] = value
        return node

    def weight(self, name: str, value: np.ndarray) -> Node:
        self.weights[name] = value
        node = Node(len(self.nodes), "weight", attrs={"name": name}, shape=value.shape, dtype="f32")
        self.nodes.append(node)
        return node

    def op(self, op: str, *inputs: Node, out: tuple[int, ...], dtype: str = "f32", **attrs) -> Node:
        node = Node(len(self.nodes), op, tuple(inputs), dict(attrs), shape=out, dtype=dtype)
        self.nodes.append(node)
        return node

    def run(self, backend, output: Node, kv=None) -> np.ndarray:
        backend.weights.update(self.weights)
        split = Split(backend, nodes=list(self.nodes), input_ids=list(self.inputs), output_ids=[output.id])
        run = backend.compile(split, kv or {})
        return np.asarray(run({i: v.copy() for i, v in self.inputs.items()})[output.id])


def native_and_oracle(kv_type: str = "f32") -> Iterator[tuple[object, NumpyBackend]]:
    """A module fixture's body: the native backend on two threads and the numpy backend (the native KV cache float32
    like the oracle's unless ``kv_type`` says f16)."""
    from llmfw.plugins.backends.native.runtime import NativeBackend, NativeOptions  # after the caller's check

    native = NativeBackend(options=NativeOptions(kv_type=kv_type))
    native.set_n_threads(2)
    yield native, NumpyBackend()
    native.free_weights()


def both(graph: Graph, output: Node, backends) -> tuple[np.ndarray, np.ndarray]:
    native, oracle = backends
    return graph.run(native, output), graph.run(oracle, output)


def random_f32(seed: int) -> Callable[..., np.ndarray]:
    """``f32(*shape, scale=1.0)``: standard normal float32 values times ``scale``, from a generator of ``seed``."""
    rng = np.random.default_rng(seed)

    def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return f32
