"""The op table: every graph op, its semantics, its arity and its shape / dtype inference.

Ops (inputs in order; attributes in ``Node.attrs``):

==================  ===================================================================================
``input``           a graph input set per ubatch. attrs: ``name``. Standard names: ``tokens`` int32 [T],
                    ``embd`` f32 [T, n_embd], ``pos`` int32 [T], ``out_ids`` int32 [n_outputs],
                    ``attn_temp`` f32 [T, 1, 1] (a per-position query scale, Architecture.ubatch_inputs),
                    ``kv_idx:<cache>`` int64 [T] (KV cells written by this ubatch), ``kq_mask:<cache>``
                    f32 [T, n_kv] (0 = visible, -inf = hidden) and ``kv_order:<cache>`` int32 [n_kv] (the
                    cells ``0 .. n_kv-1`` by ascending position, ties by cell) for each KV cache ``<cache>``.
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
                    After the mask, optionally ``kv_order`` int32 [n_kv] (the cells by ascending position: a
                    backend that sums the visible cells in this order gives a row the same bits wherever its
                    cells sit, a sliding window's ring that wrapped included; a backend may ignore it), then
                    optionally ``sinks`` f32 [H] (gpt-oss's attention sinks), which adds ``exp(sinks[h])`` to
                    each row's softmax denominator: a logit that takes probability but has no value.
                    :func:`attention_extras` tells them apart.
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

``get_rows`` also selects rows of activations (``table`` is then any [N, ...] node), e.g. the output rows
before the head. Nodes are executed even when nothing consumes them (``attention`` / ``k_shift`` write the
cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..errors import ModelError
from .node import DYNAMIC, AttrValue, DType, Node, Shape, ShapeError

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
    order, sinks = attention_extras(inputs)
    if len(inputs) > 5 + (order is not None) + (sinks is not None):
        raise ShapeError("attention takes at most one kv_order (an integer input) then one sinks input after the mask")
    if order is not None and not _dims_match(_require_int(order, "kv_order", 1)[0], mask[1]):
        raise ShapeError(f"attention kv_order must list the mask's {mask[1]} cells, got {list(_typed(order)[0])}")
    if sinks is not None and _require_float(sinks, "the sinks") != (q[1],):
        raise ShapeError(f"attention sinks must be one per query head ({q[1]}), got {list(_typed(sinks)[0])}")
    return (n_tokens, q[1] * v[2]), "f32"


def attention_extras(inputs: Sequence[Node]) -> tuple[Node | None, Node | None]:
    """The optional inputs of an ``attention`` node after its mask: (``kv_order``, ``sinks``), None where absent
    (the order is the integer one, and comes first)."""
    extras = list(inputs[5:7])
    order = extras.pop(0) if extras and extras[0].dtype in ("i32", "i64") else None
    return order, (extras[0] if extras else None)


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
    "attention": OpSpec(5, 7, _attention),
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
