"""The skeleton every split compiler shares; a backend fills in its kernels (``_op_<op>`` methods).

A split (:class:`~llmfw.core.exec.backend.Split`) arrives as nodes in graph order, the ids of the values other
splits hand it, the ids it hands back, and the core's liveness (``release_after``). Every compiler — numpy's and
torch's closures over value slots, onnx's translation into an ONNX graph — does the same around its kernels:

* gives each value a slot (the split's inputs first, then every node, in order);
* visits the nodes: weights (:meth:`compile_weight`), the rest through ``_op_<op>`` (:meth:`op_handler`, a
  :class:`ModelError` naming an op the backend lacks), and after each node the values nothing later reads
  (:meth:`compile_release`);
* checks that a run was handed every value it needs (:func:`check_inputs`);
* finds an ``attention`` / ``k_shift`` node's KV storage (:meth:`kv_storage`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from ..errors import ModelError
from ..ir.graph import Node
from .backend import Split

#: a backend's KV storage of one (cache, layer)
KV = TypeVar("KV")


class SplitCompilerBase(Generic[KV]):
    """Slots, the node walk, op dispatch, input checks and KV look-up for a split compiler."""

    #: the backend's name, in error messages
    backend_name: ClassVar[str] = ""
    #: the class this backend's KV storages have (None: any); another backend's storage is an error
    kv_class: ClassVar[type | None] = None

    def __init__(self, split: Split, kv: Mapping[tuple[str, int], KV]):
        self.split = split
        self.kv = kv
        #: node id → slot: the split's inputs first, then every node in graph order
        self.slot: dict[int, int] = {}
        for node_id in split.input_ids:
            self.slot.setdefault(node_id, len(self.slot))
        for node in split.nodes:
            self.slot.setdefault(node.id, len(self.slot))

    def s(self, node: Node) -> int:
        return self.slot[node.id]

    # -- the walk ------------------------------------------------------------------------------------------
    def walk(self) -> None:
        """Visit the nodes in order; after each, release what the core's liveness marks dead."""
        for index, node in enumerate(self.split.nodes):
            if node.op == "weight":
                self.compile_weight(node)
            elif node.op != "input":
                self.compile_node(node)
            dead = self.split.release_after.get(index)
            if dead:
                self.compile_release(dead)

    def compile_weight(self, node: Node) -> None:
        """A ``weight`` node (default: nothing; its readers fetch it)."""

    def compile_node(self, node: Node) -> None:
        """Any other node: its ``_op_<op>`` handler with the node (override to pass more)."""
        self.op_handler(node)(node)

    def compile_release(self, node_ids: Sequence[int]) -> None:
        """The values ``node_ids`` are read by no later node (default: kept)."""

    def op_handler(self, node: Node) -> Callable[..., Any]:
        handler: Callable[..., Any] | None = getattr(self, f"_op_{node.op}", None)
        if handler is None:
            raise ModelError(f"{self.backend_name} backend cannot compile op {node.op!r} (node %{node.id}): "
                             "it has no kernel for it")
        return handler

    # -- inputs and KV storage -------------------------------------------------------------------------------
    def required_inputs(self) -> list[tuple[int, str]]:
        """(node id, name) of every value a run must be handed: the split's inputs (values other splits
        computed, named ``%id``), then the graph inputs (``tokens``, ``mask`` ...) placed in this split."""
        named = {n.id: str(n.attrs.get("name", f"%{n.id}")) for n in self.split.nodes if n.op == "input"}
        ids = [*self.split.input_ids, *(i for i in named if i not in self.split.input_ids)]
        return [(i, named.get(i, f"%{i}")) for i in ids]

    @staticmethod
    def kv_key(node: Node) -> tuple[str, int]:
        """The (cache, layer) an ``attention`` / ``k_shift`` node reads and writes."""
        return str(node.attrs.get("cache", "kv")), node.attr_int("layer", node.layer)

    def kv_storage(self, node: Node) -> KV:
        key = self.kv_key(node)
        storage = self.kv.get(key)
        if storage is None or (self.kv_class is not None and not isinstance(storage, self.kv_class)):
            raise ModelError(f"{self.backend_name} backend: no KV storage of this backend for cache {key[0]!r} "
                             f"layer {key[1]}")
        return storage


def check_inputs(required: Sequence[tuple[int, str]], inputs: Mapping[int, object]) -> None:
    """A clear error for a run not handed a value it needs (instead of a kernel failing on None)."""
    for node_id, name in required:
        if inputs.get(node_id) is None:
            raise ModelError(f"graph input {name!r} was not set")
