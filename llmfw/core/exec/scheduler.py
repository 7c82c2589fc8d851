"""The scheduler: places graph nodes on backends, cuts the graph into splits, inserts copies, runs it.

Placement rules (llama.cpp's ``ggml_backend_sched`` in spirit):

1. a ``weight`` node lives where the model loaded that weight;
2. ``attention`` / ``k_shift`` run where their layer's KV cache lives (the layer's backend);
3. a node with a weight input runs on that weight's backend (so the token embedding lookup runs on the host
   backend that holds ``token_embd``, like llama.cpp keeps it on the CPU);
4. any other node follows its first computed input, or, with only graph inputs, its layer's backend;
5. an op the chosen backend does not implement falls back to the host (numpy) backend, with a log line —
   except ops that need the backend's own weights or KV storage, which raise ModelError.

Consecutive nodes on one backend form a split; values crossing a cut are converted once per run
(``Backend.import_value``). A :class:`Plan` (the compiled splits) is built once per graph and reused as long as
the context reuses the graph.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Protocol, cast

import numpy as np

from .backend import Backend, CompiledSplit, KVHandle, NativeValue, Split
from ..errors import ModelError
from ..ir.graph import Graph, Node, consumers_of, last_uses
from ..ir.passes import apply_rewrite_rules, fold_norm_weights, fuse_shared_input_matmuls

log = logging.getLogger(__name__)

#: ops that must run on the backend owning their layer's KV storage
_KV_OPS = frozenset({"attention", "k_shift"})


class PlacedModel(Protocol):
    """What the scheduler needs of a model: where its weights and layers live, and the weights fused at load."""

    @property
    def host_backend(self) -> Backend | None: ...

    @property
    def fused_weights(self) -> Mapping[tuple[str, ...], str]: ...

    def weight_backend(self, name: str) -> Backend: ...

    def layer_backend(self, il: int) -> Backend: ...


#: KV storage of a context: (cache, layer) → the handle its backend's ``alloc_kv`` returned
KVStorage = Mapping[tuple[str, int], KVHandle]
#: node id → backend (graph inputs are absent: their values come from numpy)
Placement = dict[int, Backend]


@dataclass
class Plan:
    """A graph cut into compiled splits, ready to run many times with new input values."""

    graph: Graph
    splits: list[Split]
    runners: list[CompiledSplit]
    #: graph input name → node id
    input_ids: dict[str, int] = field(default_factory=dict)
    #: graph output name → (node id, backend; None for a graph input)
    output_ids: dict[str, tuple[int, Backend | None]] = field(default_factory=dict)

    def describe(self) -> str:
        return " | ".join(f"{s.backend.spec}:{len(s.nodes)}" for s in self.splits)


class Scheduler:
    """Assigns nodes of a model's graphs to its backends and runs them (one per context)."""

    def __init__(self, model: PlacedModel, kv_storage: KVStorage):
        if model.host_backend is None:
            raise ModelError("the model has no host backend (it was loaded with vocab_only=True)")
        self.model = model
        self.kv_storage = kv_storage
        self.host: Backend = model.host_backend
        self._warned: set[tuple[str, str]] = set()

    # -- placement --------------------------------------------------------------------------------------
    def assign(self, graph: Graph) -> Placement:
        """node id → backend for every node but the graph inputs."""
        placed: Placement = {}
        for node in graph.nodes:
            backend = self._place(node, placed)
            if backend is not None:
                placed[node.id] = backend
        return placed

    def _place(self, node: Node, placed: Placement) -> Backend | None:
        if node.op == "input":
            return None
        if node.op == "weight":
            return self.model.weight_backend(node.attr_str("name"))
        if node.op in _KV_OPS:
            backend = self.model.layer_backend(node.attr_int("layer"))
            self._require_op(backend, node)
            return backend
        weight_inputs = [i for i in node.inputs if i.op == "weight"]
        if weight_inputs:
            backend = placed[weight_inputs[0].id]
            self._require_op(backend, node)
            return backend
        computed = [placed[i.id] for i in node.inputs if i.id in placed]
        backend = computed[0] if computed else self.model.layer_backend(node.layer)
        if node.op not in backend.supported_ops:
            self._warn_fallback(backend, node)
            backend = self.host
        return backend

    def _require_op(self, backend: Backend, node: Node) -> None:
        if node.op not in backend.supported_ops:
            raise ModelError(f"backend {backend.spec!r} does not implement op {node.op!r}, which must run where "
                             f"its weights / KV cache live (node {node!r})")

    def _warn_fallback(self, backend: Backend, node: Node) -> None:
        key = (backend.spec, node.op)
        if key not in self._warned:
            self._warned.add(key)
            log.warning("backend %s lacks op %r: running it on %s", backend.spec, node.op, self.host.spec)

    # -- splitting ----------------------------------------------------------------------------------------
    def plan(self, graph: Graph) -> Plan:
        """Fuse ``graph``'s shared-input matmuls, place it, fold norms into their weight where both run on one
        backend, cut it, apply each backend's rewrite rules to its splits, mark liveness and compile every split
        (the core passes, in place): once per built graph."""
        fuse_shared_input_matmuls(graph, self.model.fused_weights, self.model.weight_backend)
        placed = self.assign(graph)
        fold_norm_weights(graph, lambda norm, mul: placed.get(norm.id) is placed.get(mul.id))
        splits = self._cut(graph, placed)
        graph_outputs = {node.id for node in graph.outputs.values()}
        for split in splits:
            split.nodes = apply_rewrite_rules(split.nodes, split.backend.rewrite_rules, graph_outputs)
        consumers = consumers_of([n for split in splits for n in split.nodes])
        split_of: dict[int, int] = {}
        for si, split in enumerate(splits):
            for node in split.nodes:
                if node.op != "weight":
                    split_of[node.id] = si
        for si, split in enumerate(splits):
            inside = {n.id for n in split.nodes}
            needed: list[int] = []
            for node in split.nodes:
                for inp in node.inputs:
                    if inp.id not in inside and inp.id not in needed:
                        needed.append(inp.id)
            split.input_ids = needed
            split.output_ids = [
                n.id for n in split.nodes if n.op != "weight" and (
                    n.id in graph_outputs or any(split_of.get(c.id, si) != si for c in consumers.get(n.id, ())))
            ]
            split.release_after = last_uses(split.nodes, set(split.output_ids))
        runners = [split.backend.compile(split, self.kv_storage) for split in splits]
        return Plan(
            graph=graph, splits=splits, runners=runners,
            input_ids={name: node.id for name, node in graph.inputs.items()},
            output_ids={name: (node.id, placed.get(node.id)) for name, node in graph.outputs.items()},
        )

    @staticmethod
    def _cut(graph: Graph, placed: Placement) -> list[Split]:
        """Consecutive compute nodes on one backend form a split; each split carries the weights it uses."""
        splits: list[Split] = []
        in_split: set[int] = set()  # ids of the nodes of the last split (a linear scan made this quadratic)
        for node in graph.nodes:
            if node.op in ("input", "weight"):
                continue
            backend = placed[node.id]
            if not splits or splits[-1].backend is not backend:
                splits.append(Split(backend=backend))
                in_split = set()
            split = splits[-1]
            for inp in node.inputs:
                if inp.op == "weight" and inp.id not in in_split:
                    in_split.add(inp.id)
                    if placed[inp.id] is not backend:
                        raise ModelError(f"weight {inp.attrs['name']!r} is on {placed[inp.id].spec} but node "
                                         f"{node!r} runs on {backend.spec}")
                    split.nodes.append(inp)
            split.nodes.append(node)
            in_split.add(node.id)
        return splits

    # -- running --------------------------------------------------------------------------------------------
    def compute(self, plan: Plan, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run every split with the graph input values; returns the graph outputs as numpy arrays."""
        values: dict[int, tuple[NativeValue, Backend | None]] = {}
        for name, node_id in plan.input_ids.items():
            if name not in inputs:
                raise ModelError(f"graph input {name!r} was not provided")
            values[node_id] = (inputs[name], None)
        converted: dict[tuple[int, int], NativeValue] = {}
        for split, run in zip(plan.splits, plan.runners):
            backend = split.backend
            args = {}
            for node_id in split.input_ids:
                key = (node_id, id(backend))
                if key not in converted:
                    value, source = values[node_id]
                    converted[key] = (backend.from_numpy(cast(np.ndarray, value)) if source is None  # a graph input
                                      else backend.import_value(value, source))
                args[node_id] = converted[key]
            for node_id, value in run(args).items():
                values[node_id] = (value, backend)
        outputs = {}
        for name, (node_id, _) in plan.output_ids.items():
            value, source = values[node_id]
            if source is not None:
                source.synchronize()
                value = source.to_numpy(value)
            outputs[name] = np.asarray(value, dtype=np.float32)
        return outputs
