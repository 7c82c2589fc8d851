"""The onnx backend beside its numpy oracle on one hand-built graph (the onnx op tests and the MoE family tests use it)."""
from __future__ import annotations

import numpy as np

from llmfw.core.backend import KVLayerShape, Split, WeightSource
from llmfw.core.graph import Graph
from llmfw.plugins.backends.numpy import NumpyBackend
from llmfw.plugins.backends.onnx import OnnxBackend


class Harness:
    """Loads the same weights into both backends, runs one split per backend, compares outputs and caches."""

    def __init__(self, sources: list[WeightSource], kv_shapes: list[KVLayerShape], accuracy_level: int = 0):
        self.onnx = OnnxBackend()
        self.onnx.accuracy_level = accuracy_level
        self.numpy = NumpyBackend()
        for backend in (self.onnx, self.numpy):
            for source in sources:
                backend.weights[source.name] = backend.load_weight(source)
        self.kv = {b: {(s.cache, s.layer): b.alloc_kv(s) for s in kv_shapes} for b in (self.onnx, self.numpy)}
        self.compiled: dict = {}

    def run(self, graph: Graph, inputs: dict[str, np.ndarray]) -> tuple[dict, dict]:
        results = []
        for backend in (self.onnx, self.numpy):
            key = (backend, id(graph))
            if key not in self.compiled:
                split = Split(backend=backend, nodes=[n for n in graph.nodes if n.op != "input"],
                              input_ids=[graph.inputs[name].id for name in inputs],
                              output_ids=[n.id for n in graph.outputs.values()])
                self.compiled[key] = backend.compile(split, self.kv[backend])
            values = self.compiled[key]({graph.inputs[name].id: backend.from_numpy(v) for name, v in inputs.items()})
            results.append({name: backend.to_numpy(values[n.id]) for name, n in graph.outputs.items()})
        return results[0], results[1]
