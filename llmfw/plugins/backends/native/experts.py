"""3-D weights [E, n_out, n_in] in the kernels' layout: the expert matrices of ``mul_mat_id`` and the per-head
matrices of ``mul_mat_heads`` (which runs as a ``mul_mat_id`` whose row (t, h) takes matrix h).

One repacked weight holds every expert's rows: expert e's row groups follow expert e-1's. With ``n_out`` a multiple
of 8 that is the tensor repacked as E·n_out rows; otherwise each expert is repacked alone (its last group padded),
so that no row group straddles two experts. Each expert gets its own ``nat_weight`` pointing at its rows: the program
lists the E of them side by side in its weight table, and the C code picks one by id."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from llmfw.core.format.quants import GGMLType, tensor_nbytes
import llmfw.plugins.backends.native.kernels as kernels
from llmfw.plugins.backends.native.repack import FLOAT_KINDS, ROWS, PackedWeight, repack

#: the graph ops whose 3-D weights are repacked as experts
EXPERT_OPS = frozenset({"mul_mat_id", "mul_mat_heads"})


def rows_per_expert(ggml_type: int, n_out: int) -> int:
    """The rows each expert takes in the repacked weight: n_out, rounded up to whole row groups when quantized."""
    if GGMLType(ggml_type) in FLOAT_KINDS:
        return n_out
    return -(-n_out // ROWS) * ROWS


def packed_expert_shape(ggml_type: int, ne: tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of the repacked weight of a tensor of ggml shape ``ne`` = (n_in, n_out, E)."""
    n_in, n_out, n_expert = (int(d) for d in ne)
    return n_expert * rows_per_expert(ggml_type, n_out), n_in


def repack_experts(raw: np.ndarray, ggml_type: int, ne: tuple[int, ...]) -> PackedWeight:
    """The kernels' form of a 3-D tensor (QuantError for a type or shape they do not take)."""
    n_in, n_out, n_expert = (int(d) for d in ne)
    if rows_per_expert(ggml_type, n_out) == n_out:
        return repack(raw, ggml_type, ne)
    step = tensor_nbytes(ggml_type, (n_in, n_out))
    parts = [repack(raw[e * step:(e + 1) * step], ggml_type, (n_in, n_out)) for e in range(n_expert)]
    return replace(parts[0], n_rows=n_expert * rows_per_expert(ggml_type, n_out),
                   data=np.concatenate([p.data for p in parts]))


@dataclass
class NativeExperts:
    """A 3-D weight in the kernels' layout, with the ``nat_weight`` of each expert."""

    packed: PackedWeight
    n_expert: int
    n_out: int
    c_structs: list[kernels.NatWeight] = field(repr=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_expert, self.n_out, self.packed.n_cols)

    @property
    def ndim(self) -> int:
        return 3

    def with_packed(self, packed: PackedWeight) -> "NativeExperts":
        """The same experts over another copy of the bytes (the one mapped back from the cache)."""
        return native_experts(packed, self.n_expert, self.n_out)


def native_experts(packed: PackedWeight, n_expert: int, n_out: int) -> NativeExperts:
    step = packed.data.size // n_expert
    structs = [kernels.c_weight(replace(packed, n_rows=n_out, data=packed.data[e * step:(e + 1) * step]))
               for e in range(n_expert)]
    return NativeExperts(packed, n_expert, n_out, structs)


