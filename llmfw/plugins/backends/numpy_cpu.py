"""The numpy CPU backend: every graph op in float32, the reference implementation (the oracle).

Weights are dequantized to float32 once at load; an embedding table used only for row lookups stays in its
quantized form and rows are decoded on demand (``dequantize_rows``), which saves memory when the output head is
not tied to it (or lives on another backend). The KV cache of a layer is two preallocated float32 arrays
``[n_head_kv, n_cells, head_dim]`` written in place, so a decode step allocates nothing cache-sized.

Speed (measured on a 2-core AVX2 machine with OpenBLAS, see ``benchmarks/numpy_decode.py``):

* a matrix multiplied with activations that has at least as many outputs as inputs (Q, gate/up, the output
  head) is stored *transposed*, ``Wt = W.T`` C-contiguous ``[n_in, n_out]``; its handle is the view ``Wt.T``,
  so it still has the contract's shape ``[n_out, n_in]``. For one token ``x @ Wt`` (OpenBLAS ``gemv_n``)
  streams such a matrix up to 1.7x faster than ``x @ W.T`` (``gemv_t``), which in turn is ~1.4x faster for
  the narrow ``ffn_down`` (n_in > n_out), kept as in the file. Both are equally fast for a prefill.
* :meth:`NumpyBackend.compile` maps the core's optimised graph to kernels: a flat list of closures over a slot
  list (no dict look-ups per op). The core passes (``llmfw.core.passes``) already fused the matmuls that share an
  input (Q/K/V, gate/up) into one GEMM over a weight this backend concatenated once at load
  (:meth:`NumpyBackend.fuse_weights`), folded each norm's weight into it, applied this backend's rewrite rule
  ``swiglu`` and marked each value's last use, after which its slot is freed (a prefill's activations are not
  all alive at once). Rope tables are computed once per run for all layers.
* attention skips the KV cells that no query of a block of rows can see (the causal half of a prefill, the
  padding of ``n_kv``): their probabilities are exactly zero, so the result is the same.

With one BLAS thread, a SmolLM2-135M decode step is now ~90% weight streaming (the 536 MB of float32 weights at
~11-14 GB/s, ~48 ms of CPU) — the bound of an exact float32 engine on one core; the rest is ~5 ms of attention,
norms, rope and Python. A 512-token prefill is ~70% GEMM (~65 GFLOP/s), ~20% attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from llmfw.core.backend import (Backend, BackendOptions, CompiledSplit, KVLayerShape, Split, WeightSource,
                                release_freed_memory)
from llmfw.core.errors import ModelError
from llmfw.core.graph import OPS, Node
from llmfw.core.passes import ANY, Pattern, RewriteRule
from llmfw.core.quants import GGMLType, dequantize, dequantize_rows
from llmfw.core.rope import rope_cos_sin, yarn_corr_dims  # noqa: F401 - re-exported for tests

F32 = np.float32
F64 = np.float64

#: query rows per attention block: small enough that the block's scores stay in cache and that a causal
#: prefill skips most of its masked half, large enough that the per-block Python overhead stays small
ATTN_BLOCK_ROWS = 64


@dataclass
class QuantizedTable:
    """A quantized embedding table kept as raw blocks; rows are dequantized when looked up."""

    raw: np.ndarray
    ggml_type: int
    ne: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


@dataclass
class NumpyKV:
    """K and V storage of one layer: ``[n_head_kv, n_cells, head_dim]`` (per-head slices are contiguous)."""

    k: np.ndarray
    v: np.ndarray


# ---------------------------------------------------------------------------------------------------------
# op kernels (pure functions of numpy arrays; also used by other backends' tests as the oracle)
# ---------------------------------------------------------------------------------------------------------

def rms_norm(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    """``x / sqrt(mean(x²) + eps)`` (then ``* weight`` when given, rounded after the normalisation like ggml).

    ggml accumulates the sum of squares in double; a batched float64 matmul does the same and is ~10x faster
    than ``einsum(..., dtype=float64)``."""
    n = x.shape[-1]
    if x.size == n:  # one row (a decode step): the scale in Python floats (doubles), 4 array ops in all
        row = x.reshape(n).astype(F64)
        out = x * F32(1.0 / math.sqrt(float(np.dot(row, row)) / n + eps))
    else:
        rows = x.reshape(-1, n).astype(F64)
        sum_sq = np.matmul(rows[:, None, :], rows[:, :, None]).reshape(x.shape[:-1] + (1,))
        sum_sq /= n
        sum_sq += eps
        np.sqrt(sum_sq, out=sum_sq)
        out = x * np.divide(1.0, sum_sq, out=sum_sq).astype(F32)
    if weight is not None:
        if weight.ndim == 1 and weight.dtype == F32 and weight.shape[0] == out.shape[-1]:
            out *= weight  # the common case: a per-channel norm weight, in place
        else:
            out = out * weight
    return out


def layer_norm(x: np.ndarray, eps: float, weight: np.ndarray | None = None) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps)`` over the last axis (then ``* weight`` when given)."""
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float64).astype(F32)
    centered = x - mean
    var = np.mean(np.square(centered), axis=-1, keepdims=True, dtype=np.float64)
    out = (centered * (1.0 / np.sqrt(var + eps)).astype(F32)).astype(F32, copy=False)
    return out if weight is None else out * weight


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = np.negative(x)
        np.exp(out, out=out)
        out += F32(1.0)
        return np.divide(x, out, out=out)


