"""What the native compiler places and reads: a value's place in a program (``Value``), a weight in the kernels'
layout (``NativeMatrix``), and the row layouts and broadcast strides the ops take."""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from llmfw.core.errors import ModelError
import llmfw.plugins.backends.native.kernels as kernels
import llmfw.plugins.backends.native.program as pg
from llmfw.plugins.backends.native.repack import PackedWeight

WORDS_PER = {"f32": 1, "i32": 1, "i64": 2}


@dataclass
class NativeMatrix:
    """A matmul (or row lookup) weight in the kernels' layout."""

    packed: PackedWeight
    c_struct: kernels.NatWeight = field(repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape

    @property
    def ndim(self) -> int:
        return 2


def native_matrix(packed: PackedWeight) -> NativeMatrix:
    return NativeMatrix(packed, kernels.c_weight(packed))


@dataclass
class Value:
    """Where a graph value lives in a program: buffer (0 = the arena) and word offset, its shape and type; a
    matrix is ``weight`` (an index into the program's weight table) instead."""

    buf: int
    off: int
    shape: tuple[int, ...]
    dtype: str
    weight: int = -1
    #: the arena allocation this value is a view of (reshapes and slices share it)
    root: int = -1
    #: words from one row (along the first axis) to the next, for a view of every row's columns [a, b) of a wider
    #: value (a slice of a multi-row matmul's fused output); 0: contiguous. The ops that take row strides
    #: (elementwise, row ops, rope, swiglu, the KV write) read such a view as it is; any other use gets a contiguous
    #: copy (``v``).
    row_stride: int = 0

    @property
    def operand(self) -> pg.Operand:
        return pg.Operand(self.buf, self.off)

    @property
    def size(self) -> int:
        return prod(self.shape)

@dataclass(frozen=True)
class OutputSlot:
    """Where a program leaves a split output: its own buffer (an index of the program's buffer table), its shape and
    type."""

    buf: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def words(self) -> int:
        return prod(self.shape) * WORDS_PER[self.dtype]


def row_layout(value: Value) -> tuple[int, int, int]:
    """(rows, words per row, words from a row to the next) of an activation: rows along the first axis (a vector is
    one row)."""
    rows = value.shape[0] if len(value.shape) > 1 else 1
    width = value.size // rows if rows else 0
    return rows, width, value.row_stride or width


def broadcast_strides(out: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> tuple[list[int], list[int],
                                                                                                list[int]]:
    """numpy broadcasting as 4 dims and each operand's word strides (0 along a broadcast axis)."""
    if len(out) > 4:
        raise ModelError(f"native backend: an elementwise op over {len(out)} dimensions (at most 4)")
    dims = [1] * (4 - len(out)) + list(out)

    def strides(shape: tuple[int, ...]) -> list[int]:
        padded = [1] * (4 - len(shape)) + list(shape)
        result, step = [0] * 4, 1
        for axis in range(3, -1, -1):
            result[axis] = step if padded[axis] != 1 else 0
            step *= padded[axis]
        return result

    return dims, strides(a), strides(b)
