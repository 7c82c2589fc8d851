"""The numpy CPU backend: every graph op in float32, the reference implementation (the oracle).

Weights are dequantized to float32 once at load; an embedding table used only for row lookups stays in its
quantized form and rows are decoded on demand (``dequantize_rows``), which saves memory when the output head is
not tied to it (or lives on another backend). The KV cache of a layer is two preallocated float32 arrays
``[n_head_kv, n_cells, head_dim]`` written in place, so a decode step allocates nothing cache-sized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from llmfw.core.backend import Backend, CompiledSplit, KVLayerShape, Split, WeightSource
from llmfw.core.errors import ModelError
from llmfw.core.graph import OPS, Node
from llmfw.core.quants import GGMLType, dequantize, dequantize_rows

F32 = np.float32


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

def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    # ggml accumulates the sum of squares in double; einsum in float64 does the same in one pass
    mean_sq = np.einsum("...i,...i->...", x, x, dtype=np.float64)[..., None] / x.shape[-1]
    return x * (1.0 / np.sqrt(mean_sq + eps)).astype(F32)


def layer_norm(x: np.ndarray, eps: float) -> np.ndarray:
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float64).astype(F32)
    centered = x - mean
    var = np.mean(np.square(centered), axis=-1, keepdims=True, dtype=np.float64)
    return (centered * (1.0 / np.sqrt(var + eps)).astype(F32)).astype(F32, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = np.negative(x)
        np.exp(out, out=out)
        out += F32(1.0)
        return np.divide(x, out, out=out)


def gelu(x: np.ndarray) -> np.ndarray:
    c = F32(math.sqrt(2.0 / math.pi))
    return F32(0.5) * x * (F32(1.0) + np.tanh(c * (x + F32(0.044715) * x * x * x)))


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dimension range over which YaRN ramps from interpolation to extrapolation."""

    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))

    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return max(0.0, start), min(n_dims - 1.0, end)


