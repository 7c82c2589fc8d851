"""The graph IR: a small typed DAG of ops that an architecture emits, the core optimises and backends execute.

The compiler, in the core (one for every backend)::

    Architecture.build_graph(GraphBuilder)        one graph per ubatch shape (BuildParams), reused while equal
      → typed nodes: every Node gets shape + dtype from OP_TABLE when built; a misfit is a ModelError naming it
    core passes (core/ir/passes.py, run by core/exec/scheduler.py once per built graph)
      → fuse_shared_input_matmuls: mul_mats of one input (Q/K/V, gate/up) → one mul_mat on a fused weight
        (attrs name="a+b+c", parts=(a, b, c)) + one slice per part. The fused weight was made once at load
        (prepare_fused_weights: the same detection on a representative graph, Backend.fuse_weights per group)
    placement and splits (core/exec/scheduler.py)
      → fold_norm_weights: norm(x) × 1-D weight on the same backend → rms_norm(x, w) / norm(x, w)
      → apply_rewrite_rules: each backend's declared fusions (a pattern of core ops → one op of its own, e.g.
        numpy's swiglu) on the nodes placed on it, per split
      → last_uses (liveness, below): per split, the values dead after each node (Split.release_after)
    Backend.compile(split)                         maps ops to kernels: weights + kernels, no compiler of its own

:func:`consumers_of` is the one consumer map and :func:`last_uses` the one liveness analysis: passes, scheduler
and backends all use them.

Conventions (every backend implements exactly these semantics; the numpy backend is the oracle):

* Arrays are row-major. Activations are float32 ``[n_tokens, n_embd]``; attention tensors are
  ``[n_tokens, n_head, head_dim]``. A weight whose GGUF shape is ``ne = [ne0, ne1]`` is seen as the numpy
  shape ``(ne1, ne0)`` — rows of ``ne0`` contiguous elements, like ggml.
* Nodes are created in topological order; ``Graph.nodes`` keeps that order (the fusion pass renumbers ids to indices; ids stay unique).
* Types: ``Node.shape`` is concrete (graphs are built per ubatch shape) except ``DYNAMIC`` (-1) dimensions the
  builder cannot see (the K-shift's ``n_kv``); ``Node.dtype`` is ``f32`` for activations and weights (whatever
  form a backend stores them in), ``i32`` / ``i64`` for ids, positions and KV cell indices.

Ops (inputs in order; attributes in ``Node.attrs``):

==================  ===================================================================================
``input``           a graph input set per ubatch. attrs: ``name``. Standard names: ``tokens`` int32 [T],
                    ``embd`` f32 [T, n_embd], ``pos`` int32 [T], ``out_ids`` int32 [n_outputs],
                    ``attn_temp`` f32 [T, 1, 1] (a per-position query scale, Architecture.ubatch_inputs),
                    ``kv_idx:<cache>`` int64 [T] (KV cells written by this ubatch), ``kq_mask:<cache>``
                    f32 [T, n_kv] (0 = visible, -inf = hidden) for each KV cache ``<cache>``.
``weight``          a model tensor. attrs: ``name`` (GGUF tensor name). ``layer`` says who owns it. A fused
                    weight (core pass) also has ``parts`` (its members' names, stacked by output rows).
``get_rows``        (table, ids) → ``table[ids]`` as float32 (table may be a quantized weight).
``mul_mat``         (w, x) → ``x @ w.T`` ; w is a weight [n_out, n_in], x [..., n_in] → [..., n_out].
``add`` ``sub``     (a, b) elementwise with numpy broadcasting.
``mul``             (a, b) elementwise with numpy broadcasting.
``scale``           (x) → ``x * attrs["s"]``.
``rms_norm``        (x [, w]) → ``x / sqrt(mean(x², -1) + eps)`` (× w: a weight of x's last size, folded in
                    by the core pass); attrs: ``eps``.
``norm``            (x [, w]) → ``(x - mean) / sqrt(var + eps)`` over the last axis (× w); attrs: ``eps``.
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
                    (n_kv = mask.shape[1]). attrs: ``layer``, ``cache``, ``scale``, ``softcap`` (0 = off),
                    ``window``: the standard sliding window the mask applies (llama.cpp's n_swa; 0 = none).
                    The mask decides what is seen; ``window`` lets a fused kernel know it in advance.
                    An optional 6th input ``sinks`` [H] (gpt-oss's attention sinks) adds ``exp(sinks[h])`` to
                    each row's softmax denominator: a logit that takes probability but has no value.
``k_shift``         (shift int32 [n_kv] [, freq_factors]) → empty f32 [0]. Side effect only: rotates rows
                    ``0 .. n_kv-1`` of the K cache of (``cache``, ``layer``) in place by the positions
                    ``shift`` (llama.cpp's K-shift after ``seq_add``); same rope attrs as ``rope``.
``ssm_conv``        (window [S, K-1, C], x [S, T, C], w [C, K]) → [S, T, C]: the short causal depthwise
                    convolution of each of S sequences (llama.cpp's ``ggml_ssm_conv`` over
                    ``concat(window, x)``): ``out[s, t, c] = Σ_k xx[s, t + k, c] · w[c, k]`` with
                    ``xx = concat(window, x)`` along the time axis; ``window`` is the carried state (the
                    K-1 inputs before this ubatch, zeros for a new sequence).
``conv_window``     (window [S, K-1, C], x [S, T, C]) → [S, K-1, C]: the last K-1 rows of
                    ``concat(window, x)``, the state the next ubatch carries.
``ssm_scan``        (state [S, H, P, N], x [S, T, H, P], dt [S, T, H], A [H] (any shape of H values),
                    B [S, T, G, N], C [S, T, G, N]) → [S, T·H·P + H·P·N]: Mamba-2's selective scan
                    (llama.cpp's ``ggml_ssm_scan`` with a scalar decay per head). Per token, with
                    ``d = softplus(dt)`` (``dt`` itself above 20) and head h reading group ``h // (H / G)``:
                    ``state = state · exp(d · A[h]) + B ⊗ (x · d)``, ``y = state · C`` (summed over N).
                    Each sequence's row holds its y [T, H, P] then its final state [H, P, N], flattened.
``gated_delta``     (state [S, H, Dv, Dk], q [S, T, Hk, Dk], k [S, T, Hk, Dk], v [S, T, H, Dv], g [S, T, H],
                    beta [S, T, H]) → [S, T·H·Dv + H·Dv·Dk]: the gated delta rule (Gated DeltaNet;
                    llama.cpp's ``ggml_gated_delta_net``). Head h reads q/k head ``h % Hk``; per token
                    ``M = M · exp(g)``, ``δ = (v - M k) · beta``, ``M = M + δ ⊗ k``, ``o = M q / √Dv``.
                    Each sequence's row holds its o [T, H, Dv] then its final M [H, Dv, Dk].
``sigmoid``         (x) → ``1 / (1 + exp(-x))``.
``softplus``        (x) → ``log(1 + exp(x))`` (ggml: ``x`` itself above 20).
==================  ===================================================================================

Mixture-of-experts ops (``build_moe_ffn``, :mod:`llmfw.core.ir.moe`; ids are int32, ``E`` experts, ``K`` chosen):

==================  ============================================================================
``softmax``         (x) → softmax over the last axis.
``sigmoid``         (x) → ``1 / (1 + exp(-x))``.
``div``             (a, b) elementwise with numpy broadcasting.
``sum_rows``        (x [..., n]) → [..., 1], the sum over the last axis (ggml_sum_rows).
``top_k``           (x [..., n]) → i32 [..., k]: the indices of the ``attrs["k"]`` largest entries of each row,
                    largest first (ggml_argsort_top_k).
``take``            (x [..., n], ids [..., k]) → [..., k]: ``take_along_axis(x, ids, -1)`` (leading dims equal).
``id_mask``         (x [..., n], ids [..., k]) → [..., n]: 0 at the columns ``ids`` names, -inf elsewhere.
``mul_mat_id``      (w [E, n_out, n_in], x [T, n_in] or [T, K, n_in], ids [T, K]) → [T, K, n_out]: row (t, j)
                    is ``x[t(, j)] @ w[ids[t, j]].T`` (ggml_mul_mat_id); only the chosen experts are computed.
``add_id``          (a [T, K, n], b [E, n], ids [T, K]) → ``a + b[ids]`` (ggml_add_id: per-expert biases).
``swiglu_oai``      (gate, up) → ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)``,
                    ``u = clip(up, -limit, limit)``; attrs ``alpha``, ``limit`` (gpt-oss's experts).
``concat``          (a, b) → the two joined along the last axis (other dims equal; DeepSeek's MLA).
``mul_mat_heads``   (w [H, n_out, n_in], x [T, H, n_in]) → [T, H, n_out]: head h's rows times its own matrix
                    (MLA's absorbed ``attn_k_b`` / ``attn_v_b``).
==================  ===================================================================================
=======
Recurrent state (issue 34) travels as graph inputs and outputs, not as backend storage: the memory gathers the
ubatch's sequences' states into the input ``rs:<kind>:<layer>`` f32 [S, ...] (S = ``BuildParams.n_seqs``
sequences of ``n_tokens / S`` tokens each, laid out sequence after sequence: llama.cpp's equal split) and reads
the graph output of the same name back after the compute (``GraphBuilder.build_rs`` / ``store_rs``).

``get_rows`` also selects rows of activations (``table`` is then any [N, ...] node), e.g. the output rows
before the head. Nodes are executed even when nothing consumes them (``attention`` / ``k_shift`` write the
cache).

Graph outputs are named: ``logits`` f32 [n_outputs, n_vocab], or in embeddings mode (``BuildParams.embeddings``)
``embd`` f32 [n_outputs, n_embd], the final hidden state after the output norm.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Literal, Mapping, Protocol, Sequence

from ..errors import ModelError
from .moe import build_moe_ffn

if TYPE_CHECKING:
    from .hparams import HParams

#: a dimension: a concrete size, or ``DYNAMIC`` when only the running graph knows it (a graph input whose length
#: the builder cannot see, e.g. the K-shift's ``n_kv``)
DYNAMIC = -1
Shape = tuple[int, ...]
#: element types of graph values: activations and weights are float32 to every op (whatever a backend stores),
#: token ids and positions int32, KV cell indices int64
DType = Literal["f32", "i32", "i64"]
#: what an attribute may hold (numbers, names, shapes, the part names of a fused weight)
AttrValue = int | float | str | bool | None | tuple[int, ...] | tuple[str, ...]
Attrs = dict[str, AttrValue]


@dataclass(eq=False)
class Node:
    """One op application. Identity is by object: two equal-looking nodes are still two nodes.

    ``shape`` / ``dtype`` are computed from the op table when the node is built (:meth:`Graph.add`) and are
    None only in hand-built graphs whose leaves were given none (tests of one backend kernel)."""

    id: int
    op: str
    inputs: tuple["Node", ...] = ()
    attrs: Attrs = field(default_factory=dict)
    #: layer index that owns this node (-1: input side before layer 0, n_layer: output side), for placement
    layer: int = -1
    name: str = ""
    shape: Shape | None = None
    dtype: DType | None = None

    def __repr__(self) -> str:
        args = ", ".join(f"%{i.id}" for i in self.inputs)
        label = f" {self.name}" if self.name else ""
        typed = f" {self.dtype}{list(self.shape)}" if self.shape is not None else ""
        return f"%{self.id} = {self.op}({args}){label} L{self.layer}{typed} {self.attrs or ''}"

    def attr_int(self, key: str, default: int | None = None) -> int:
        return int(self._attr(key, default))  # type: ignore[arg-type]

    def attr_float(self, key: str, default: float | None = None) -> float:
        return float(self._attr(key, default))  # type: ignore[arg-type]

    def attr_str(self, key: str) -> str:
        return str(self._attr(key, None))

    def _attr(self, key: str, default: AttrValue) -> AttrValue:
        value = self.attrs.get(key, default)
        if value is None:
            raise ModelError(f"graph node {self!r} lacks attribute {key!r}")
        return value


class ShapeError(ValueError):
    """Raised by an op's inference rule; :meth:`Graph.add` turns it into a ModelError naming the node."""


