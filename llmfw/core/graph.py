"""The graph IR: a small DAG of ops that an architecture emits and backends execute.

Conventions (every backend implements exactly these semantics; the numpy backend is the oracle):

* Arrays are row-major. Activations are float32 ``[n_tokens, n_embd]``; attention tensors are
  ``[n_tokens, n_head, head_dim]``. A weight whose GGUF shape is ``ne = [ne0, ne1]`` is seen as the numpy
  shape ``(ne1, ne0)`` — rows of ``ne0`` contiguous elements, like ggml.
* Nodes are created in topological order; ``Graph.nodes`` keeps that order.

Ops (inputs in order; attributes in ``Node.attrs``):

==================  ===================================================================================
``input``           a graph input set per ubatch. attrs: ``name``. Standard names: ``tokens`` int32 [T],
                    ``embd`` f32 [T, n_embd], ``pos`` int32 [T], ``out_ids`` int32 [n_outputs],
                    ``kv_idx:<cache>`` int64 [T] (KV cells written by this ubatch), ``kq_mask:<cache>``
                    f32 [T, n_kv] (0 = visible, -inf = hidden) for each KV cache ``<cache>``.
``weight``          a model tensor. attrs: ``name`` (GGUF tensor name). ``layer`` says who owns it.
``get_rows``        (table, ids) → ``table[ids]`` as float32 (table may be a quantized weight).
``mul_mat``         (w, x) → ``x @ w.T`` ; w is a weight [n_out, n_in], x [..., n_in] → [..., n_out].
``add`` ``sub``     (a, b) elementwise with numpy broadcasting.
``mul``             (a, b) elementwise with numpy broadcasting.
``scale``           (x) → ``x * attrs["s"]``.
``rms_norm``        (x) → ``x / sqrt(mean(x², -1) + eps)``; attrs: ``eps``.
``norm``            (x) → ``(x - mean) / sqrt(var + eps)`` over the last axis; attrs: ``eps``.
``silu`` ``relu``   (x) → activation.
``gelu``            (x) → ggml's tanh approximation ``0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))``.
``softcap``         (x) → ``cap * tanh(x / cap)``; attrs: ``cap``.
``clamp``           (x) → ``clip(x, min, max)``; attrs: ``min``, ``max``.
``reshape``         (x) → ``x.reshape(attrs["shape"])`` (``-1`` allowed).
``slice``           (x) → ``x[..., start:stop]`` along ``attrs["axis"]``.
``rope``            (x [T, H, D], pos [T] [, freq_factors [n_dims/2]]) → rotated x, ggml_rope_ext
                    semantics. attrs: ``n_dims``, ``mode`` ("norm": adjacent pairs, "neox": halves),
                    ``freq_base``, ``freq_scale``, ``ext_factor``, ``attn_factor``, ``beta_fast``,
                    ``beta_slow``, ``n_ctx_orig``. Dimensions past ``n_dims`` pass through.
``attention``       (q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv], kv_idx [T], mask [T, n_kv]) → [T, H*Dv].
                    First writes k and v into rows ``kv_idx`` of the layer's KV cache (attrs ``layer``,
                    ``cache``), then for each query head h (KV head ``h // (H // Hkv)``):
                    ``softmax(softcap(scale * q·Kᵀ) + mask) @ V`` over cache cells ``0 .. n_kv-1``
                    (n_kv = mask.shape[1]). attrs: ``layer``, ``cache``, ``scale``, ``softcap`` (0 = off).
==================  ===================================================================================

Graph outputs are named: ``logits`` f32 [n_outputs, n_vocab] (and optionally ``embd`` for embeddings).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: every op of the IR; a backend lists the subset it implements in ``Backend.supported_ops``
OPS = frozenset({
    "input", "weight", "get_rows", "mul_mat", "add", "sub", "mul", "scale", "rms_norm", "norm", "silu",
    "relu", "gelu", "softcap", "clamp", "reshape", "slice", "rope", "attention",
})


@dataclass(eq=False)
class Node:
    """One op application. Identity is by object: two equal-looking nodes are still two nodes."""

    id: int
    op: str
    inputs: tuple["Node", ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)
    #: layer index that owns this node (-1: input side before layer 0, n_layer: output side), for placement
    layer: int = -1
    name: str = ""

    def __repr__(self) -> str:
        args = ", ".join(f"%{i.id}" for i in self.inputs)
        label = f" {self.name}" if self.name else ""
        return f"%{self.id} = {self.op}({args}){label} L{self.layer} {self.attrs or ''}"


@dataclass(eq=False)
class Graph:
    """Nodes in topological order, named inputs and named outputs."""

    nodes: list[Node] = field(default_factory=list)
    inputs: dict[str, Node] = field(default_factory=dict)
    outputs: dict[str, Node] = field(default_factory=dict)

    def add(self, op: str, *inputs: Node, layer: int = -1, name: str = "", **attrs: Any) -> Node:
        if op not in OPS:
            raise ValueError(f"unknown graph op {op!r}; known: {', '.join(sorted(OPS))}")
        node = Node(len(self.nodes), op, tuple(inputs), attrs, layer, name)
        self.nodes.append(node)
        return node

    def __str__(self) -> str:
        return "\n".join(map(repr, self.nodes))