def gelu(x: np.ndarray) -> np.ndarray:
    c = F32(math.sqrt(2.0 / math.pi))
    return F32(0.5) * x * (F32(1.0) + np.tanh(c * (x + F32(0.044715) * x * x * x)))


def rope_apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_dims: int, mode: str) -> np.ndarray:
    """Rotate the first n_dims of the last axis of x [T, H, D] (NORM: adjacent pairs, NEOX: halves)."""
    out = np.array(x, dtype=F32, copy=True)
    c = cos[:, None, :]
    s = sin[:, None, :]
    if mode == "neox":
        half = n_dims // 2
        x0 = x[..., :half]
        x1 = x[..., half:n_dims]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:n_dims] = x0 * s + x1 * c
    else:
        x0 = x[..., 0:n_dims:2]
        x1 = x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = x0 * c - x1 * s
        out[..., 1:n_dims:2] = x0 * s + x1 * c
    return out


@dataclass
class RopeTable:
    """Per-run rotation factors for :func:`rope_apply_full`: ``x·C + partner(x)·S`` over the whole last axis.

    ``C`` repeats cos for both members of a pair; ``S`` is ``-sin`` for the first member and ``+sin`` for the
    second, so ``x0·c + x1·(-s)`` equals ``rope_apply``'s ``x0·c - x1·s`` bit for bit (and ``x1·c + x0·s`` its
    ``x0·s + x1·c``: float addition commutes)."""

    cos: np.ndarray
    sin: np.ndarray
    full_c: np.ndarray  # [T, 1, n_dims]
    full_s: np.ndarray  # [T, 1, n_dims]


def rope_table(cos: np.ndarray, sin: np.ndarray, mode: str) -> RopeTable:
    if mode == "neox":
        full_c = np.concatenate([cos, cos], axis=-1)
        full_s = np.concatenate([-sin, sin], axis=-1)
    else:
        full_c = np.repeat(cos, 2, axis=-1)
        full_s = np.stack([-sin, sin], axis=-1).reshape(cos.shape[0], -1)
    return RopeTable(cos, sin, full_c[:, None, :], full_s[:, None, :])