# ---------------------------------------------------------------------------------------------------------
# the op table: arity and shape / dtype inference of every op
# ---------------------------------------------------------------------------------------------------------

Inference = Callable[[Sequence["Node"], Mapping[str, AttrValue]], tuple[Shape, DType]]


@dataclass(frozen=True)
class OpSpec:
    """An op's arity (``min_inputs`` .. ``max_inputs``) and its output shape / dtype rule (None for leaves)."""

    min_inputs: int
    max_inputs: int
    infer: Inference | None


def _typed(node: Node) -> tuple[Shape, DType]:
    assert node.shape is not None and node.dtype is not None
    return node.shape, node.dtype


def _dims_match(a: int, b: int) -> bool:
    return a == b or DYNAMIC in (a, b)


def _require_float(node: Node, role: str) -> Shape:
    shape, dtype = _typed(node)
    if dtype != "f32":
        raise ShapeError(f"{role} must be f32, got {dtype} (%{node.id})")
    return shape


def _require_int(node: Node, role: str, ndim: int) -> Shape:
    shape, dtype = _typed(node)
    if dtype == "f32" or len(shape) != ndim:
        raise ShapeError(f"{role} must be a {ndim}-D integer tensor, got {dtype}{list(shape)} (%{node.id})")
    return shape


