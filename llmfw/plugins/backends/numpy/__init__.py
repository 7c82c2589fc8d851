"""The numpy CPU backend: every graph op in float32, the reference implementation (the oracle).

Weights are dequantized to float32 once at load; an embedding table used only for row lookups stays in its
quantized form and rows are decoded on demand (``dequantize_rows``), which saves memory when the output head is
not tied to it (or lives on another backend). The KV cache of a layer is two preallocated float32 arrays
``[n_head_kv, n_cells, head_dim]`` written in place, so a decode step allocates nothing cache-sized.

Why it is laid out as it is (the profile: ``benchmarks/numpy_decode.py``; docs/backends.md, numpy):

* a matrix multiplied with activations that has at least as many outputs as inputs (Q, gate/up, the output
  head) is stored *transposed*, ``Wt = W.T`` C-contiguous ``[n_in, n_out]``; its handle is the view ``Wt.T``,
  so it still has the contract's shape ``[n_out, n_in]``. For one token ``x @ Wt`` (OpenBLAS ``gemv_n``)
  streams such a matrix faster than ``x @ W.T`` (``gemv_t``), which in turn is faster for the narrow
  ``ffn_down`` (n_in > n_out), kept as in the file. Both are equally fast for a prefill.
* :meth:`NumpyBackend.compile` maps the core's optimised graph to kernels: a flat list of closures over a slot
  list (no dict look-ups per op). The core passes (``llmfw.core.ir.passes``) already fused the matmuls that share an
  input (Q/K/V, gate/up) into one GEMM over a weight this backend concatenated once at load
  (:meth:`NumpyBackend.fuse_weights`), folded each norm's weight into it, applied this backend's rewrite rule
  ``swiglu`` and marked each value's last use, after which its slot is freed (a prefill's activations are not
  all alive at once). Rope tables are computed once per run for all layers.
* attention skips the KV cells that no query of a block of rows can see (the causal half of a prefill, the
  padding of ``n_kv``): their probabilities are exactly zero, so the result is the same.

A decode step is mostly weight streaming — the bound of an exact float32 engine — and a prefill mostly GEMM.

Modules: ``kernels`` (the op kernels: pure functions of numpy arrays, also the oracle of other backends' tests),
``weights`` (float32 weight storage, lookup-only quantized tables, ``fuse_weights``), ``blas`` (BLAS threads),
``compiler`` (a split -> closures over a slot list), ``runtime`` (the Backend class).
"""
from llmfw.core.ir.rope import rope_cos_sin, yarn_corr_dims
from llmfw.plugins.backends.numpy.blas import set_blas_threads
from llmfw.plugins.backends.numpy.compiler import SplitCompiler, Step
from llmfw.plugins.backends.numpy.kernels import (ATTN_BLOCK_ROWS, F32, F64, NumpyKV, RopeTable, attention, gelu,
                                                  group_queries, layer_norm, masked_exp, rms_norm, rope_apply,
                                                  rope_apply_full, rope_table, silu, ungroup_heads,
                                                  visible_limits, write_kv)
from llmfw.plugins.backends.numpy.runtime import SWIGLU, NumpyBackend
from llmfw.plugins.backends.numpy.weights import NumpyWeights, QuantizedTable, get_rows, is_stored_transposed

__all__ = [
    "ATTN_BLOCK_ROWS", "F32", "F64", "SWIGLU", "NumpyBackend", "NumpyKV", "NumpyWeights", "QuantizedTable",
    "RopeTable", "SplitCompiler", "Step", "attention", "gelu", "get_rows", "group_queries",
    "is_stored_transposed", "layer_norm", "masked_exp", "rms_norm", "rope_apply", "rope_apply_full",
    "rope_cos_sin", "rope_table", "set_blas_threads", "silu", "ungroup_heads", "visible_limits", "write_kv",
    "yarn_corr_dims",
]
