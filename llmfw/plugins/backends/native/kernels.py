"""The bridge to the C kernels (csrc/): the extension is opened with ctypes, which releases the GIL for each call.

``load_library()`` raises :class:`BackendUnavailable` with the reason when the extension was not built (an install
without a working C compiler) — what ``llmfw plugins`` and ``-v`` report. ISA paths: ``scalar`` (portable C,
always), ``avx2`` (AVX2+FMA+F16C), ``avx512`` (AVX-512 F/BW/VL + VNNI), ``amx`` (``avx512`` with the AMX tile unit
taking a batched matmul's integer dot products: Linux, AMX-TILE + AMX-INT8 that run); :func:`available_isas` says which
this CPU runs, :func:`resolve_isa` turns the ``isa`` option into one of them."""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
from typing import Any

import numpy as np

from llmfw.core.errors import BackendUnavailable, ConfigError, LLMFWError
from llmfw.plugins.backends.native.repack import BLOCK, QUANTIZED_KINDS, PackedWeight

EXTENSION = "llmfw.plugins.backends.native._native"
ABI_VERSION = 16
#: the path of a build of the extension to load instead of the installed one (the sanitizer run,
#: benchmarks/native_sanitizers.sh)
LIBRARY_VARIABLE = "LLMFW_NATIVE_LIBRARY"
#: what to do when the extension is missing
BUILD_HINT = "its C extension is not built: install gcc and the Python headers, then reinstall llmfw (pip install -e .)"
#: sizeof(nat_instr) (csrc/native.h; program.INSTR is the same record)
INSTR_BYTES = 280
ISAS = ("scalar", "avx2", "avx512", "amx")  # the index is enum nat_isa
#: the order ``isa: auto`` prefers (the widest path this CPU runs)
AUTO_ORDER = ("amx", "avx512", "avx2", "scalar")


class NatWeight(ctypes.Structure):
    """``nat_weight`` (csrc/native.h)."""

    _fields_ = [("kind", ctypes.c_int32), ("n_scales", ctypes.c_int32), ("has_offsets", ctypes.c_int32),
                ("half_params", ctypes.c_int32), ("n_rows", ctypes.c_int64), ("n_cols", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("table", ctypes.c_int8 * 16), ("factored", ctypes.c_int32),
                ("paired", ctypes.c_int32)]


class NativeError(LLMFWError):
    """A native kernel call failed (out of memory for its activation buffers)."""


@functools.lru_cache(maxsize=1)
def load_library() -> Any:
    """The extension as a ctypes library with typed functions (BackendUnavailable when it is not built)."""
    override = os.environ.get(LIBRARY_VARIABLE)
    if override:
        return _typed(_open(override))
    spec = importlib.util.find_spec(EXTENSION)
    if spec is None or not spec.origin:
        raise BackendUnavailable(f"native backend: {BUILD_HINT} (the install found no working C compiler, or the "
                                 "build failed)")
    return _typed(_open(spec.origin))


def _open(path: str) -> Any:
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        raise BackendUnavailable(f"the native backend's C extension cannot be loaded: {exc}") from None


def _typed(lib: Any) -> Any:
    """``lib`` with the argument and result types of the functions this module calls."""
    lib.nat_abi_version.restype = ctypes.c_int
    if lib.nat_abi_version() != ABI_VERSION:
        raise BackendUnavailable("the native backend's C extension is stale (ABI version "
                                 f"{lib.nat_abi_version()}, expected {ABI_VERSION}); rebuild it (pip install -e .)")
    lib.nat_cpu_isas.restype = ctypes.c_int
    lib.nat_pool_new.restype = ctypes.c_void_p
    lib.nat_pool_new.argtypes = [ctypes.c_int]
    lib.nat_pool_free.argtypes = [ctypes.c_void_p]
    lib.nat_pool_free.restype = None
    lib.nat_rms_norm.restype = None
    lib.nat_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_float]
    lib.nat_attention.restype = ctypes.c_int
    lib.nat_attention.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7
                                  + [ctypes.c_float] * 2 + [ctypes.c_int64])
    lib.nat_instr_bytes.restype = ctypes.c_int64
    if lib.nat_instr_bytes() != INSTR_BYTES:
        raise BackendUnavailable(f"the native backend's C extension has {lib.nat_instr_bytes()}-byte instructions, "
                                 f"this module {INSTR_BYTES}: rebuild it (pip install -e .)")
    lib.nat_program_run.restype = ctypes.c_int
    lib.nat_program_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.nat_mul_mat.restype = ctypes.c_int
    lib.nat_mul_mat.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(NatWeight), ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_void_p]
    lib.nat_act_words.restype = ctypes.c_size_t
    lib.nat_act_words.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@functools.lru_cache(maxsize=1)
def available_isas() -> tuple[str, ...]:
    """The ISA paths this CPU runs in this build (scalar always); asked once a process, as the AMX check runs its
    instructions in a child process."""
    mask = load_library().nat_cpu_isas()
    return tuple(name for index, name in enumerate(ISAS) if mask & (1 << index))


def resolve_isa(wanted: str) -> str:
    """``auto`` → the widest path this CPU runs; a named path → itself, or ConfigError when this CPU lacks it."""
    here = available_isas()
    if wanted == "auto":
        return next(name for name in AUTO_ORDER if name in here)
    if wanted not in here:
        raise ConfigError(f"native backend: isa {wanted!r} cannot run on this CPU (it runs: {', '.join(here)})")
    return wanted