def broadcast(a: Shape, b: Shape) -> Shape:
    """numpy's broadcasting of two shapes (a DYNAMIC dimension matches anything)."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da == db or db == 1:
            out.append(da)
        elif da == 1:
            out.append(db)
        elif DYNAMIC in (da, db):
            out.append(DYNAMIC)
        else:
            raise ShapeError(f"shapes {list(a)} and {list(b)} do not broadcast")
    return tuple(reversed(out))


def _elementwise(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    shape = _require_float(inputs[0], "the input")
    for other in inputs[1:]:
        shape = broadcast(shape, _require_float(other, "an operand"))
    return shape, "f32"


def _normalised(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    """A norm of x, optionally × weight (and + bias): the weight broadcasts into x's shape, never beyond it."""
    shape = _require_float(inputs[0], "the normalised input")
    for operand in inputs[1:]:
        if broadcast(shape, _require_float(operand, "the norm weight")) != shape:
            raise ShapeError(f"norm weight {list(_typed(operand)[0])} does not fit the input {list(shape)}")
    return shape, "f32"


def _mul_mat(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    w = _require_float(inputs[0], "the matrix")
    x = _require_float(inputs[1], "the activations")
    if len(w) != 2 or not x or not _dims_match(w[1], x[-1]):
        raise ShapeError(f"cannot multiply activations {list(x)} by a matrix {list(w)} (needs [n_out, {x[-1:]}])")
    return x[:-1] + (w[0],), "f32"


def _get_rows(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    table = _require_float(inputs[0], "the table")
    (n_ids,) = _require_int(inputs[1], "the row ids", 1)
    if not table:
        raise ShapeError("cannot take rows of a scalar")
    return (n_ids,) + table[1:], "f32"


def _reshape(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    shape, dtype = _typed(inputs[0])
    target = attrs.get("shape")
    if not isinstance(target, tuple) or not all(isinstance(d, int) and d >= -1 for d in target) \
            or list(target).count(-1) > 1:
        raise ShapeError(f"reshape needs a shape attribute of sizes with at most one -1, got {target!r}")
    dims = tuple(int(d) for d in target)
    known = [d for d in dims if d != -1]
    size = _n_elements(shape)
    if size == DYNAMIC:
        return dims, dtype  # the -1 stays dynamic
    if -1 in dims:
        rest = _n_elements(tuple(known))
        if rest == 0 or size % rest:
            raise ShapeError(f"cannot reshape {list(shape)} to {list(dims)}")
        return tuple(size // rest if d == -1 else d for d in dims), dtype
    if _n_elements(dims) != size:
        raise ShapeError(f"cannot reshape {list(shape)} ({size} elements) to {list(dims)}")
    return dims, dtype


def _n_elements(shape: Shape) -> int:
    """Product of the sizes, or DYNAMIC when one is."""
    if DYNAMIC in shape:
        return DYNAMIC
    total = 1
    for d in shape:
        total *= d
    return total


def _slice(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    shape, dtype = _typed(inputs[0])
    axis, start, stop = attrs.get("axis", -1), attrs.get("start"), attrs.get("stop")
    if not isinstance(axis, int) or not -len(shape) <= axis < len(shape):
        raise ShapeError(f"slice axis {axis!r} is outside a {len(shape)}-D input")
    if not all(v is None or isinstance(v, int) for v in (start, stop)):
        raise ShapeError(f"slice bounds must be integers, got {start!r}:{stop!r}")
    out = list(shape)
    size = shape[axis]
    if size != DYNAMIC:
        out[axis] = len(range(*slice(start, stop).indices(size)))
    return tuple(out), dtype


def _rope(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    x = _require_float(inputs[0], "the rotated input")
    (n_pos,) = _require_int(inputs[1], "the positions", 1)
    n_dims = attrs.get("n_dims")
    if len(x) != 3 or not _dims_match(x[0], n_pos):
        raise ShapeError(f"rope needs x [T, H, D] and positions [T], got {list(x)} and [{n_pos}]")
    if not isinstance(n_dims, int) or not 0 < n_dims <= x[2] or n_dims % 2:
        raise ShapeError(f"rope n_dims {n_dims!r} must be even and within the head size {x[2]}")
    return x, "f32"


def _attention(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    q = _require_float(inputs[0], "q")
    k = _require_float(inputs[1], "k")
    v = _require_float(inputs[2], "v")
    (n_idx,) = _require_int(inputs[3], "kv_idx", 1)
    mask = _require_float(inputs[4], "the mask")
    if len(q) != 3 or len(k) != 3 or len(v) != 3 or len(mask) != 2:
        raise ShapeError(f"attention needs q/k/v [T, H, D] and a mask [T, n_kv], got {q}, {k}, {v}, {mask}")
    n_tokens = q[0]
    if not all(_dims_match(n_tokens, d) for d in (k[0], v[0], n_idx, mask[0])):
        raise ShapeError(f"attention inputs disagree on the token count: {q}, {k}, {v}, [{n_idx}], {mask}")
    if not (_dims_match(q[2], k[2]) and _dims_match(k[1], v[1])) or k[1] <= 0 or q[1] % k[1]:
        raise ShapeError(f"attention heads do not match: q {list(q)}, k {list(k)}, v {list(v)}")
    if len(inputs) > 5 and _require_float(inputs[5], "the sinks") != (q[1],):
        raise ShapeError(f"attention sinks must be one per query head ({q[1]}), got {list(_typed(inputs[5])[0])}")
    return (n_tokens, q[1] * v[2]), "f32"


def _k_shift(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    _require_int(inputs[0], "the shift", 1)
    return (0,), "f32"


# -- mixture-of-experts ops (see the MoE table in the module docstring) -------------------------------------

def _reduce_rows(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    shape = _require_float(inputs[0], "the summed input")
    if not shape:
        raise ShapeError("cannot sum the rows of a scalar")
    return shape[:-1] + (1,), "f32"


def _top_k(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    shape = _require_float(inputs[0], "the ranked input")
    k = attrs.get("k")
    too_many = bool(shape) and isinstance(k, int) and shape[-1] != DYNAMIC and k > shape[-1]
    if not shape or not isinstance(k, int) or k <= 0 or too_many:
        raise ShapeError(f"top_k needs 0 < k <= {shape[-1:]} entries per row, got k={k!r}")
    return shape[:-1] + (k,), "i32"


def _id_operands(inputs: Sequence[Node]) -> tuple[Shape, Shape]:
    """(x, ids) of ``take`` / ``id_mask``: ids integer, leading dims equal to x's."""
    x = _require_float(inputs[0], "the table")
    ids, dtype = _typed(inputs[1])
    if dtype == "f32" or len(ids) != len(x) or not all(_dims_match(a, b) for a, b in zip(x[:-1], ids[:-1])):
        raise ShapeError(f"ids {dtype}{list(ids)} do not index the rows of {list(x)}")
    return x, ids


def _take(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    _, ids = _id_operands(inputs)
    return ids, "f32"


def _id_mask(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    x, _ = _id_operands(inputs)
    return x, "f32"


def _mul_mat_id(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    w = _require_float(inputs[0], "the expert matrices")
    x = _require_float(inputs[1], "the activations")
    n_tokens, n_used = _require_int(inputs[2], "the expert ids", 2)
    if len(w) != 3:
        raise ShapeError(f"mul_mat_id needs expert matrices [E, n_out, n_in], got {list(w)}")
    fits = (len(x) == 2 or (len(x) == 3 and _dims_match(x[1], n_used))) and _dims_match(x[0], n_tokens)
    if not fits or not _dims_match(x[-1], w[2]):
        raise ShapeError(f"mul_mat_id: activations {list(x)} do not fit matrices {list(w)} and ids "
                         f"[{n_tokens}, {n_used}]")
    return (x[0], n_used, w[1]), "f32"


def _add_id(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    a = _require_float(inputs[0], "the expert outputs")
    b = _require_float(inputs[1], "the per-expert rows")
    ids = _require_int(inputs[2], "the expert ids", 2)
    if len(a) != 3 or len(b) != 2 or not _dims_match(a[2], b[1]) or \
            not all(_dims_match(x, y) for x, y in zip(a[:2], ids)):
        raise ShapeError(f"add_id needs a [T, K, n], b [E, n], ids [T, K]; got {list(a)}, {list(b)}, {list(ids)}")
    return a, "f32"


def _concat(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    a = _require_float(inputs[0], "the first part")
    b = _require_float(inputs[1], "the second part")
    if len(a) != len(b) or not a or not all(_dims_match(x, y) for x, y in zip(a[:-1], b[:-1])):
        raise ShapeError(f"concat needs equal leading dims, got {list(a)} and {list(b)}")
    last = DYNAMIC if DYNAMIC in (a[-1], b[-1]) else a[-1] + b[-1]
    return a[:-1] + (last,), "f32"


def _mul_mat_heads(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    w = _require_float(inputs[0], "the per-head matrices")
    x = _require_float(inputs[1], "the activations")
    if len(w) != 3 or len(x) != 3 or not _dims_match(w[0], x[1]) or not _dims_match(w[2], x[2]):
        raise ShapeError(f"mul_mat_heads needs w [H, n_out, n_in] and x [T, H, n_in], got {list(w)} and {list(x)}")
    return (x[0], x[1], w[1]), "f32"


#: the MoE ops, a block of their own in :data:`OP_TABLE`
MOE_OP_TABLE: Mapping[str, OpSpec] = {
    "softmax": OpSpec(1, 1, _elementwise),
    "sigmoid": OpSpec(1, 1, _elementwise),
    "div": OpSpec(2, 2, _elementwise),
    "sum_rows": OpSpec(1, 1, _reduce_rows),
    "top_k": OpSpec(1, 1, _top_k),
    "take": OpSpec(2, 2, _take),
    "id_mask": OpSpec(2, 2, _id_mask),
    "mul_mat_id": OpSpec(3, 3, _mul_mat_id),
    "add_id": OpSpec(3, 3, _add_id),
    "swiglu_oai": OpSpec(2, 2, _elementwise),
    "concat": OpSpec(2, 2, _concat),
    "mul_mat_heads": OpSpec(2, 2, _mul_mat_heads),
}


# -- recurrent ops (issue 34) -------------------------------------------------------------------------------

def _sequence_blocks(window: Node, x: Node) -> tuple[Shape, Shape]:
    """A carried window [S, K-1, C] and a ubatch [S, T, C] of the same S sequences and channels."""
    w = _require_float(window, "the carried window")
    xs = _require_float(x, "the input")
    if len(w) != 3 or len(xs) != 3 or not (_dims_match(w[0], xs[0]) and _dims_match(w[2], xs[2])):
        raise ShapeError(f"a carried window [S, K-1, C] and an input [S, T, C] are needed, got {list(w)} "
                         f"and {list(xs)}")
    return w, xs


def _ssm_conv(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    window, x = _sequence_blocks(inputs[0], inputs[1])
    kernel = _require_float(inputs[2], "the convolution kernel")
    if len(kernel) != 2 or not _dims_match(kernel[0], x[2]) or not _dims_match(kernel[1], window[1] + 1):
        raise ShapeError(f"the kernel must be [C, K] = [{x[2]}, {window[1] + 1}], got {list(kernel)}")
    return x, "f32"


def _conv_window(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    window, _ = _sequence_blocks(inputs[0], inputs[1])
    return window, "f32"


def _ssm_scan(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    state = _require_float(inputs[0], "the SSM state")
    x = _require_float(inputs[1], "x")
    dt, a, b, c = (_require_float(n, role) for n, role in zip(inputs[2:], ("dt", "A", "B", "C")))
    if len(state) != 4 or len(x) != 4 or len(dt) != 3 or len(b) != 4 or b != c:
        raise ShapeError(f"ssm_scan needs state [S, H, P, N], x [S, T, H, P], dt [S, T, H], B = C [S, T, G, N]; "
                         f"got {list(state)}, {list(x)}, {list(dt)}, {list(b)}, {list(c)}")
    n_seqs, n_head, head_dim, d_state = state
    if x[0] != n_seqs or x[2:] != (n_head, head_dim) or dt != x[:3] or b[:2] != x[:2] or b[3] != d_state \
            or b[2] <= 0 or n_head % b[2] or _n_elements(a) != n_head:
        raise ShapeError(f"ssm_scan operands disagree: state {list(state)}, x {list(x)}, dt {list(dt)}, A {list(a)}, "
                         f"B/C {list(b)}")
    return (n_seqs, _n_elements(x[1:]) + n_head * head_dim * d_state), "f32"


def _gated_delta(inputs: Sequence[Node], attrs: Mapping[str, AttrValue]) -> tuple[Shape, DType]:
    state = _require_float(inputs[0], "the delta-rule state")
    q, k, v, g, beta = (_require_float(n, role) for n, role in zip(inputs[1:], ("q", "k", "v", "g", "beta")))
    if len(state) != 4 or len(q) != 4 or k != q or len(v) != 4 or g != v[:3] or beta != v[:3]:
        raise ShapeError(f"gated_delta needs state [S, H, Dv, Dk], q = k [S, T, Hk, Dk], v [S, T, H, Dv], "
                         f"g = beta [S, T, H]; got {list(state)}, {list(q)}, {list(k)}, {list(v)}, {list(g)}, "
                         f"{list(beta)}")
    n_seqs, n_head, d_v, d_k = state
    if v[0] != n_seqs or q[:2] != v[:2] or v[2:] != (n_head, d_v) or q[3] != d_k or q[2] <= 0 or n_head % q[2]:
        raise ShapeError(f"gated_delta operands disagree: state {list(state)}, q/k {list(q)}, v {list(v)}")
    return (n_seqs, _n_elements(v[1:]) + n_head * d_v * d_k), "f32"


#: every op of the IR: arity and shape rule. A backend lists the subset it implements in
#: ``Backend.supported_ops``; ops a backend adds through its rewrite rules are not here (see core/ir/passes.py)
OP_TABLE: Mapping[str, OpSpec] = {
    "input": OpSpec(0, 0, None),
    "weight": OpSpec(0, 0, None),
    "get_rows": OpSpec(2, 2, _get_rows),
    "mul_mat": OpSpec(2, 2, _mul_mat),
    "add": OpSpec(2, 2, _elementwise),
    "sub": OpSpec(2, 2, _elementwise),
    "mul": OpSpec(2, 2, _elementwise),
    "scale": OpSpec(1, 1, _elementwise),
    "rms_norm": OpSpec(1, 2, _normalised),
    "norm": OpSpec(1, 2, _normalised),
    "silu": OpSpec(1, 1, _elementwise),
    "relu": OpSpec(1, 1, _elementwise),
    "gelu": OpSpec(1, 1, _elementwise),
    "softcap": OpSpec(1, 1, _elementwise),
    "clamp": OpSpec(1, 1, _elementwise),
    "reshape": OpSpec(1, 1, _reshape),
    "slice": OpSpec(1, 1, _slice),
    "rope": OpSpec(2, 3, _rope),
    "attention": OpSpec(5, 6, _attention),
    "k_shift": OpSpec(1, 2, _k_shift),
    **MOE_OP_TABLE,
    # recurrent layers (issue 34): pure functions of the carried state, see "recurrent ops" below
    "ssm_conv": OpSpec(3, 3, _ssm_conv),
    "conv_window": OpSpec(2, 2, _conv_window),
    "ssm_scan": OpSpec(6, 6, _ssm_scan),
    "gated_delta": OpSpec(6, 6, _gated_delta),
    "softplus": OpSpec(1, 1, _elementwise),
}
OPS = frozenset(OP_TABLE)
#: the ops added for recurrent layers (issue 34): a backend without kernels for them leaves them to the host backend
RECURRENT_OPS = frozenset({"ssm_conv", "conv_window", "ssm_scan", "gated_delta", "sigmoid", "softplus"})
#: the recurrent ops whose time loop only the host backend implements yet (other backends leave them to it)
SCAN_OPS = frozenset({"ssm_scan", "gated_delta"})


def infer_type(node: Node) -> None:
    """Set ``node.shape`` / ``node.dtype`` from the op table (left None when an input is untyped); a
    malformed node (wrong arity, shapes that do not fit) is a ModelError naming it."""
    spec = OP_TABLE.get(node.op)
    if spec is None:
        raise ModelError(f"unknown graph op {node.op!r}; known: {', '.join(sorted(OPS))}")
    if not spec.min_inputs <= len(node.inputs) <= spec.max_inputs:
        raise ModelError(f"graph node {node!r}: op {node.op!r} takes {spec.min_inputs}..{spec.max_inputs} "
                         f"inputs, got {len(node.inputs)}")
    if spec.infer is None or any(i.shape is None or i.dtype is None for i in node.inputs):
        return
    try:
        node.shape, node.dtype = spec.infer(node.inputs, node.attrs)
    except ShapeError as exc:
        raise ModelError(f"graph node {node!r}: {exc}") from None


@dataclass(eq=False)
class Graph:
    """Nodes in topological order, named inputs and named outputs."""

    nodes: list[Node] = field(default_factory=list)
    inputs: dict[str, Node] = field(default_factory=dict)
    outputs: dict[str, Node] = field(default_factory=dict)

    def add(self, op: str, *inputs: Node, layer: int = -1, name: str = "", **attrs: AttrValue) -> Node:
        """A new node, typed and checked by the op table (``input`` / ``weight`` leaves: see :meth:`leaf`)."""
        return self.add_node(op, inputs, attrs, layer, name)

    def add_node(self, op: str, inputs: Sequence[Node], attrs: Mapping[str, AttrValue], layer: int = -1,
                 name: str = "") -> Node:
        """:meth:`add` with the attributes as a mapping (they may then include ``layer``, as attention's do)."""
        if op not in OPS:
            raise ValueError(f"unknown graph op {op!r}; known: {', '.join(sorted(OPS))}")
        node = Node(len(self.nodes), op, tuple(inputs), dict(attrs), layer, name)
        infer_type(node)
        self.nodes.append(node)
        return node

    def leaf(self, op: Literal["input", "weight"], name: str, shape: Shape, dtype: DType = "f32",
             layer: int = -1) -> Node:
        """An ``input`` (registered in :attr:`inputs`) or ``weight`` node named ``name`` with its type."""
        node = Node(len(self.nodes), op, (), {"name": name}, layer, name, tuple(int(d) for d in shape), dtype)
        self.nodes.append(node)
        if op == "input":
            self.inputs[name] = node
        return node

    def renumber(self) -> None:
        """Make every node's id its index again (after a pass inserted or removed nodes)."""
        for index, node in enumerate(self.nodes):
            node.id = index

    def __str__(self) -> str:
        return "\n".join(map(repr, self.nodes))


def consumers_of(nodes: Sequence[Node]) -> dict[int, list[Node]]:
    """The consumer map: node id → the nodes (in order) that read it. The one every pass and backend uses."""
    users: dict[int, list[Node]] = {}
    for node in nodes:
        for inp in node.inputs:
            users.setdefault(inp.id, []).append(node)
    return users


def last_uses(nodes: Sequence[Node], keep: Collection[int]) -> dict[int, tuple[int, ...]]:
    """Liveness: index ``i`` in ``nodes`` → ids of the values nothing after node ``i`` reads, so a backend may
    free them once node ``i`` ran. Weights (they live on) and the ids in ``keep`` (outputs) are never listed."""
    last: dict[int, int] = {}
    for index, node in enumerate(nodes):
        for inp in node.inputs:
            if inp.op != "weight":
                last[inp.id] = index
    dead: dict[int, list[int]] = {}
    for value_id, index in last.items():
        if value_id not in keep:
            dead.setdefault(index, []).append(value_id)
    return {index: tuple(ids) for index, ids in dead.items()}


class RopeAttrs(Protocol):
    """A layer's RoPE parameters, as the attributes of its ``rope`` node."""

    def attrs(self) -> dict[str, Any]: ...


class GraphArchitecture(Protocol):
    """What the builder calls back into a model family for (:class:`llmfw.core.arch.architecture.Architecture`,
    one layer up, fills it in)."""

    def build_graph(self, b: "GraphBuilder") -> None: ...

    def rope_params(self, hp: "HParams", il: int) -> RopeAttrs: ...

    def rope_factors_for(self, b: "GraphBuilder", il: int) -> str | None: ...

    def recurrent_state(self, hp: "HParams", il: int) -> Mapping[str, tuple[int, ...]] | None: ...

    def has_kv(self, hp: "HParams", il: int) -> bool: ...

    def has_rope(self, hp: "HParams", il: int) -> bool: ...


class GraphModel(Protocol):
    """What the graph builder needs of a model: hyperparameters, architecture, and its weights' types."""

    @property
    def known_hparams(self) -> "HParams": ...

    @property
    def known_arch(self) -> GraphArchitecture: ...

    def has_weight(self, name: str) -> bool: ...

    def weight_layer(self, name: str) -> int: ...

    def weight_shape(self, name: str) -> Shape: ...


# ---------------------------------------------------------------------------------------------------------
# GraphBuilder: the shared blocks architectures are written with
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BuildParams:
    """Everything a graph's *shape* depends on. Two ubatches with equal BuildParams can share one graph
    (llama.cpp's graph reuse): only the input values (tokens, positions, KV indices, mask) differ."""

    n_tokens: int
    n_outputs: int
    use_embd: bool = False
    #: (cache name, n_kv) for every KV cache, n_kv padded so that it changes rarely
    n_kv: tuple[tuple[str, int], ...] = ()
    #: context size per sequence (llama.cpp's n_ctx_seq; 0 = unknown): Phi-3's LongRoPE picks its long or
    #: short frequency factors by it
    n_ctx_seq: int = 0
    #: embeddings mode (llama.cpp's ``cparams.embeddings``): the graph ends at the output norm, with an ``embd``
    #: output instead of ``logits`` (the head is not computed)
    embeddings: bool = False
    #: sequences in the ubatch, each with ``n_tokens / n_seqs`` tokens in a row (a recurrent memory's equal split;
    #: 1 for a KV-only memory, whose ubatches are not laid out by sequence)
    n_seqs: int = 1


class GraphBuilder:
    """Builds one ubatch's graph. Architectures call the shared ``build_*`` blocks and only spell out what
    differs. ``b.hp`` are the hyperparameters, ``b.params`` the :class:`BuildParams`.

    Node ownership (``Node.layer``) drives placement: iterate the blocks with ``for il in b.layers():`` so
    every node created inside belongs to layer ``il``; ``build_inp_embd`` belongs to the input side and
    ``build_output`` to the output side (``n_layer``).
    """

    def __init__(self, model: GraphModel, params: BuildParams, cache_of_layer: Callable[[int], str] | None = None):
        self.model = model
        self.hp = model.known_hparams
        self.arch = model.known_arch
        self.params = params
        self.graph = Graph()
        self.layer = -1
        self._cache_of_layer = cache_of_layer or (lambda il: "kv")
        self._weights: dict[str, Node] = {}
        self._out_ids: Node | None = None

    # -- primitives --------------------------------------------------------------------------------------
    def op(self, op: str, *inputs: Node, name: str = "", **attrs: AttrValue) -> Node:
        """Add a node owned by the current layer (``attrs`` may include ``layer``, e.g. for attention)."""
        return self.graph.add_node(op, inputs, attrs, self.layer, name)

    def input(self, name: str) -> Node:
        """The graph input ``name`` (created once; see the op table for standard names and types)."""
        node = self.graph.inputs.get(name)
        if node is None:
            shape, dtype = self._input_type(name)
            node = self.graph.leaf("input", name, shape, dtype)
        return node

    def _input_type(self, name: str) -> tuple[Shape, DType]:
        """Shape and dtype of a standard graph input under this ubatch's build parameters."""
        p = self.params
        if name.startswith("rs:"):
            return self._recurrent_state_type(name)
        kind, _, cache = name.partition(":")
        n_kv = dict(p.n_kv).get(cache, DYNAMIC)
        types: dict[str, tuple[Shape, DType]] = {
            "tokens": ((p.n_tokens,), "i32"), "pos": ((p.n_tokens,), "i32"), "out_ids": ((p.n_outputs,), "i32"),
            "embd": ((p.n_tokens, self.hp.n_embd), "f32"), "kv_idx": ((p.n_tokens,), "i64"),
            "kq_mask": ((p.n_tokens, n_kv), "f32"), "k_shift": ((DYNAMIC,), "i32"),
            "attn_temp": ((p.n_tokens, 1, 1), "f32"),
        }
        if kind not in types:
            raise ModelError(f"unknown graph input {name!r}; known: {', '.join(sorted(types))} (<kind>:<cache> "
                             f"for kv_idx, kq_mask, k_shift)")
        return types[kind]

    def _recurrent_state_type(self, name: str) -> tuple[Shape, DType]:
        """``rs:<kind>:<layer>``: that state of each of the ubatch's sequences, [n_seqs, *shape]."""
        _, kind, layer = (name.split(":") + ["", ""])[:3]
        shapes = self.arch.recurrent_state(self.hp, int(layer)) if layer.isdigit() else None
        if not shapes or kind not in shapes:
            raise ModelError(f"graph input {name!r}: {self.hp.arch!r} declares no recurrent state {kind!r} for "
                             f"layer {layer!r} (Architecture.recurrent_state)")
        return (self.params.n_seqs, *shapes[kind]), "f32"

    def has_weight(self, name: str) -> bool:
        return self.model.has_weight(name)

    def weight(self, name: str) -> Node:
        """The weight node for tensor ``name`` (ModelError if the model has no such tensor)."""
        node = self._weights.get(name)
        if node is None:
            if not self.model.has_weight(name):
                raise ModelError(f"the graph of {self.hp.arch!r} needs tensor {name!r}, which the model lacks")
            node = self.graph.leaf("weight", name, self.model.weight_shape(name),
                                   layer=self.model.weight_layer(name))
            self._weights[name] = node
        return node

    def layers(self) -> Iterator[int]:
        """Iterate layer indices, making each the owner of the nodes created in its iteration."""
        for il in range(self.hp.n_layer):
            self.layer = il
            yield il
        self.layer = self.hp.n_layer

    def cache_of_layer(self, il: int) -> str:
        """Name of the KV cache layer ``il`` writes to (memory modules with several caches differ)."""
        return self._cache_of_layer(il)

    def mul_mat(self, weight_name: str, x: Node, bias_name: str | None = None) -> Node:
        """``x @ W.T`` (+ bias when ``bias_name`` is given and present in the model)."""
        out = self.op("mul_mat", self.weight(weight_name), x)
        if bias_name and self.has_weight(bias_name):
            out = self.op("add", out, self.weight(bias_name))
        return out

    # -- shared blocks -----------------------------------------------------------------------------------
    def build_inp_embd(self, table: str = "token_embd.weight") -> Node:
        """Token embeddings [T, n_embd] (get_rows on the embedding table), or the ``embd`` input."""
        self.layer = -1
        if self.params.use_embd:
            return self.input("embd")
        return self.op("get_rows", self.weight(table), self.input("tokens"), name="inp_embd")

    def build_norm(self, x: Node, weight: str | None, kind: str = "rms", bias: str | None = None,
                   eps: float | None = None) -> Node:
        """RMS norm (``kind="rms"``) or layer norm (``"layer"``), then × weight (+ bias) when given."""
        if kind == "rms":
            out = self.op("rms_norm", x, eps=self.hp.f_norm_rms_eps if eps is None else eps)
        elif kind == "layer":
            out = self.op("norm", x, eps=self.hp.f_norm_eps if eps is None else eps)
        else:
            raise ValueError(f"norm kind must be 'rms' or 'layer', got {kind!r}")
        if weight:
            out = self.op("mul", out, self.weight(weight))
        if bias and self.has_weight(bias):
            out = self.op("add", out, self.weight(bias))
        return out

    def build_rope(self, x: Node, il: int | None = None) -> Node:
        """Rotate ``x`` [T, H, D] at the ubatch positions with the layer's rope parameters (and factors)."""
        il = self.layer if il is None else il
        return self.op("rope", x, self.input("pos"), *self._rope_factors(il),
                       **self.arch.rope_params(self.hp, il).attrs())

    def _rope_factors(self, il: int) -> list[Node]:
        """The layer's frequency-factor weight as an extra rope input, or nothing."""
        factors = self.arch.rope_factors_for(self, il)
        return [self.weight(factors)] if factors is not None and self.has_weight(factors) else []

    def build_qkv(self, x: Node, il: int | None = None, prefix: str | None = None) -> tuple[Node, Node, Node]:
        """Q, K, V projections (+ optional biases) reshaped to [T, H, Dk], [T, Hkv, Dk], [T, Hkv, Dv].

        A fused ``attn_qkv.weight`` (rows: Q, then K, then V; Phi-3, Falcon...) is used when the model has it,
        with its ``attn_qkv.bias`` or else separate Q/K/V biases, like llama.cpp's ``build_qkv``."""
        il = self.layer if il is None else il
        p = prefix or f"blk.{il}"
        hp = self.hp
        if self.has_weight(f"{p}.attn_qkv.weight"):
            n_q, n_k = hp.head_dim_k(il) * hp.n_head(il), hp.n_embd_k_gqa(il)
            fused_bias = self.has_weight(f"{p}.attn_qkv.bias")
            qkv = self.mul_mat(f"{p}.attn_qkv.weight", x, f"{p}.attn_qkv.bias")
            bounds = {"q": (0, n_q), "k": (n_q, n_q + n_k), "v": (n_q + n_k, n_q + n_k + hp.n_embd_v_gqa(il))}
            parts = []
            for part, (start, stop) in bounds.items():
                out = self.op("slice", qkv, axis=-1, start=start, stop=stop)
                if not fused_bias and self.has_weight(f"{p}.attn_{part}.bias"):
                    out = self.op("add", out, self.weight(f"{p}.attn_{part}.bias"))
                parts.append(out)
            q, k, v = parts
        else:
            q = self.mul_mat(f"{p}.attn_q.weight", x, f"{p}.attn_q.bias")
            k = self.mul_mat(f"{p}.attn_k.weight", x, f"{p}.attn_k.bias")
            v = self.mul_mat(f"{p}.attn_v.weight", x, f"{p}.attn_v.bias")
        q = self.op("reshape", q, shape=(-1, hp.n_head(il), hp.head_dim_k(il)))
        k = self.op("reshape", k, shape=(-1, hp.n_head_kv(il), hp.head_dim_k(il)))
        v = self.op("reshape", v, shape=(-1, hp.n_head_kv(il), hp.head_dim_v(il)))
        return q, k, v

    def build_attn(self, q: Node, k: Node, v: Node, il: int | None = None, *, out_weight: str | None = None,
                   out_bias: str | None = None, kq_scale: float | None = None, softcap: float | None = None,
                   sinks: str | None = None) -> Node:
        """Attention over the KV cache (GQA, mask, optional soft-capping), then the output projection.

        Writes k, v into the layer's cache cells for this ubatch; ``out_weight`` defaults to
        ``blk.{il}.attn_output.weight`` (pass ``""`` to skip the projection); ``sinks`` names a per-head
        attention-sink weight (gpt-oss).
        """
        il = self.layer if il is None else il
        cache = self.cache_of_layer(il)
        out = self.op(
            "attention", q, k, v, self.input(f"kv_idx:{cache}"), self.input(f"kq_mask:{cache}"),
            *([self.weight(sinks)] if sinks else []),
            layer=il, cache=cache, scale=self.hp.kq_scale if kq_scale is None else kq_scale,
            softcap=self.hp.f_attn_logit_softcapping if softcap is None else softcap, window=self._window(il),
        )
        if out_weight is None:
            out_weight = f"blk.{il}.attn_output.weight"
            out_bias = out_bias or f"blk.{il}.attn_output.bias"
        if out_weight:
            out = self.mul_mat(out_weight, out, out_bias)
        return out

    def _window(self, il: int) -> int:
        """The standard sliding window of layer ``il``'s mask (0: none, or a chunked / symmetric window)."""
        hp = self.hp
        return hp.n_swa if hp.is_swa(il) and hp.swa_type == "standard" and hp.n_swa > 0 else 0

    def build_ffn(self, x: Node, il: int | None = None, *, act: str = "silu", gated: bool = True,
                  up: str | None = None, gate: str | None = None, down: str | None = None,
                  gate_in_up: bool = False) -> Node:
        """Feed-forward: ``down(act(gate(x)) * up(x))`` when gated (SwiGLU / GeGLU), else ``down(act(up(x)))``.
        Biases ``*.bias`` are added when present. ``gate_in_up``: the up projection holds the gate rows first,
        then the up rows (Phi-3's fused ``ffn_up``; llama.cpp's LLM_FFN_SWIGLU with no gate tensor)."""
        il = self.layer if il is None else il
        up = up or f"blk.{il}.ffn_up.weight"
        gate = gate or f"blk.{il}.ffn_gate.weight"
        down = down or f"blk.{il}.ffn_down.weight"
        h = self.mul_mat(up, x, _bias_of(up))
        if gate_in_up:
            n_ff = self.hp.n_ff(il)
            g = self.op(act, self.op("slice", h, axis=-1, start=0, stop=n_ff))
            h = self.op("mul", g, self.op("slice", h, axis=-1, start=n_ff, stop=2 * n_ff))
        elif gated:
            g = self.op(act, self.mul_mat(gate, x, _bias_of(gate)))
            h = self.op("mul", g, h)
        else:
            h = self.op(act, h)
        return self.mul_mat(down, h, _bias_of(down))

    def build_moe_ffn(self, x: Node, il: int | None = None, **options: "object") -> Node:
        """Mixture-of-experts feed-forward of ``x`` [T, n_embd] (llama.cpp's ``build_moe_ffn``): router, top-k,
        the chosen experts' FFNs weighted and summed, plus shared experts. See :func:`llmfw.core.ir.moe.build_moe_ffn`
        for the options (gating, weight normalisation and scale, activation, tensor names)."""
        return build_moe_ffn(self, x, self.layer if il is None else il, **options)  # type: ignore[arg-type]

    def build_inp_out_ids(self) -> Node:
        """The ``out_ids`` input (rows to output). Unlike llama.cpp it is there even when every token is an
        output: the prompt and decode graphs then have one structure, so a backend that compiles (and prepacks
        weights) per structure — onnx — keeps one program, not two."""
        if self._out_ids is None:
            self._out_ids = self.input("out_ids")
        return self._out_ids

    def add_residual(self, h: Node, residual: Node, il: int | None = None) -> Node:
        """``h + residual`` after layer ``il``'s attention; in the last layer only the output rows of both are
        kept first (llama.cpp selects them there, before the FFN)."""
        il = self.layer if il is None else il
        if il == self.hp.n_layer - 1:
            h, residual = self.select_outputs(h, residual)
        return self.op("add", h, residual)

    def select_outputs(self, *nodes: Node) -> tuple[Node, ...]:
        """Keep only the output rows of each node (llama.cpp does it in the last layer, before the FFN)."""
        out_ids = self.build_inp_out_ids()
        return tuple(self.op("get_rows", n, out_ids) for n in nodes)

    def build_output(self, x: Node, *, norm: str | None = "output_norm.weight", norm_kind: str = "rms",
                     head: str = "output.weight", softcap: float | None = None) -> Node:
        """Final norm → output head → optional final soft-capping; sets ``graph.outputs["logits"]``.
        Rows not yet reduced to the outputs are selected here. In embeddings mode the graph stops after the
        norm (llama.cpp's ``t_embd``, "result_norm") and sets ``graph.outputs["embd"]`` instead."""
        self.layer = self.hp.n_layer
        if not self._selected(x):
            (x,) = self.select_outputs(x)
        if norm:
            x = self.build_norm(x, norm, norm_kind, bias=norm.replace(".weight", ".bias"))
        if self.params.embeddings:
            self.graph.outputs["embd"] = x
            return x
        logits = self.mul_mat(head, x, _bias_of(head))  # a head bias is used when the model has one (qwen2)
        cap = self.hp.f_final_logit_softcapping if softcap is None else softcap
        if cap:
            logits = self.op("softcap", logits, cap=cap)
        self.graph.outputs["logits"] = logits
        return logits

    def _selected(self, x: Node) -> bool:
        """Whether ``x`` already depends on the out_ids selection."""
        if self._out_ids is None:
            return False
        stack, seen = [x], set[int]()
        while stack:
            n = stack.pop()
            if n is self._out_ids:
                return True
            if id(n) in seen:
                continue
            seen.add(id(n))
            stack.extend(n.inputs)
        return False

    # -- recurrent state (issue 34) ------------------------------------------------------------------------
    def build_rs(self, kind: str, il: int | None = None) -> Node:
        """The carried state ``kind`` of layer ``il`` for the ubatch's sequences, f32 [n_seqs, *shape]."""
        return self.input(f"rs:{kind}:{self.layer if il is None else il}")

    def store_rs(self, kind: str, state: Node, il: int | None = None) -> None:
        """Hand the updated state back to the memory (a graph output of the input's name)."""
        name = f"rs:{kind}:{self.layer if il is None else il}"
        expected = self.input(name).shape
        if state.shape != expected:
            raise ModelError(f"the new state {name!r} has shape {state.shape}, the memory holds {expected}")
        self.graph.outputs[name] = state

    def by_sequence(self, x: Node) -> Node:
        """[T, C] → [n_seqs, T / n_seqs, C]: the ubatch's tokens grouped by sequence (equal split)."""
        return self.op("reshape", x, shape=(self.params.n_seqs, -1, x.shape[-1] if x.shape else -1))

    def build_short_conv(self, x: Node, kernel: str, kind: str = "conv") -> Node:
        """A short causal convolution over each sequence's tokens with its carried window: ``x`` [T, C] →
        [T, C]; the window (state ``kind``, [K-1, C] per sequence) moves on by the ubatch's tokens."""
        seqs = self.by_sequence(x)
        window = self.build_rs(kind)
        out = self.op("ssm_conv", window, seqs, self.weight(kernel))
        self.store_rs(kind, self.op("conv_window", window, seqs))
        return self.op("reshape", out, shape=(-1, out.shape[-1] if out.shape else -1))

    # -- memory maintenance graphs -----------------------------------------------------------------------
    def build_k_shift(self, cache: str, layers: list[int]) -> Graph:
        """llama.cpp's K-shift: re-rope the cached K of ``layers`` by the ``k_shift:<cache>`` input."""
        shift = self.input(f"k_shift:{cache}")
        for il in layers:
            if not self.arch.has_rope(self.hp, il):
                continue  # a layer without RoPE has nothing to re-rotate
            self.layer = il
            self.op("k_shift", shift, *self._rope_factors(il), layer=il, cache=cache,
                    **self.arch.rope_params(self.hp, il).attrs())
        return self.graph


def _bias_of(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".bias" if weight_name.endswith(".weight") else weight_name + ".bias"
