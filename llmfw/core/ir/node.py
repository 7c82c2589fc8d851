"""Graph values: :class:`Node` (one op application) and the types its shape, dtype and attributes take.

The ops and their semantics are in :mod:`llmfw.core.ir.ops`; graphs and the builder in
:mod:`llmfw.core.ir.graph`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ModelError

#: a dimension: a concrete size, or ``DYNAMIC`` when only the running graph knows it (a graph input whose length
#: the builder cannot see, e.g. the K-shift's ``n_kv``)
DYNAMIC = -1
Shape = tuple[int, ...]
#: element types of graph values: activations and weights are float32 to every op (whatever a backend stores),
#: token ids and positions int32, KV cell indices int64
DType = Literal["f32", "i32", "i64"]
#: what an attribute may hold (numbers, names, shapes, the part names of a fused weight)
AttrValue = int | float | str | bool | None | tuple[int, ...] | tuple[str, ...]
Attrs = dict[str, AttrValue]


@dataclass(eq=False)
class Node:
    """One op application. Identity is by object: two equal-looking nodes are still two nodes.

    ``shape`` / ``dtype`` are computed from the op table when the node is built (:meth:`Graph.add`) and are
    None only in hand-built graphs whose leaves were given none (tests of one backend kernel)."""

    id: int
    op: str
    inputs: tuple["Node", ...] = ()
    attrs: Attrs = field(default_factory=dict)
    #: layer index that owns this node (-1: input side before layer 0, n_layer: output side), for placement
    layer: int = -1
    name: str = ""
    shape: Shape | None = None
    dtype: DType | None = None

    def __repr__(self) -> str:
        args = ", ".join(f"%{i.id}" for i in self.inputs)
        label = f" {self.name}" if self.name else ""
        typed = f" {self.dtype}{list(self.shape)}" if self.shape is not None else ""
        return f"%{self.id} = {self.op}({args}){label} L{self.layer}{typed} {self.attrs or ''}"

    def attr_int(self, key: str, default: int | None = None) -> int:
        return int(self._attr(key, default))  # type: ignore[arg-type]

    def attr_float(self, key: str, default: float | None = None) -> float:
        return float(self._attr(key, default))  # type: ignore[arg-type]

    def attr_str(self, key: str) -> str:
        return str(self._attr(key, None))

    def _attr(self, key: str, default: AttrValue) -> AttrValue:
        value = self.attrs.get(key, default)
        if value is None:
            raise ModelError(f"graph node {self!r} lacks attribute {key!r}")
        return value


class ShapeError(ValueError):
    """Raised by an op's inference rule; :meth:`Graph.add` turns it into a ModelError naming the node."""