class ThreadPool:
    """A persistent pool in C: the caller and ``n_threads - 1`` workers (none for one thread), which claim chunks of
    each op and sleep on a futex between ops after a brief spin (csrc/pool.c)."""

    def __init__(self, n_threads: int):
        self._lib = load_library()
        self.n_threads = max(1, int(n_threads))
        self._handle = self._lib.nat_pool_new(self.n_threads)
        if not self._handle:
            raise NativeError("native backend: cannot create its thread pool")

    @property
    def handle(self) -> int:
        return int(self._handle)

    def close(self) -> None:
        if self._handle:
            self._lib.nat_pool_free(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


def c_weight(weight: PackedWeight) -> NatWeight:
    """The ``nat_weight`` describing ``weight`` (which must outlive it: it points into ``weight.data``)."""
    table = (ctypes.c_int8 * 16)(*(int(v) for v in weight.table))
    return NatWeight(weight.kind, weight.n_scales, int(weight.has_offsets), int(weight.half_params), weight.n_rows,
                     weight.n_cols, weight.data.ctypes.data, table, int(weight.factored), int(weight.paired))


def mul_mat(weight: PackedWeight, x: np.ndarray, pool: ThreadPool, isa: str,
            c_struct: NatWeight | None = None) -> np.ndarray:
    """``x @ W.T`` for x [..., n_cols] float32 → [..., n_rows] float32."""
    if x.shape[-1] != weight.n_cols:
        raise ValueError(f"native mul_mat: input has {x.shape[-1]} columns, the weight {weight.n_cols}")
    if weight.kind in QUANTIZED_KINDS and weight.n_cols % BLOCK:
        raise ValueError(f"native mul_mat: {weight.n_cols} columns are not whole blocks of {BLOCK}")
    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, weight.n_cols)
    out = np.empty((rows.shape[0], weight.n_rows), dtype=np.float32)
    if rows.shape[0]:
        struct = c_struct if c_struct is not None else c_weight(weight)
        status = load_library().nat_mul_mat(pool.handle, ISAS.index(isa), ctypes.byref(struct), rows.ctypes.data,
                                            rows.shape[0], out.ctypes.data)
        if status != 0:
            raise NativeError(f"native mul_mat failed (status {status}: out of memory for its activation buffers)")
    return out.reshape(*x.shape[:-1], weight.n_rows)


def _f32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


def rms_norm(x: np.ndarray, eps: float, weight: np.ndarray | None, pool: ThreadPool) -> np.ndarray:
    """``x / sqrt(mean(x²) + eps)`` over the last axis (× weight), each row alone (sum of squares in double)."""
    x = _f32(x)
    n = x.shape[-1]
    if weight is not None:
        weight = _f32(weight)
        if weight.shape != (n,):
            raise ValueError(f"native rms_norm: weight of shape {weight.shape} for rows of {n}")
    out = np.empty_like(x)
    load_library().nat_rms_norm(pool.handle, x.ctypes.data, None if weight is None else weight.ctypes.data,
                                out.ctypes.data, x.size // max(n, 1), n, eps)
    return out


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, mask: np.ndarray, scale: float,
              softcap: float, pool: ThreadPool, isa: str = "auto", sinks: np.ndarray | None = None,
              order: np.ndarray | None = None) -> np.ndarray:
    """softmax(softcap(scale·q·Kᵀ) + mask)·V over the cache's first ``mask.shape[1]`` cells, GQA by head groups
    (with ``sinks`` [H], a sink logit per head in the softmax's denominator): q [T, H, Dk], caches [Hkv, n_cells, D]
    (float32 or float16, both the same, C-contiguous), mask [T, n_kv] → [T, H*Dv], on ISA path ``isa`` (``auto``:
    the widest here). ``order`` [n_kv]: the cells in the order their terms are summed (the graph's ``kv_order``;
    None: cell order)."""
    q, mask = _f32(q), _f32(mask)
    n_tokens, n_head, dk = q.shape
    n_head_kv, n_cells, dv = v_cache.shape
    n_kv = mask.shape[1]
    for cache in (k_cache, v_cache):  # the C code indexes them directly: no copy, so check before it reads
        if cache.dtype not in (np.float32, np.float16) or cache.dtype != k_cache.dtype or not cache.flags.c_contiguous:
            raise ValueError("native attention: the KV cache must be C-contiguous float32 or float16 (K and V alike)")
    if sinks is not None:
        sinks = _f32(sinks)
    if order is not None:
        order = np.ascontiguousarray(order, dtype=np.int32)
    if (k_cache.shape != (n_head_kv, n_cells, dk) or mask.shape[0] != n_tokens or n_kv > n_cells
            or n_head_kv == 0 or n_head % n_head_kv or (sinks is not None and sinks.shape != (n_head,))
            or (order is not None and order.shape != (mask.shape[1],))):
        raise ValueError(f"native attention: q {q.shape}, K {k_cache.shape}, V {v_cache.shape}, mask {mask.shape} "
                         "do not fit")
    out = np.empty((n_tokens, n_head * dv), dtype=np.float32)
    status = load_library().nat_attention(pool.handle, ISAS.index(resolve_isa(isa)), q.ctypes.data,
                                          k_cache.ctypes.data, v_cache.ctypes.data, mask.ctypes.data,
                                          None if sinks is None else sinks.ctypes.data,
                                          None if order is None else order.ctypes.data, out.ctypes.data, n_tokens,
                                          n_head, n_head_kv, dk, dv, n_kv, n_cells, scale, softcap,
                                          int(k_cache.dtype == np.float16))
    if status == -3:
        raise NativeError(f"native attention: a cell of the order outside 0..{n_kv - 1}")
    if status != 0:
        raise NativeError("native attention: out of memory for its score buffers")
    return out
