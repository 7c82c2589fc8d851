"""Weight storage of the numpy backend: float32, dequantized once at load, in the layout BLAS streams fastest.

An embedding table used only for row lookups stays in its quantized form (:class:`QuantizedTable`) and rows are
decoded on demand, and so are the expert tensors of a mixture of experts (:class:`QuantizedExperts`, one
expert's matrix when a token picks it); tensors with the same file source (a tied output head and embedding) share one float32 copy;
:meth:`NumpyWeights.fuse_weights` lays the parts of a fused matmul side by side (the package docstring
says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from llmfw.core.exec.backend import Backend, BackendOptions, WeightSource, release_freed_memory
from llmfw.core.format.quants import GGMLType, dequantize, dequantize_rows, tensor_nbytes
from llmfw.plugins.backends.numpy.kernels import F32


@dataclass
class RawBlocks:
    """A tensor kept as the file's blocks (``ne``: ggml's shape; :attr:`shape`: numpy's)."""

    raw: np.ndarray
    ggml_type: int
    ne: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


class QuantizedTable(RawBlocks):
    """A quantized embedding table kept as raw blocks; rows are dequantized when looked up."""


class QuantizedExperts(RawBlocks):
    """A 3-D ``*_exps`` tensor [E, n_out, n_in] kept as the file's blocks (a mapping of the file where the loader
    gives one: only the experts used become resident); ``experts[e]`` decodes expert ``e``'s matrix when a
    ``mul_mat_id`` picks it. A float32 copy of every expert would be 2-8x the file's size, most of it never read
    for a given prompt: numpy is the oracle, so memory wins over the decode time spent here."""

    def __getitem__(self, expert: int) -> np.ndarray:
        n_in, n_out = int(self.ne[0]), int(self.ne[1])
        step = tensor_nbytes(self.ggml_type, (n_in, n_out))
        return dequantize(self.raw[expert * step:(expert + 1) * step], self.ggml_type, (n_in, n_out))


def is_stored_transposed(array: np.ndarray) -> bool:
    """Whether a matrix handle is the transposed view of a C-contiguous ``[n_in, n_out]`` array."""
    return array.ndim == 2 and array.T.flags.c_contiguous


def get_rows(table: Any, ids: np.ndarray) -> np.ndarray:
    """Rows ``ids`` of a stored table (a float32 array in either layout, or a :class:`QuantizedTable`), float32."""
    if isinstance(table, QuantizedTable):
        return dequantize_rows(table.raw, table.ggml_type, table.ne, ids)
    ids = np.asarray(ids, dtype=np.intp)
    if is_stored_transposed(table) and not table.flags.c_contiguous:
        # a matrix stored transposed for the matmuls: gather along the contiguous axis, then lay rows out
        return np.ascontiguousarray(table.T[:, ids].T, dtype=F32)
    return np.asarray(table[ids], dtype=F32)


class NumpyWeights(Backend):
    """The weight half of the numpy backend (a base class of :class:`~llmfw.plugins.backends.numpy.NumpyBackend`):
    ``load_weight``, ``fuse_weights`` and ``free_weights`` over float32 arrays and quantized lookup tables."""

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device, options)
        #: float32 copies shared by tensors with the same file source (tied output head + embedding)
        self._dense_by_source: dict[str, np.ndarray] = {}

    # -- weights ------------------------------------------------------------------------------------------
    def load_weight(self, source: WeightSource) -> Any:
        qtype = GGMLType(source.ggml_type)
        lookup_only = source.usage == frozenset({"get_rows"})
        if lookup_only and qtype not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            # rows decoded on demand: a quantized table stays ~4-8x smaller than float32, and mapped from the file
            # it costs only the rows looked up
            return QuantizedTable(source.kept_raw(), int(qtype), source.ne)
        if "mul_mat_id" in source.usage and len(source.ne) == 3:
            return QuantizedExperts(source.kept_raw(), int(qtype), source.ne)
        # a matrix multiplied with activations is stored in the layout its one-token product streams fastest
        # (see the module docstring); the handle keeps the contract's [n_out, n_in] shape either way
        transposed = "mul_mat" in source.usage and len(source.ne) == 2 and source.ne[1] >= source.ne[0]
        shared = self._dense_by_source.get(source.source_name)
        if shared is not None and shared.shape == source.numpy_shape:
            if transposed and not is_stored_transposed(shared):  # shared with a lookup table loaded before
                self._rebind(shared, np.ascontiguousarray(shared.T).T)
                shared = self._dense_by_source[source.source_name]
            return shared
        dense = np.asarray(dequantize(source.raw, qtype, source.ne), dtype=F32)
        dense = np.ascontiguousarray(dense.T).T if transposed else np.ascontiguousarray(dense)
        if np.shares_memory(dense, source.raw):  # F32 tensors may come back as views of the mmap
            dense = dense.copy(order="K")
        self._dense_by_source[source.source_name] = dense
        return dense

    def resident_bytes(self, ggml_type: int, ne: tuple[int, ...], usage: frozenset[str], file_bytes: int) -> int:
        """float32 for what is dequantized at load; the file's bytes for experts and quantized lookup tables."""
        kept_quantized = ("mul_mat_id" in usage and len(ne) == 3) or (
            usage == frozenset({"get_rows"}) and ggml_type not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16))
        return file_bytes if kept_quantized else 4 * int(np.prod(ne, dtype=np.int64))

    def _rebind(self, old: np.ndarray, new: np.ndarray) -> None:
        """Point every weight name (and source) whose handle is ``old`` to ``new`` (same values, new storage),
        so that ``old`` is freed."""
        for name, handle in list(self.weights.items()):
            if handle is old:
                self.weights[name] = new
        for source, dense in list(self._dense_by_source.items()):
            if dense is old:
                self._dense_by_source[source] = new

    def free_weights(self) -> None:
        super().free_weights()
        self._dense_by_source.clear()

    def fuse_weights(self, name: str, parts: tuple[str, ...]) -> bool:
        """The dense parts stored transposed side by side, ``[n_in, Σ n_out]`` C-contiguous (one GEMM for all);
        the handle is its transpose, of the contract's shape. The parts' handles become views into it, so their
        separate copies are freed and the memory stays the same. Quantized tables cannot be fused."""
        members = [self.weights.get(n) for n in parts]
        if not all(isinstance(m, np.ndarray) and m.ndim == 2 and m.dtype == F32 for m in members):
            return False
        dense = [m for m in members if isinstance(m, np.ndarray)]
        if len({m.shape[1] for m in dense}) != 1:
            return False
        fused = np.concatenate([m.T for m in dense], axis=1)
        start = 0
        for member in dense:
            self._rebind(member, fused[:, start:start + member.shape[0]].T)
            start += member.shape[0]
        self.weights[name] = fused.T
        release_freed_memory()  # the members' separate copies were freed
        return True
