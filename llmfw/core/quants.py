"""ggml tensor types: block sizes and byte sizes, vectorised numpy (de)quantization.

Shapes follow ggml: ``ne = (ne0, ne1, ...)`` with ``ne0`` the contiguous dimension; a tensor of ``ne`` is the
numpy array of shape ``tuple(reversed(ne))``. Quantized types pack ``block_size`` consecutive elements of a row
into ``type_size`` bytes, so ``ne0`` must be a multiple of ``block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .errors import QuantError


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


@dataclass(frozen=True)
class TypeInfo:
    block_size: int  # elements per block
    type_size: int  # bytes per block

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size


QK_K = 256

TYPE_INFO: dict[GGMLType, TypeInfo] = {
    GGMLType.F32: TypeInfo(1, 4),
    GGMLType.F16: TypeInfo(1, 2),
    GGMLType.BF16: TypeInfo(1, 2),
    GGMLType.F64: TypeInfo(1, 8),
    GGMLType.I8: TypeInfo(1, 1),
    GGMLType.I16: TypeInfo(1, 2),
    GGMLType.I32: TypeInfo(1, 4),
    GGMLType.I64: TypeInfo(1, 8),
    GGMLType.Q4_0: TypeInfo(32, 2 + 16),
    GGMLType.Q4_1: TypeInfo(32, 2 + 2 + 16),
    GGMLType.Q5_0: TypeInfo(32, 2 + 4 + 16),
    GGMLType.Q5_1: TypeInfo(32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: TypeInfo(32, 2 + 32),
    GGMLType.Q8_1: TypeInfo(32, 4 + 4 + 32),
    GGMLType.Q2_K: TypeInfo(QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    GGMLType.Q3_K: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    GGMLType.Q4_K: TypeInfo(QK_K, 2 + 2 + QK_K // 2 + 12),
    GGMLType.Q5_K: TypeInfo(QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    GGMLType.Q6_K: TypeInfo(QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    GGMLType.Q8_K: TypeInfo(QK_K, 4 + QK_K + QK_K // 16 * 2),
    GGMLType.IQ2_XXS: TypeInfo(QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ1_S: TypeInfo(QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: TypeInfo(32, 2 + 16),
    GGMLType.IQ3_S: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: TypeInfo(QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: TypeInfo(QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType.IQ1_M: TypeInfo(QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.TQ1_0: TypeInfo(QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0: TypeInfo(QK_K, 2 + 64),
    GGMLType.MXFP4: TypeInfo(32, 1 + 16),
}


def ggml_type(value: int | GGMLType) -> GGMLType:
    """The GGMLType for a raw type id, or QuantError naming the unknown id."""
    try:
        return GGMLType(int(value))
    except ValueError:
        raise QuantError(f"unknown ggml tensor type id {value}") from None


def type_info(t: int | GGMLType) -> TypeInfo:
    return TYPE_INFO[ggml_type(t)]


def tensor_nbytes(t: int | GGMLType, ne: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of type ``t`` and ggml shape ``ne``; QuantError if ``ne0`` is not whole blocks."""
    info = type_info(t)
    n_elements = 1
    for dim in ne:
        n_elements *= int(dim)
    if ne and int(ne[0]) % info.block_size:
        raise QuantError(f"{ggml_type(t).name}: row length {ne[0]} is not a multiple of the block size "
                         f"{info.block_size}")
    return n_elements // info.block_size * info.type_size