def rope_apply_full(x: np.ndarray, table: RopeTable, n_dims: int, mode: str) -> np.ndarray:
    """:func:`rope_apply` in 5 array operations instead of ~10 when every dimension rotates (n_dims == D)."""
    if n_dims != x.shape[-1]:
        return rope_apply(x, table.cos, table.sin, n_dims, mode)
    if mode == "neox":
        half = n_dims // 2
        partner = np.empty(x.shape, dtype=F32)
        partner[..., :half] = x[..., half:]
        partner[..., half:] = x[..., :half]
    else:
        # a copy (np.array), never a view of x: it is scaled in place below
        partner = np.array(x.reshape(x.shape[:-1] + (n_dims // 2, 2))[..., ::-1], dtype=F32).reshape(x.shape)
    out = np.multiply(x, table.full_c, dtype=F32)
    partner *= table.full_s
    out += partner
    return out


def visible_limits(mask: np.ndarray, block: int = ATTN_BLOCK_ROWS) -> list[tuple[int, int, int]]:
    """``(row_start, row_stop, n_cols)`` per block of mask rows: cells at or past ``n_cols`` are hidden (-inf)
    from every row of the block, so attention may skip them (at least one column is kept, so that a fully
    masked row still gives NaN like the full computation)."""
    n_tokens, n_kv = mask.shape
    visible_cols = np.isfinite(mask)
    limits = []
    for start in range(0, n_tokens, block):
        stop = min(start + block, n_tokens)
        any_visible = visible_cols[start:stop].any(axis=0)
        last = int(np.flatnonzero(any_visible)[-1]) + 1 if any_visible.any() else 1
        limits.append((start, stop, min(max(last, 1), n_kv)))
    return limits


def attention(q: np.ndarray, kv: NumpyKV, n_kv: int, mask: np.ndarray, scale: float,
              softcap: float, limits: list[tuple[int, int, int]] | None = None) -> np.ndarray:
    """softmax(softcap(scale·q·Kᵀ) + mask)·V over cells 0..n_kv-1, GQA by head groups → [T, H*Dv].

    ``limits`` (from :func:`visible_limits` of ``mask``; computed when omitted) lets each block of query rows
    skip the cells none of its rows can see."""
    n_tokens, n_head, _ = q.shape
    dv = kv.v.shape[-1]
    if limits is None:
        limits = visible_limits(mask[:, :n_kv])
    # the scale is applied to q (small) rather than to the scores (large): the same product up to rounding
    q = np.multiply(q, F32(scale), dtype=F32)
    if n_tokens == 1:
        return _attention_block(q, kv, limits[0][2], mask, softcap).reshape(1, n_head * dv)
    out = np.empty((n_tokens, n_head * dv), dtype=F32)
    for start, stop, n_cols in limits:
        out[start:stop] = _attention_block(q[start:stop], kv, n_cols, mask[start:stop], softcap)
    return out


def _attention_block(q: np.ndarray, kv: NumpyKV, n_cols: int, mask: np.ndarray, softcap: float) -> np.ndarray:
    """Attention of the (already scaled) query rows ``q`` [t, H, Dk] over cache cells ``0..n_cols-1`` → [t, H*Dv]."""
    n_tokens, n_head, _ = q.shape
    qg = group_queries(q, kv.k.shape[0])
    scores = np.matmul(qg, kv.k[:, :n_cols].transpose(0, 2, 1))  # [Hkv, G*t, n]
    masked_exp(scores, mask[:, :n_cols], softcap, n_tokens)
    denominators = scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, kv.v[:, :n_cols])  # [Hkv, G*t, Dv]
    out /= denominators  # normalise after the product: Dv columns instead of n_kv
    return ungroup_heads(out, n_tokens)


def group_queries(q: np.ndarray, n_head_kv: int) -> np.ndarray:
    """[t, H, D] → [Hkv, G*t, D]: each KV head becomes one matmul over all its query heads and tokens (a free
    reshape for one token)."""
    n_tokens, n_head, head_dim = q.shape
    group = n_head // n_head_kv
    if n_tokens == 1:
        return q.reshape(n_head_kv, group, head_dim)
    return q.reshape(n_tokens, n_head_kv, group, head_dim).transpose(1, 2, 0, 3).reshape(
        n_head_kv, group * n_tokens, head_dim)


def ungroup_heads(out: np.ndarray, n_tokens: int) -> np.ndarray:
    """[Hkv, G*t, Dv] → [t, H*Dv], the inverse of :func:`group_queries`."""
    n_head_kv, rows, dv = out.shape
    if n_tokens == 1:
        return out.reshape(1, n_head_kv * rows * dv)
    return out.reshape(n_head_kv, rows // n_tokens, n_tokens, dv).transpose(2, 0, 1, 3).reshape(n_tokens, -1)


def masked_exp(scores: np.ndarray, mask: np.ndarray, softcap: float, n_tokens: int) -> None:
    """In place: ``exp(softcap(scores) + mask - rowmax)`` — the unnormalised softmax of grouped scores
    [Hkv, G*t, n] under the mask [t, n]."""
    if softcap:
        scores /= F32(softcap)
        np.tanh(scores, out=scores)
        scores *= F32(softcap)
    n_head_kv, rows, n_cols = scores.shape
    scores4 = scores.reshape(n_head_kv, rows // n_tokens, n_tokens, n_cols)
    scores4 += mask
    scores4 -= scores4.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)


def write_kv(kv: NumpyKV, k: np.ndarray, v: np.ndarray, idx: np.ndarray) -> None:
    kv.k[:, idx, :] = k.transpose(1, 0, 2)
    kv.v[:, idx, :] = v.transpose(1, 0, 2)


def get_rows(table: Any, ids: np.ndarray) -> np.ndarray:
    if isinstance(table, QuantizedTable):
        return dequantize_rows(table.raw, table.ggml_type, table.ne, ids)
    ids = np.asarray(ids, dtype=np.intp)
    if _is_stored_transposed(table) and not table.flags.c_contiguous:
        # a matrix stored transposed for the matmuls: gather along the contiguous axis, then lay rows out
        return np.ascontiguousarray(table.T[:, ids].T, dtype=F32)
    return np.asarray(table[ids], dtype=F32)


def _is_stored_transposed(array: np.ndarray) -> bool:
    return array.ndim == 2 and array.T.flags.c_contiguous


# ---------------------------------------------------------------------------------------------------------
# BLAS threads
# ---------------------------------------------------------------------------------------------------------

_BLAS_SET_THREADS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads", "MKL_Set_Num_Threads")
_blas_setter: Any = None


def _find_blas_setter() -> Any:
    """The loaded BLAS library's set-num-threads function (OpenBLAS / MKL), found in /proc/self/maps."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "blas" in line.lower() or "mkl" in line.lower()}
    except OSError:
        return None
    for path in sorted(paths):
        if not path.startswith("/"):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in _BLAS_SET_THREADS:
            fn = getattr(lib, symbol, None)
            if fn is not None:
                return fn
    return None


def set_blas_threads(n_threads: int) -> bool:
    """Limit numpy's BLAS to ``n_threads`` (process-wide). On an oversubscribed CPU, BLAS threads that spin
    while waiting for each other make small matmuls 10x slower; one thread per context avoids that."""
    global _blas_setter
    if _blas_setter is None:
        _blas_setter = _find_blas_setter() or False
    if not _blas_setter:
        return False
    import ctypes

    _blas_setter(ctypes.c_int(int(n_threads)))
    return True


# ---------------------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------------------

#: the rewrite rule this backend declares: the gated FFN's ``silu(gate) * up`` as one ``swiglu`` step
SWIGLU = RewriteRule("swiglu", Pattern("mul", (Pattern("silu", (ANY,)), ANY)), "swiglu")


class NumpyBackend(Backend):
    """Float32 numpy implementation of every op (see :mod:`llmfw.core.graph`), plus ``swiglu`` (:data:`SWIGLU`)."""

    name = "numpy"
    supported_ops = OPS
    rewrite_rules = (SWIGLU,)
    is_host = True
    #: the default when no faster backend can run (always installed)
    default_priority = {"cpu": 100}

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        super().__init__(device, options)
        #: float32 copies shared by tensors with the same file source (tied output head + embedding)
        self._dense_by_source: dict[str, np.ndarray] = {}

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        if device not in (None, "cpu"):
            from llmfw.core.errors import BackendUnavailable

            raise BackendUnavailable(f"the numpy backend runs on the CPU only, not on device {device!r}")

    # -- weights ------------------------------------------------------------------------------------------
    def load_weight(self, source: WeightSource) -> Any:
        qtype = GGMLType(source.ggml_type)
        lookup_only = source.usage == frozenset({"get_rows"})
        if lookup_only and qtype not in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            # rows decoded on demand: a quantized table stays ~4-8x smaller than float32
            return QuantizedTable(np.array(source.raw, dtype=np.uint8, copy=True), int(qtype), source.ne)
        # a matrix multiplied with activations is stored in the layout its one-token product streams fastest
        # (see the module docstring); the handle keeps the contract's [n_out, n_in] shape either way
        transposed = "mul_mat" in source.usage and len(source.ne) == 2 and source.ne[1] >= source.ne[0]
        dense = self._dense_by_source.get(source.source_name)
        if dense is not None and dense.shape == source.numpy_shape:
            if transposed and not _is_stored_transposed(dense):  # shared with a lookup table loaded before
                self._rebind(dense, np.ascontiguousarray(dense.T).T)
                dense = self._dense_by_source[source.source_name]
            return dense
        dense = np.asarray(dequantize(source.raw, qtype, source.ne), dtype=F32)
        dense = np.ascontiguousarray(dense.T).T if transposed else np.ascontiguousarray(dense)
        if np.shares_memory(dense, source.raw):  # F32 tensors may come back as views of the mmap
            dense = dense.copy(order="K")
        self._dense_by_source[source.source_name] = dense
        return dense

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

    def set_n_threads(self, n_threads: int | None) -> None:
        """BLAS's thread count is process-wide; None leaves it where the last count put it (OpenBLAS keeps no
        default to go back to)."""
        super().set_n_threads(n_threads)
        if n_threads:
            set_blas_threads(n_threads)

    # -- KV ----------------------------------------------------------------------------------------------
    def alloc_kv(self, shape: KVLayerShape) -> NumpyKV:
        return NumpyKV(
            k=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_k), dtype=F32),
            v=np.zeros((shape.n_head_kv, shape.n_cells, shape.head_dim_v), dtype=F32),
        )

    # -- values ------------------------------------------------------------------------------------------
    def from_numpy(self, array: np.ndarray) -> np.ndarray:
        return array

    def to_numpy(self, value: Any) -> np.ndarray:
        return np.asarray(value)

    # -- compile -----------------------------------------------------------------------------------------
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        return _SplitCompiler(self, split, kv).compile()


# ---------------------------------------------------------------------------------------------------------
# the split compiler
# ---------------------------------------------------------------------------------------------------------

#: a compiled step: reads its inputs from the slot list and stores its value in its own slot
Step = Callable[[], None]

class _SplitCompiler:
    """Maps a split's nodes to kernels: ``run(inputs) -> outputs`` is a flat list of closures over a list of
    value slots (no dict look-ups per op).

    Each node gets a slot; ``weight`` slots are filled once, at compile time. The graph arrives optimised by the
    core passes (fused matmuls on fused weights, norms with their weight, this backend's rewrite rules); after
    each node the values the core's liveness (``split.release_after``) marks dead are cleared, so a prefill holds
    only the live activations. Rope angles are computed once per run and shared.
    """

    def __init__(self, backend: NumpyBackend, split: Split, kv: Mapping[tuple[str, int], Any]):
        self.backend = backend
        self.split = split
        self.kv = kv
        self.nodes = split.nodes
        self.slot: dict[int, int] = {}
        for node_id in split.input_ids:
            self.slot.setdefault(node_id, len(self.slot))
        for node in self.nodes:
            self.slot.setdefault(node.id, len(self.slot))
        self.env: list[Any] = [None] * len(self.slot)
        #: per-run tables shared by several steps (rope angles, attention limits), cleared by ``run``
        self.memo: dict[Any, Any] = {}

    # -- helpers ------------------------------------------------------------------------------------------
    def s(self, node: Node) -> int:
        return self.slot[node.id]

    def weight_array(self, node: Node) -> np.ndarray | None:
        """The dense float32 handle of a weight node (None for other nodes and quantized tables)."""
        if node.op != "weight":
            return None
        handle = self.backend.weight(node.attrs["name"])
        return handle if isinstance(handle, np.ndarray) else None

    # -- compile ------------------------------------------------------------------------------------------
    def compile(self) -> CompiledSplit:
        steps: list[Step] = []
        for index, node in enumerate(self.nodes):
            if node.op == "weight":
                self.env[self.s(node)] = self.backend.weight(node.attrs["name"])
            elif node.op != "input":
                steps.append(self._step(node))
            dead = self.split.release_after.get(index)
            if dead:
                steps.append(self._release([self.slot[i] for i in dead]))
        env, memo = self.env, self.memo
        # values handed in: the split's inputs, and graph inputs that appear as nodes (must be set)
        input_slots = [(node_id, self.slot[node_id]) for node_id in self.split.input_ids]
        input_nodes = {n.id: n.attrs.get("name") for n in self.nodes if n.op == "input"}
        input_slots += [(node_id, self.slot[node_id]) for node_id in input_nodes if node_id not in self.split.input_ids]
        output_slots = [(node_id, self.slot[node_id]) for node_id in self.split.output_ids]
        activation_slots = [slot for slot, value in enumerate(env) if value is None]

        def run(inputs: Mapping[int, Any]) -> dict[int, Any]:
            for node_id, name in input_nodes.items():
                if node_id not in inputs:
                    raise ModelError(f"graph input {name!r} was not set")
            for node_id, slot in input_slots:
                env[slot] = inputs.get(node_id)
            try:
                for step in steps:
                    step()
                return {node_id: env[slot] for node_id, slot in output_slots}
            finally:
                for slot in activation_slots:  # keep nothing of this run alive between runs
                    env[slot] = None
                memo.clear()

        return run

    def _release(self, slots: list[int]) -> Step:
        env = self.env
        dead = tuple(slots)

        def clear() -> None:
            for slot in dead:
                env[slot] = None

        return clear

    def _step(self, node: Node) -> Step:
        builder = getattr(self, f"_op_{node.op}", None)
        if builder is None:
            raise ModelError(f"numpy backend: op {node.op!r} is not implemented")
        return builder(node, [self.s(i) for i in node.inputs], self.s(node))

    # -- ops (each returns the Step of one node) -----------------------------------------------------------
    def _unary(self, fn: Callable[[np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        env = self.env
        (a,) = ins

        def step():
            env[out] = fn(env[a])

        return step

    def _binary(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        env = self.env
        a, b = ins

        def step():
            env[out] = fn(env[a], env[b])

        return step

    def _op_get_rows(self, node, ins, out) -> Step:
        return self._binary(get_rows, ins, out)

    def _op_mul_mat(self, node, ins, out) -> Step:
        weight = self.weight_array(node.inputs[0])
        env = self.env
        if weight is not None:
            weight_t = weight.T  # a view in the layout load_weight chose: BLAS reads either without a copy
            x_slot = ins[1]

            def step():
                env[out] = np.matmul(env[x_slot], weight_t)

            return step
        return self._binary(lambda w, x: np.matmul(x, w.T), ins, out)

    def _op_add(self, node, ins, out) -> Step:
        return self._binary(np.add, ins, out)

    def _op_sub(self, node, ins, out) -> Step:
        return self._binary(np.subtract, ins, out)

    def _op_mul(self, node, ins, out) -> Step:
        return self._binary(np.multiply, ins, out)

    def _op_scale(self, node, ins, out) -> Step:
        s = F32(node.attrs["s"])
        return self._unary(lambda x: x * s, ins, out)

    def _op_rms_norm(self, node, ins, out) -> Step:
        eps = float(node.attrs["eps"])
        return self._norm_step(lambda x, w: rms_norm(x, eps, w), ins, out)

    def _op_norm(self, node, ins, out) -> Step:
        eps = float(node.attrs["eps"])
        return self._norm_step(lambda x, w: layer_norm(x, eps, w), ins, out)

    def _norm_step(self, kernel: Callable[[np.ndarray, np.ndarray | None], np.ndarray], ins: list[int],
                   out: int) -> Step:
        """A norm with its optional weight (the core folded ``norm → mul`` by a weight into its 2nd input)."""
        env, x_slot = self.env, ins[0]
        w_slot = ins[1] if len(ins) > 1 else None

        def step():
            env[out] = kernel(env[x_slot], None if w_slot is None else env[w_slot])

        return step

    def _op_swiglu(self, node, ins, out) -> Step:
        """The rewrite rule :data:`SWIGLU`: ``silu(gate) * up`` in one step, the product in place."""
        env, gate_slot, up_slot = self.env, ins[0], ins[1]

        def step():
            h, up = silu(env[gate_slot]), env[up_slot]
            if h.shape == up.shape:
                h *= up  # silu's result is a fresh array: multiply in place
            else:
                h = h * up
            env[out] = h

        return step

    def _op_silu(self, node, ins, out) -> Step:
        return self._unary(silu, ins, out)

    def _op_relu(self, node, ins, out) -> Step:
        return self._unary(lambda x: np.maximum(x, F32(0.0)), ins, out)

    def _op_gelu(self, node, ins, out) -> Step:
        return self._unary(gelu, ins, out)

    def _op_softcap(self, node, ins, out) -> Step:
        cap = F32(node.attrs["cap"])
        return self._unary(lambda x: np.tanh(x / cap) * cap, ins, out)

    def _op_clamp(self, node, ins, out) -> Step:
        lo, hi = F32(node.attrs["min"]), F32(node.attrs["max"])
        return self._unary(lambda x: np.clip(x, lo, hi), ins, out)

    def _op_reshape(self, node, ins, out) -> Step:
        shape = tuple(node.attrs["shape"])
        return self._unary(lambda x: x.reshape(shape), ins, out)

    def _op_slice(self, node, ins, out) -> Step:
        axis, start, stop = node.attrs.get("axis", -1), node.attrs.get("start"), node.attrs.get("stop")

        def take(x):
            index = [slice(None)] * x.ndim
            index[axis] = slice(start, stop)
            return x[tuple(index)]

        return self._unary(take, ins, out)

    def _op_rope(self, node, ins, out) -> Step:
        attrs = dict(node.attrs)
        n_dims, mode = int(attrs["n_dims"]), attrs["mode"]
        x_slot, pos_slot = ins[0], ins[1]
        ff_slot = ins[2] if len(ins) > 2 else None
        key = ("rope", pos_slot, ff_slot, tuple(sorted(attrs.items())))
        env, memo = self.env, self.memo

        def step():
            table = memo.get(key)
            if table is None:
                ff = env[ff_slot] if ff_slot is not None else None
                cos, sin = rope_cos_sin(np.asarray(env[pos_slot]), freq_factors=ff, **attrs)
                table = memo[key] = rope_table(cos, sin, mode)
            env[out] = rope_apply_full(env[x_slot], table, n_dims, mode)

        return step

    def _kv_storage(self, node: Node) -> NumpyKV:
        return self.kv[(node.attrs["cache"], node.attrs["layer"])]

    def _write_kv(self, storage: NumpyKV, k: np.ndarray, v: np.ndarray, idx: np.ndarray) -> None:
        """Store a ubatch's K/V rows in the cache (a subclass may round them first)."""
        write_kv(storage, k, v, idx)

    def _attend(self, q: np.ndarray, storage: NumpyKV, mask: np.ndarray, scale: float, softcap: float,
                limits: list[tuple[int, int, int]]) -> np.ndarray:
        """Attention of ``q`` over the cache (a subclass may use its own arithmetic)."""
        return attention(q, storage, mask.shape[1], mask, scale, softcap, limits)

    def _op_attention(self, node, ins, out) -> Step:
        q_slot, k_slot, v_slot, idx_slot, mask_slot = ins
        storage = self._kv_storage(node)
        scale, softcap = float(node.attrs["scale"]), float(node.attrs.get("softcap", 0.0) or 0.0)
        env, memo, write, attend = self.env, self.memo, self._write_kv, self._attend
        key = ("attn_limits", mask_slot)

        def step():
            write(storage, env[k_slot], env[v_slot], env[idx_slot])
            mask = env[mask_slot]
            limits = memo.get(key)
            if limits is None:
                limits = memo[key] = visible_limits(mask)
            env[out] = attend(env[q_slot], storage, mask, scale, softcap, limits)

        return step

    def _op_k_shift(self, node, ins, out) -> Step:
        attrs = {k: v for k, v in node.attrs.items() if k not in ("layer", "cache")}
        storage = self._kv_storage(node)
        n_dims, mode = int(attrs["n_dims"]), attrs["mode"]
        shift_slot = ins[0]
        ff_slot = ins[1] if len(ins) > 1 else None
        env = self.env

        def step():
            shift = np.asarray(env[shift_slot])
            n_kv = shift.shape[0]
            ff = env[ff_slot] if ff_slot is not None else None
            cos, sin = rope_cos_sin(shift, freq_factors=ff, **attrs)
            cached = storage.k[:, :n_kv].transpose(1, 0, 2)  # [n_kv, Hkv, D] view
            storage.k[:, :n_kv] = rope_apply(cached, cos, sin, n_dims, mode).transpose(1, 0, 2)
            env[out] = np.zeros(0, dtype=F32)

        return step
