"""A hand-built split for the native backend's program tests: inputs with values, weights, and op nodes in order,
run through any backend's compiler (the native one and the numpy oracle alike)."""
from __future__ import annotations

import numpy as np

from llmfw.core.exec.backend import Split
from llmfw.core.ir.graph import Node


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