def rope_cos_sin(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
                 attn_factor: float, beta_fast: float, beta_slow: float, n_ctx_orig: int,
                 freq_factors: np.ndarray | None = None, **_: Any) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, n_dims/2] exactly as ggml_rope_cache_init: theta advanced by repeated float32 products."""
    half = n_dims // 2
    theta_scale = F32(freq_base ** (-2.0 / n_dims))
    theta = np.empty((pos.shape[0], half), dtype=F32)
    cur = pos.astype(F32)
    for i in range(half):
        theta[:, i] = cur
        cur = cur * theta_scale
    if freq_factors is not None:
        theta_extrap = theta / np.asarray(freq_factors, dtype=F32).reshape(-1)[:half]
    else:
        theta_extrap = theta
    theta_interp = F32(freq_scale) * theta_extrap
    mscale = F32(attn_factor)
    if ext_factor != 0.0:
        low, high = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        y = (np.arange(half, dtype=F32) - F32(low)) / F32(max(0.001, high - low))
        ramp_mix = (F32(1.0) - np.clip(y, 0.0, 1.0)) * F32(ext_factor)
        theta = theta_interp * (F32(1.0) - ramp_mix) + theta_extrap * ramp_mix
        mscale = F32(mscale * (1.0 + 0.1 * math.log(1.0 / freq_scale)))
    else:
        theta = theta_interp
    return (np.cos(theta) * mscale).astype(F32), (np.sin(theta) * mscale).astype(F32)


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


def attention(q: np.ndarray, kv: NumpyKV, n_kv: int, mask: np.ndarray, scale: float,
              softcap: float) -> np.ndarray:
    """softmax(softcap(scale·q·Kᵀ) + mask)·V over cells 0..n_kv-1, GQA by head groups → [T, H*Dv]."""
    n_tokens, n_head, head_dim = q.shape
    n_head_kv = kv.k.shape[0]
    group = n_head // n_head_kv
    keys = kv.k[:, :n_kv]  # [Hkv, n_kv, Dk]
    values = kv.v[:, :n_kv]  # [Hkv, n_kv, Dv]
    # [T, H, D] -> [Hkv, G*T, D] so each KV head is one matmul over all its query heads and tokens; the scale
    # is applied to q (small) rather than to the scores (large): the same product up to rounding
    qg = (q * F32(scale)).reshape(n_tokens, n_head_kv, group, head_dim).transpose(1, 2, 0, 3)
    scores = np.matmul(qg.reshape(n_head_kv, group * n_tokens, head_dim), keys.transpose(0, 2, 1))
    if softcap:
        np.tanh(scores / F32(softcap), out=scores)
        scores *= F32(softcap)
    scores = scores.reshape(n_head_kv, group, n_tokens, n_kv)
    scores += mask[None, None, :, :]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denominators = scores.sum(axis=-1, keepdims=True).reshape(n_head_kv, group * n_tokens, 1)
    out = np.matmul(scores.reshape(n_head_kv, group * n_tokens, n_kv), values)  # [Hkv, G*T, Dv]
    out /= denominators  # normalise after the product: Dv columns instead of n_kv
    dv = values.shape[-1]
    return out.reshape(n_head_kv, group, n_tokens, dv).transpose(2, 0, 1, 3).reshape(n_tokens, n_head * dv)


def write_kv(kv: NumpyKV, k: np.ndarray, v: np.ndarray, idx: np.ndarray) -> None:
    kv.k[:, idx, :] = k.transpose(1, 0, 2)
    kv.v[:, idx, :] = v.transpose(1, 0, 2)


def get_rows(table: Any, ids: np.ndarray) -> np.ndarray:
    if isinstance(table, QuantizedTable):
        return dequantize_rows(table.raw, table.ggml_type, table.ne, ids)
    return np.asarray(table[np.asarray(ids, dtype=np.intp)], dtype=F32)


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

#: a compiled step: reads its inputs from the environment, stores its value under its node id
Step = Callable[[dict[int, Any], dict[Any, Any]], None]


class NumpyBackend(Backend):
    """Float32 numpy implementation of every op (see :mod:`llmfw.core.graph`)."""

    name = "numpy"
    supported_ops = OPS
    is_host = True

    def __init__(self, device: str | None = None, n_threads: int | None = None):
        super().__init__(device, n_threads)
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
        dense = self._dense_by_source.get(source.source_name)
        if dense is None or dense.shape != source.numpy_shape:
            dense = np.ascontiguousarray(dequantize(source.raw, qtype, source.ne), dtype=F32)
            if np.shares_memory(dense, source.raw):  # F32 tensors may come back as views of the mmap
                dense = dense.copy()
            self._dense_by_source[source.source_name] = dense
        return dense

    def free_weights(self) -> None:
        super().free_weights()
        self._dense_by_source.clear()

    def set_n_threads(self, n_threads: int | None) -> None:
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
        steps = [self._compile_node(node, kv) for node in split.nodes]
        output_ids = list(split.output_ids)

        def run(inputs: Mapping[int, Any]) -> dict[int, Any]:
            env: dict[int, Any] = dict(inputs)
            memo: dict[Any, Any] = {}  # per-run caches (rope tables shared by q and k of every layer)
            for step in steps:
                step(env, memo)
            return {i: env[i] for i in output_ids}

        return run

    def _compile_node(self, node: Node, kv: Mapping[tuple[str, int], Any]) -> Step:
        builder = getattr(self, f"_op_{node.op}", None)
        if builder is None:
            raise ModelError(f"numpy backend: op {node.op!r} is not implemented")
        return builder(node, [i.id for i in node.inputs], node.id, kv)

    # each _op_X returns a Step for one node

    def _op_weight(self, node, ins, out, kv) -> Step:
        handle = self.weight(node.attrs["name"])

        def step(env, memo):
            env[out] = handle

        return step

    def _op_input(self, node, ins, out, kv) -> Step:
        def step(env, memo):
            if out not in env:
                raise ModelError(f"graph input {node.attrs.get('name')!r} was not set")

        return step

    def _unary(self, fn: Callable[[np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        (a,) = ins

        def step(env, memo):
            env[out] = fn(env[a])

        return step

    def _binary(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        a, b = ins

        def step(env, memo):
            env[out] = fn(env[a], env[b])

        return step

    def _op_get_rows(self, node, ins, out, kv) -> Step:
        return self._binary(get_rows, ins, out)

    def _op_mul_mat(self, node, ins, out, kv) -> Step:
        return self._binary(lambda w, x: np.matmul(x, w.T), ins, out)

    def _op_add(self, node, ins, out, kv) -> Step:
        return self._binary(np.add, ins, out)

    def _op_sub(self, node, ins, out, kv) -> Step:
        return self._binary(np.subtract, ins, out)

    def _op_mul(self, node, ins, out, kv) -> Step:
        return self._binary(np.multiply, ins, out)

    def _op_scale(self, node, ins, out, kv) -> Step:
        s = F32(node.attrs["s"])
        return self._unary(lambda x: x * s, ins, out)

    def _op_rms_norm(self, node, ins, out, kv) -> Step:
        eps = float(node.attrs["eps"])
        return self._unary(lambda x: rms_norm(x, eps), ins, out)

    def _op_norm(self, node, ins, out, kv) -> Step:
        eps = float(node.attrs["eps"])
        return self._unary(lambda x: layer_norm(x, eps), ins, out)

    def _op_silu(self, node, ins, out, kv) -> Step:
        return self._unary(silu, ins, out)

    def _op_relu(self, node, ins, out, kv) -> Step:
        return self._unary(lambda x: np.maximum(x, F32(0.0)), ins, out)

    def _op_gelu(self, node, ins, out, kv) -> Step:
        return self._unary(gelu, ins, out)

    def _op_softcap(self, node, ins, out, kv) -> Step:
        cap = F32(node.attrs["cap"])
        return self._unary(lambda x: np.tanh(x / cap) * cap, ins, out)

    def _op_clamp(self, node, ins, out, kv) -> Step:
        lo, hi = F32(node.attrs["min"]), F32(node.attrs["max"])
        return self._unary(lambda x: np.clip(x, lo, hi), ins, out)

    def _op_reshape(self, node, ins, out, kv) -> Step:
        shape = tuple(node.attrs["shape"])
        return self._unary(lambda x: x.reshape(shape), ins, out)

    def _op_slice(self, node, ins, out, kv) -> Step:
        axis, start, stop = node.attrs.get("axis", -1), node.attrs.get("start"), node.attrs.get("stop")

        def take(x):
            index = [slice(None)] * x.ndim
            index[axis] = slice(start, stop)
            return x[tuple(index)]

        return self._unary(take, ins, out)

    def _op_rope(self, node, ins, out, kv) -> Step:
        attrs = dict(node.attrs)
        n_dims, mode = int(attrs["n_dims"]), attrs["mode"]
        x_id, pos_id = ins[0], ins[1]
        ff_id = ins[2] if len(ins) > 2 else None
        key_attrs = tuple(sorted((k, v) for k, v in attrs.items()))

        def step(env, memo):
            key = ("rope", pos_id, ff_id, key_attrs)
            tables = memo.get(key)
            if tables is None:
                ff = env[ff_id] if ff_id is not None else None
                tables = memo[key] = rope_cos_sin(np.asarray(env[pos_id]), freq_factors=ff, **attrs)
            env[out] = rope_apply(env[x_id], tables[0], tables[1], n_dims, mode)

        return step

    def _op_attention(self, node, ins, out, kv) -> Step:
        q_id, k_id, v_id, idx_id, mask_id = ins
        storage: NumpyKV = kv[(node.attrs["cache"], node.attrs["layer"])]
        scale, softcap = float(node.attrs["scale"]), float(node.attrs.get("softcap", 0.0) or 0.0)

        def step(env, memo):
            write_kv(storage, env[k_id], env[v_id], env[idx_id])
            mask = env[mask_id]
            env[out] = attention(env[q_id], storage, mask.shape[1], mask, scale, softcap)

        return step

    def _op_k_shift(self, node, ins, out, kv) -> Step:
        attrs = {k: v for k, v in node.attrs.items() if k not in ("layer", "cache")}
        storage: NumpyKV = kv[(node.attrs["cache"], node.attrs["layer"])]
        n_dims, mode = int(attrs["n_dims"]), attrs["mode"]
        shift_id = ins[0]
        ff_id = ins[1] if len(ins) > 1 else None

        def step(env, memo):
            shift = np.asarray(env[shift_id])
            n_kv = shift.shape[0]
            ff = env[ff_id] if ff_id is not None else None
            cos, sin = rope_cos_sin(shift, freq_factors=ff, **attrs)
            cached = storage.k[:, :n_kv].transpose(1, 0, 2)  # [n_kv, Hkv, D] view
            storage.k[:, :n_kv] = rope_apply(cached, cos, sin, n_dims, mode).transpose(1, 0, 2)
            env[out] = np.zeros(0, dtype=F32)

        return step
