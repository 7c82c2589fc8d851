"""Helpers of the native backend's tests: random GGUF blocks of every type the kernels take, and the extension
(the tests fail, not skip, when a machine with a C compiler has not built it)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from llmfw.core.quants import TYPE_INFO, GGMLType, quantize

from support.block_fields import F16_FIELDS  # byte offsets of each block type's f16 scale fields

#: every block type the kernels take: those with f16 scale fields, and MXFP4 (an 8-bit E8M0 exponent per block)
BLOCK_TYPES = tuple(F16_FIELDS) + (GGMLType.MXFP4,)
#: MXFP4's exponent whose scale, 2**127, makes every value of magnitude 1 or more (codes 2..7, 10..15) overflow
MXFP4_OVERFLOW = 255
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)


def kernels_or_skip():
    """The kernels module with its library loaded; skip only where no C compiler exists to build it."""
    from llmfw.core.errors import BackendUnavailable
    from llmfw.plugins.backends.native import kernels

    try:
        kernels.load_library()
    except BackendUnavailable:
        if shutil.which("cc") or shutil.which("gcc"):
            raise  # a compiler is here: the install must have built it
        pytest.skip("no C compiler on this machine: the native extension cannot be built")
    return kernels


def random_blocks(qtype: GGMLType, n_rows: int, n_blocks: int, rng: np.random.Generator,
                  scale: float = 0.02) -> np.ndarray:
    """Raw bytes of a [n_rows, n_blocks * block_size] tensor: random codes, finite random scales."""
    info = TYPE_INFO[qtype]
    raw = rng.integers(0, 256, (n_rows, n_blocks, info.type_size), dtype=np.uint8)
    if qtype == GGMLType.MXFP4:  # exponents around ``scale``'s: 2**(e - 128) within 2**±4 of it
        centre = int(np.log2(scale)) + 128
        raw[..., 0] = rng.integers(centre - 4, centre + 5, (n_rows, n_blocks), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, []):
        values = (rng.standard_normal((n_rows, n_blocks)) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = values.view(np.uint8).reshape(n_rows, n_blocks, 2)
    return raw.reshape(-1)


def random_float_tensor(qtype: GGMLType, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    return quantize(rng.standard_normal((n_rows, n_cols)).astype(np.float32), qtype).reshape(-1)
