"""GGUF's value types and constants, shared by the reader (:mod:`.gguf`) and the writer (:mod:`.gguf_writer`)."""
from __future__ import annotations

import struct
from enum import IntEnum

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the terminating NUL
MAX_ARRAY_NESTING = 8  # arrays of arrays deeper than this are rejected (bounds recursion)
INT64_MAX = 2**63 - 1
KEY_ALIGNMENT = "general.alignment"
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS = "split.tensors.count"


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


#: little-endian numpy dtype of every fixed-size value type
NUMPY_DTYPE: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("u1"),
    GGUFValueType.INT8: np.dtype("i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
STRUCT: dict[GGUFValueType, struct.Struct] = {
    t: struct.Struct("<" + {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "f4": "f",
                            "u8": "Q", "i8": "q", "f8": "d"}[d.str[1:]])
    for t, d in NUMPY_DTYPE.items()
}
U32 = STRUCT[GGUFValueType.UINT32]
U64 = STRUCT[GGUFValueType.UINT64]
#: the range of every integer value type
INT_RANGES = {
    GGUFValueType.UINT8: (0, 2**8 - 1), GGUFValueType.INT8: (-(2**7), 2**7 - 1),
    GGUFValueType.UINT16: (0, 2**16 - 1), GGUFValueType.INT16: (-(2**15), 2**15 - 1),
    GGUFValueType.UINT32: (0, 2**32 - 1), GGUFValueType.INT32: (-(2**31), 2**31 - 1),
    GGUFValueType.UINT64: (0, 2**64 - 1), GGUFValueType.INT64: (-(2**63), 2**63 - 1),
}


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def split_file_name(prefix: str, index: int, count: int) -> str:
    """llama.cpp's split naming: ``prefix-00001-of-00003.gguf`` for ``index`` 0 of 3."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"
