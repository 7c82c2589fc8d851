"""ONNX translation of RoPE, the KV cache and attention, mixed into :class:`.translate.SplitTranslator`.

The KV cache of a layer is a pair of float32 arrays ``[n_head_kv, n_cells, head_dim]``. The ``attention`` node
writes the ubatch's K/V rows with ``ScatterND`` whose input and output are bound (IOBinding) to the *same*
buffer, so ONNX Runtime updates the cache in place — no cache-sized copy per token.

The attention form (``attention``, see :mod:`.fused`): ``"op"`` translates it op by op; ``"gqa"`` makes each
``attention`` one ``GroupQueryAttention`` (a model for the batches whose cells are one causal run); with
``"switch"`` each ``attention`` is an ``If`` on the graph input ``use_gqa``:
one ``GroupQueryAttention`` whose past and present K/V are the cache's own memory, seen as
``[1, Hkv, n_cells, D]``, for a batch whose cells are one causal run, else the op-by-op attention over the same
memory — one model (one session: ORT prepacks the weights per session) for every batch. Both branches write the
cache in place: the If's cache outputs are bound to the caches' buffers, and ORT hands them to the branch.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import Node, Shape
from llmfw.core.ir.ops import attention_extras
from llmfw.core.ir.rope import rope_angle_slopes
from llmfw.plugins.backends.onnx.emit import ONNX_FLOAT, ONNX_INT32, ONNX_INT64, Emitter, freeze, kv_name
from llmfw.plugins.backends.onnx.fused import USE_GQA, AttentionForm, fusable_rope, packed_qkv
from llmfw.plugins.backends.onnx.ort import OnnxKV
from llmfw.plugins.backends.onnx.weights import F32

#: the most key values one attention score sums in one go: MLAS's default reduction slice, which it only ever
#: widens (see :meth:`AttentionTranslation._scores`)
SCORE_SLICE = 128


def score_rows(group: int) -> int:
    """The score rows per KV head and token: the query heads sharing the KV head, but at least two. MLAS runs a
    one-row product (a one-token decode with one query head per KV head) through a kernel of its own that sums
    in another order than its many-row kernel, so with a single query head per KV head the row is repeated and
    the scores always go through the many-row kernel: a one-token step then gets the bits of the same row in a
    verify batch or a prompt chunk."""
    return max(group, 2)


def score_slice(head_dim: int) -> int:
    """The widest slice of at most :data:`SCORE_SLICE` values that divides a key head."""
    return next(width for width in range(min(head_dim, SCORE_SLICE), 0, -1) if head_dim % width == 0)


class AttentionTranslation:
    """``_op_rope``, ``_op_attention`` and ``_op_k_shift`` of
    :class:`~llmfw.plugins.backends.onnx.translate.SplitTranslator` (mixed into it; it provides the emitter ``e``,
    the translation state its constructor sets up, ``value``, ``shape``, ``known_dim``, ``shared`` and
    ``_softcap``)."""

    e: Emitter
    backend: Any
    attention: AttentionForm
    kv_rank: int

    def value(self, node: Node) -> str:
        raise NotImplementedError

    def shape(self, node: Node) -> Shape:
        raise NotImplementedError

    def known_dim(self, node: Node, axis: int) -> int:
        raise NotImplementedError

    def shared(self, key: tuple, make: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def _softcap(self, x: str, cap: float) -> str:
        raise NotImplementedError

    # -- rope --------------------------------------------------------------------------------------------
    def _rope_table(self, pos: str, attrs: Mapping[str, Any], factors: Node | None) -> tuple[str, str, str]:
        """cos/sin [T, n_dims/2] for a position input and ``arange(T)`` as RotaryEmbedding's position ids:
        the table holds exactly this ubatch's rows (row t = position pos[t])."""
        rope_attrs = {k: v for k, v in attrs.items() if k not in ("layer", "cache")}
        key = ("rope", pos, freeze(rope_attrs), None if factors is None else factors.attrs.get("name"))
        return self.shared(key, lambda: self._make_rope_table(pos, rope_attrs, factors))

    def _make_rope_table(self, pos: str, attrs: Mapping[str, Any], factors: Node | None) -> tuple[str, str, str]:
        ff = None if factors is None else self.backend.dense_copy(factors.attrs["name"])
        slope, mscale = rope_angle_slopes(freq_factors=ff, **attrs)
        positions = self.e.op("Unsqueeze", [self.e.op("Cast", [pos], to=ONNX_FLOAT), self.e.const([-1])])
        theta = self.e.op("Mul", [positions, self.e.const(slope, F32)], hint="theta")
        cos, sin = self.e.op("Cos", [theta], hint="cos"), self.e.op("Sin", [theta], hint="sin")
        if mscale != 1.0:
            cos = self.e.op("Mul", [cos, self.e.const(mscale, F32)], hint="cos")
            sin = self.e.op("Mul", [sin, self.e.const(mscale, F32)], hint="sin")
        n = self.e.op("Squeeze", [self.e.op("Shape", [pos], start=0, end=1)])
        row_ids = self.e.op("Unsqueeze", [self.e.op("Range", [self.e.const(0), n, self.e.const(1)]),
                                          self.e.const([0])], hint="rope_rows")
        return cos, sin, row_ids

    def _rotate(self, x: str, n_head: int, head_dim: int, table: tuple[str, str, str], attrs: Mapping[str, Any]
                ) -> str:
        """x [T, H, D] rotated on its first n_dims by com.microsoft RotaryEmbedding (interleaved = NORM mode's
        adjacent pairs, else NEOX halves; dims past n_dims pass through)."""
        cos, sin, row_ids = table
        n_dims = int(attrs["n_dims"])
        extra = {"rotary_embedding_dim": n_dims} if n_dims < head_dim else {}
        flat = self.e.op("Reshape", [x, self.e.const([1, -1, n_head * head_dim])])
        rotated = self.e.op("RotaryEmbedding", [flat, row_ids, cos, sin], domain="com.microsoft", hint="rope",
                            interleaved=int(attrs["mode"] != "neox"), num_heads=n_head, **extra)
        self.e.keeps_shape(rotated, flat)
        return self.e.op("Reshape", [rotated, self.e.const([-1, n_head, head_dim])])

    def _op_rope(self, node: Node) -> str:
        x, pos = node.inputs[0], node.inputs[1]
        factors = node.inputs[2] if len(node.inputs) > 2 else None
        if len(self.shape(x)) != 3:
            raise ModelError(f"onnx backend: rope expects x [T, H, D], got shape {self.shape(x)}")
        table = self._rope_table(self.value(pos), node.attrs, factors)
        return self._rotate(self.value(x), self.known_dim(x, 1), self.known_dim(x, 2), table, node.attrs)

    # -- KV cache: [n_head_kv, n_cells, head_dim] per layer, updated in place ---------------------------------
    def _kv_input(self, key: tuple[str, int], which: str) -> str:
        """The current value of a cache tensor: the bound graph input, or the last in-place update of it."""
        current = self._kv_current.get((key, which))
        if current is not None:
            return current
        name = kv_name(key, which)
        if name not in self._kv_declared:
            storage: OnnxKV = self.kv[key]
            array = storage.k if which == "k" else storage.v
            dims = [array.shape[0], f"{name}_cells", array.shape[2]]
            if self.kv_rank == 4:
                dims = [1, *dims]
            self.graph_inputs.append(self.e.helper.make_tensor_value_info(name, ONNX_FLOAT, dims))
            self._kv_declared.add(name)
        return name

    def _kv_write(self, node: Node, key: tuple[str, int], which: str, index: str, rows: str) -> str:
        """ScatterND of ``rows`` [T, Hkv, D] (the projection's own layout: no transpose) at ``index`` [T, Hkv, 2]
        (head, cell) — in place: the last update of a cache is a graph output bound to the input's own buffer,
        so ORT skips ScatterND's copy."""
        current = self._kv_input(key, which)
        if self._last_kv_writer.get((key, which)) == node.id and not self._in_branch:
            updated = kv_name(key, which) + "_out"
            self.e.nodes.append(self.e.helper.make_node("ScatterND", [current, index, rows], [updated]))
        else:
            updated = self.e.op("ScatterND", [current, index, rows], hint=f"kv_{which}")
        self._kv_current[(key, which)] = updated
        return updated

    def _kv_storage(self, node: Node) -> tuple[tuple[str, int], OnnxKV]:
        return self.kv_key(node), self.kv_storage(node)

    def _scatter_index(self, cells: str, n_head_kv: int) -> str:
        """[T, Hkv, 2] pairs (head, cell) for cells [T] (int), shared by the layers with n_head_kv heads."""
        def make() -> str:
            cells64 = self.e.op("Cast", [cells], to=ONNX_INT64)
            n = self.e.op("Shape", [cells64])
            grid = self.e.op("Concat", [n, self.e.const([n_head_kv, 1])], axis=0)
            heads = self.e.op("Expand", [self.e.const(np.arange(n_head_kv).reshape(1, -1, 1)), grid])
            cols = self.e.op("Expand", [self.e.op("Unsqueeze", [cells64, self.e.const([1, 2])]), grid])
            if self.kv_rank == 4:  # (0, head, cell) into [1, Hkv, n_cells, D]
                zeros = self.e.op("Expand", [self.e.const(np.zeros((1, 1, 1), np.int64)), grid])
                return self.e.op("Concat", [zeros, heads, cols], axis=-1, hint="kv_index")
            return self.e.op("Concat", [heads, cols], axis=-1, hint="kv_index")
        return self.shared(("kv_index", cells, n_head_kv), make)

    def _cached_prefix(self, cache: str, n_kv: str, n_head_kv: int, head_dim: int) -> str:
        """Cells 0 .. n_kv-1 of a cache tensor, as [Hkv, n_kv, D]."""
        axis = self.kv_rank - 2
        prefix = self.e.op("Slice", [cache, self.e.const([0]), n_kv, self.e.const([axis])])
        return prefix if self.kv_rank == 3 else self.e.op("Reshape", [prefix, self.e.const([n_head_kv, -1, head_dim])])

    def _cells_input(self, mask: Node, cache: tuple[str, int] | None = None) -> str:
        """The graph input ``cells_<mask>`` [S, L/B] int64: the blocks of B cache cells each of S consecutive row
        groups attends, under a mask [T, L] the runtime puts in the core's mask's place (see groups.py)."""
        if cache is not None:
            self.cell_caches.setdefault(mask.id, set()).add(cache)
        name = self.cell_inputs.get(mask.id)
        if name is None:
            if mask.id not in self.input_shapes:
                raise ModelError(f"onnx backend: the attention mask {mask!r} is not an input of its split")
            name = self.cell_inputs[mask.id] = f"cells_{mask.id}"
            self.graph_inputs.append(self.e.helper.make_tensor_value_info(
                name, ONNX_INT64, [f"{name}_groups", f"{name}_width"]))
        return name

    def _grouped_cells(self, cache: str, mask: Node, n_head_kv: int, head_dim: int) -> str:
        """The cells a group attends, gathered from a cache tensor in blocks of B = L / (L/B) cells (a plain
        prefix is a few big blocks, as cheap as a Slice; a row's own cells are blocks of one): [Hkv, S, L, D]."""
        blocks = self.e.op("Reshape", [cache, self._cell_blocks_shape(mask, n_head_kv, head_dim)])
        gathered = self.e.op("Gather", [blocks, self._cells_input(mask)], axis=1)  # [Hkv, S, L/B, B*D]
        return self.e.op("Reshape", [gathered, self.e.const([n_head_kv, 0, -1, head_dim])])

    def _cell_blocks_shape(self, mask: Node, n_head_kv: int, head_dim: int) -> str:
        """[Hkv, -1, B*D]: a cache tensor seen as blocks of B cells (B = L / (L/B), the mask's and the cells'
        widths)."""
        cells, mask_name = self._cells_input(mask), self.value(mask)

        def make() -> str:
            block = self.e.op("Div", [self.e.op("Shape", [mask_name], start=1, end=2),
                                      self.e.op("Shape", [cells], start=1, end=2)], hint="cell_block")
            row = self.e.op("Mul", [block, self.e.const([head_dim])])
            return self.e.op("Concat", [self.e.const([n_head_kv, -1]), row], axis=0)
        return self.shared(("cell_blocks", cells, n_head_kv, head_dim), make)

    def _group_count(self, cells: str) -> str:
        """S, the row groups of a call, as a [1] shape piece."""
        return self.shared(("groups", cells), lambda: self.e.op("Shape", [cells], start=0, end=1))

    def _query_groups_shape(self, cells: str, n_head_kv: int, group: int, head_dim: int) -> str:
        """[S, -1, Hkv, G, D]: the queries [T, H, D] split into the row groups (``D`` as ``slices, width`` when
        the keys are scored in slices, see :meth:`_scores`)."""
        width = score_slice(head_dim)
        head = [head_dim] if width == head_dim else [head_dim // width, width]
        return self.shared(("q_groups", cells, n_head_kv, group, head_dim), lambda: self.e.op(
            "Concat", [self._group_count(cells), self.e.const([-1, n_head_kv, group, *head])], axis=0))

    def _grouped_mask(self, mask: Node, group: int) -> str:
        """The mask [T, L] as [S, G*T/S, L], row g*(T/S) + t of a group for query head g of a KV head: the
        scores' rows (shared by the layers with the same group size)."""
        mask_name, cells = self.value(mask), self._cells_input(mask)

        def make() -> str:
            width = self.e.op("Shape", [mask_name], start=1, end=2)
            shape = self.e.op("Concat", [self._group_count(cells), self.e.const([-1]), width], axis=0)
            rows = self.e.op("Reshape", [mask_name, shape])
            return self.e.op("Tile", [rows, self.e.const([1, group, 1])], hint="mask")
        return self.shared(("mask", mask_name, group), make)

    def _op_attention(self, node: Node) -> str:
        if self.attention == "switch":
            return self._switched_attention(node)
        if self.attention == "gqa":
            return self._group_query_attention(node)
        return self._attention_op_by_op(node)

    def _attention_op_by_op(self, node: Node) -> str:
        """Each row group (see groups.py) scores the cells it lists: [Hkv, S, G*T/S, L] scores per KV head."""
        q, k, v, kv_idx, mask = node.inputs[:5]
        key, storage = self._kv_storage(node)
        n_head_kv, _, head_dim_k = storage.k.shape
        head_dim_v = storage.v.shape[2]
        n_head = self.known_dim(q, 1)
        if n_head % n_head_kv:
            raise ModelError(f"onnx backend: {n_head} query heads are not a multiple of {n_head_kv} KV heads")
        group = n_head // n_head_kv
        index = self._scatter_index(self.value(kv_idx), n_head_kv)
        keys = self._kv_write(node, key, "k", index, self.value(k))
        values = self._kv_write(node, key, "v", index, self.value(v))
        cells = self._cells_input(mask, key)
        keys = self._grouped_cells(keys, mask, n_head_kv, head_dim_k)
        values = self._grouped_cells(values, mask, n_head_kv, head_dim_v)
        # query head h uses KV head h // G: [T, H, Dk] → [S, T/S, Hkv, G, Dk] → [Hkv, S, R*T/S, Dk]
        rows = score_rows(group)
        scores = self._scores(self.value(q), cells, keys, n_head_kv, group, head_dim_k, float(node.attrs["scale"]))
        softcap = float(node.attrs.get("softcap", 0.0) or 0.0)
        if softcap:
            scores = self._softcap(scores, softcap)
        logits = self.e.op("Add", [scores, self._grouped_mask(mask, rows)])
        sinks = attention_extras(node.inputs)[1]  # (the kv_order: ONNX Runtime's sums have no promised order)
        if sinks is not None:
            probs = self._softmax_with_sinks(logits, sinks, n_head_kv, group, rows)
        else:
            probs = self.e.op("Softmax", [logits], axis=-1)
        out = self.e.op("MatMul", [probs, values], hint="kqv")                 # [Hkv, S, R*T/S, Dv]
        out = self.e.op("Reshape", [out, self.e.const([n_head_kv, 0, rows, -1, head_dim_v])])
        if rows != group:  # the query rows repeated for MLAS's sake (score_rows): the first copy
            out = self.e.op("Slice", [out, self.e.const([0]), self.e.const([group]), self.e.const([2])])
        out = self.e.op("Transpose", [out], perm=[1, 3, 0, 2, 4])               # [S, T/S, Hkv, G, Dv]
        return self.e.op("Reshape", [out, self.e.const([-1, n_head * head_dim_v])], hint="attn")

    def _softmax_with_sinks(self, logits: str, sinks: Node, n_head_kv: int, group: int, rows: int) -> str:
        """Softmax of the logits [Hkv, S, R*T/S, L] with each head's sink logit as one more column (dropped
        after): row g*(T/S) + t of KV head j belongs to query head j*G + g (repeated when R > G)."""
        per_row = self.backend.dense_copy(sinks.attrs["name"]).reshape(n_head_kv, group)
        per_row = np.repeat(per_row, rows // group, axis=1) if rows != group else per_row
        column = self.e.const(per_row.reshape(n_head_kv, 1, rows, 1).astype(F32), F32)
        shape = self.e.op("Shape", [logits])
        per_group = self.e.op("Div", [self.e.op("Slice", [shape, self.e.const([2]), self.e.const([3])]),
                                      self.e.const([rows])])
        column = self.e.op("Expand", [column, self.e.op("Concat", [self.e.const([n_head_kv, 1, rows]), per_group],
                                                        axis=0)])
        column = self.e.op("Reshape", [column, self.e.const([n_head_kv, 1, -1, 1])])
        column = self.e.op("Expand", [column, self.e.op("Concat", [self.e.op("Slice", [
            shape, self.e.const([0]), self.e.const([3])]), self.e.const([1])], axis=0)])
        probs = self.e.op("Softmax", [self.e.op("Concat", [logits, column], axis=-1)], axis=-1)
        return self.e.op("Slice", [probs, self.e.const([0]), self.e.const([-1]), self.e.const([-1])], hint="sinks")

    def _scores(self, q: str, cells: str, keys: str, n_head_kv: int, group: int, head_dim: int,
                scale: float) -> str:
        """``scale * q @ keys.T`` per row group and KV head, [Hkv, S, R*T/S, L], for q [T, H, D] (query head h
        uses KV head h // G: [T, H, D] → [S, T/S, Hkv, G, D] → [Hkv, S, G*T/S, D]; R = :func:`score_rows`, the
        G query heads or each repeated when G = 1) and keys [Hkv, S, L, D].

        ONNX Runtime's float GEMM (MLAS) sums a dot product over one slice of at most 128 values, or over several
        whose boundaries depend on how many cells are scored: with longer keys a row's score would round
        differently in a batch of another width (a sequence decoding among others, not alone). So a longer key
        head is scored in slices of :data:`SCORE_SLICE` values — one FusedMatMul over all of them, the slices'
        scores then added in a fixed order."""
        groups = self.e.op("Reshape", [q, self._query_groups_shape(cells, n_head_kv, group, head_dim)])
        width = score_slice(head_dim)
        rows = score_rows(group)
        if rows != group:  # [S, T/S, Hkv, 1, ...] → [S, T/S, Hkv, R, ...]: each query row R times
            trailing = [1] if width == head_dim else [1, 1]
            groups = self.e.op("Expand", [groups, self.e.const([1, 1, 1, rows, *trailing])])
        if width == head_dim:
            qg = self.e.op("Reshape", [self.e.op("Transpose", [groups], perm=[2, 0, 3, 1, 4]),
                                       self.e.const([n_head_kv, 0, -1, head_dim])])
            return self.e.op("FusedMatMul", [qg, keys], domain="com.microsoft", alpha=scale, transB=1, hint="kq")
        n_slices = head_dim // width
        # [S, T/S, Hkv, G, slices, width] → [Hkv, S, slices, G*T/S, width]; keys → [Hkv, S, slices, L, width]
        qg = self.e.op("Reshape", [self.e.op("Transpose", [groups], perm=[2, 0, 4, 3, 1, 5]),
                                   self.e.const([n_head_kv, 0, n_slices, -1, width])])
        ks = self.e.op("Transpose", [self.e.op("Reshape", [keys, self.e.const([n_head_kv, 0, -1, n_slices, width])])],
                       perm=[0, 1, 3, 2, 4])
        scores = self.e.op("FusedMatMul", [qg, ks], domain="com.microsoft", alpha=scale, transB=1, hint="kq")
        return self.e.op("ReduceSum", [scores, self.e.const([2])], keepdims=0, hint="kq")

    def _op_k_shift(self, node: Node) -> str:
        shift = node.inputs[0]
        factors = node.inputs[1] if len(node.inputs) > 1 else None
        key, storage = self._kv_storage(node)
        n_head_kv, _, head_dim = storage.k.shape
        shift_name = self.value(shift)
        n_kv = self.e.op("Shape", [shift_name])
        cached = self._cached_prefix(self._kv_input(key, "k"), n_kv, n_head_kv, head_dim)  # [Hkv, n_kv, D]
        table = self._rope_table(shift_name, node.attrs, factors)
        rotated = self._rotate(self.e.op("Transpose", [cached], perm=[1, 0, 2]), n_head_kv, head_dim, table,
                               node.attrs)                                     # [n_kv, Hkv, D]
        cells = self.e.op("Range", [self.e.const(0), self.e.op("Squeeze", [n_kv]), self.e.const(1)])
        self._kv_write(node, key, "k", self._scatter_index(cells, n_head_kv), rotated)
        return self.e.const(np.zeros(0, F32), F32)

    # -- GroupQueryAttention (the batch is one causal run of cells, see fused.py) -------------------------------
    def _group_query_attention(self, node: Node) -> str:
        """One GQA over the layer's cache, past and present bound to the same memory: it writes the ubatch's K/V
        at cells c0 .. c0+T-1 and attends to cells 0 .. c0+t (the mask's pattern, checked before the call)."""
        q, k, v, kv_idx, _ = node.inputs[:5]
        key, storage = self._kv_storage(node)
        n_head_kv, n_cells, head_dim = storage.k.shape
        n_head = self.known_dim(q, 1)
        if n_head % n_head_kv:
            raise ModelError(f"onnx backend: {n_head} query heads are not a multiple of {n_head_kv} KV heads")
        rope = fusable_rope(node, n_cells)
        rotary: list[str] = []
        rotary_attrs: dict[str, int] = {}
        if rope is not None:  # GQA rotates q and k itself, at position = cell (checked per call)
            q, k = q.inputs[0], k.inputs[0]
            rotary = list(self._rotary_tables(rope, n_cells))
            rotary_attrs = {"do_rotary": 1, "rotary_interleaved": int(rope.attrs["mode"] != "neox")}
        qkv = packed_qkv(q, k, v) if rope is not None else None
        # the inputs as [1, T, heads * D], made in the outer graph when this is an If branch (a branch of one
        # node costs ONNX Runtime least)
        reshape = self._outer_op if self._in_branch else self.e.op
        if qkv is not None:  # the fused QKV projection's output as it is: GQA splits it
            width = (n_head + 2 * n_head_kv) * head_dim
            rows = [reshape("Reshape", [self.value(qkv), self.e.const([1, -1, width])]), "", ""]
        else:
            rows = [reshape("Reshape", [self.value(x), self.e.const([1, -1, heads * head_dim])])
                    for x, heads in ((q, n_head), (k, n_head_kv), (v, n_head_kv))]
        seqlens, total = self._gqa_lengths(self.value(kv_idx))
        past = [self._kv_input(key, which) for which in ("k", "v")]
        present = [self.e.fresh(f"present_{which}") for which in ("k", "v")]
        out = self.e.fresh("gqa")
        window = int(node.attrs.get("window", 0) or 0)
        self.e.nodes.append(self.e.helper.make_node(
            "GroupQueryAttention", [*rows, *past, seqlens, total, *rotary], [out, *present], domain="com.microsoft",
            num_heads=n_head, kv_num_heads=n_head_kv, scale=float(node.attrs["scale"]),
            softcap=float(node.attrs.get("softcap", 0.0) or 0.0), local_window_size=window if window > 0 else -1,
            **rotary_attrs))
        for which, name in zip(("k", "v"), present):
            self._kv_current[(key, which)] = name
        if self._in_branch:  # [1, T, H*D]: the If's output is reshaped after it
            return out
        return self.e.op("Reshape", [out, self.e.const([-1, n_head * head_dim])], hint="attn")

    def _outer_op(self, op_type: str, inputs: list[str]) -> str:
        """A node of the graph around the If being built (its branches read the value)."""
        branch_nodes, self.e.nodes = self.e.nodes, self._outer_nodes[-1]
        try:
            return self.e.op(op_type, inputs)
        finally:
            self.e.nodes = branch_nodes

    def _switched_attention(self, node: Node) -> str:
        """``If(use_gqa)``: GroupQueryAttention, else the op-by-op attention; each branch returns the attention
        output and both caches, and the If's cache outputs are the bound graph outputs (written in place)."""
        key, storage = self._kv_storage(node)
        self._warm_shared(node, storage)
        then_branch = self._branch(node, key, self._group_query_attention)
        else_branch = self._branch(node, key, self._attention_op_by_op)
        out = self.e.fresh("attn")
        present = [kv_name(key, which) + "_out" for which in ("k", "v")]
        self.e.nodes.append(self.e.helper.make_node("If", [USE_GQA], [out, *present], then_branch=then_branch,
                                                    else_branch=else_branch))
        for which, name in zip(("k", "v"), present):
            self._kv_current[(key, which)] = name
        width = self.known_dim(node.inputs[0], 1) * storage.v.shape[2]
        return self.e.op("Reshape", [out, self.e.const([-1, width])], hint="attn")  # GQA's [1, T, H*D]

    def _warm_shared(self, node: Node, storage: OnnxKV) -> None:
        """The values every layer's branches share, made in the outer graph (a value made inside a branch is not
        visible to the other layers' branches)."""
        q, _, _, kv_idx, mask = node.inputs[:5]
        n_head_kv = storage.k.shape[0]
        self._gqa_lengths(self.value(kv_idx))
        self._scatter_index(self.value(kv_idx), n_head_kv)
        group = self.known_dim(q, 1) // n_head_kv
        self._grouped_mask(mask, score_rows(group))
        cells = self._cells_input(mask, (node.attrs["cache"], int(node.attrs["layer"])))
        self._query_groups_shape(cells, n_head_kv, group, storage.k.shape[2])
        for head_dim in {storage.k.shape[2], storage.v.shape[2]}:
            self._cell_blocks_shape(mask, n_head_kv, head_dim)
        for rope in node.inputs[:2]:
            if rope.id in self._deferred_ropes:
                factors = rope.inputs[2] if len(rope.inputs) > 2 else None
                self._rope_table(self.value(rope.inputs[1]), rope.attrs, factors)

    def _branch(self, node: Node, key: tuple[str, int], emit: Callable[[Node], str]) -> Any:
        """A subgraph of the nodes ``emit`` makes for ``node``: outputs (attention, K cache, V cache)."""
        outer_nodes, outer_shared, outer_current = self.e.nodes, self._shared, dict(self._kv_current)
        self._outer_nodes.append(outer_nodes)
        self.e.nodes, self._shared, self._in_branch = [], dict(outer_shared), True
        try:
            out = emit(node)
            made_here = {name for n in self.e.nodes for name in n.output}
            if out not in made_here:  # a branch output must be made in the branch
                out = self.e.op("Identity", [out], hint="branch_out")
            outputs = [out] + [self._kv_current[(key, which)] for which in ("k", "v")]
            nodes = self.e.nodes
        finally:
            self._outer_nodes.pop()
            self.e.nodes, self._shared, self._kv_current, self._in_branch = (outer_nodes, outer_shared,
                                                                             outer_current, False)
        helper = self.e.helper
        return helper.make_graph(nodes, self.e.fresh("branch"), [],
                                 [helper.make_tensor_value_info(name, ONNX_FLOAT, None) for name in outputs])

    def _rotary_tables(self, rope: Node, n_cells: int) -> tuple[str, str]:
        """GQA's cos/sin caches [n_cells, n_dims/2] (row = position = cell), the angles of :meth:`_rope_table`
        computed once per rope parameters and cache size (external initializers shared by the sessions)."""
        factors = rope.inputs[2] if len(rope.inputs) > 2 else None
        attrs = {k: v for k, v in rope.attrs.items() if k not in ("layer", "cache")}
        key = (freeze(attrs), None if factors is None else factors.attrs.get("name"), n_cells)
        name = f"rotary:{abs(hash(key)):x}"

        def table(which: str) -> np.ndarray:
            def make() -> np.ndarray:
                ff = None if factors is None else self.backend.dense_copy(factors.attrs["name"])
                slope, mscale = rope_angle_slopes(freq_factors=ff, **attrs)
                theta = np.arange(n_cells, dtype=F32)[:, None] * slope[None, :]
                return ((np.cos(theta) if which == "cos" else np.sin(theta)) * F32(mscale)).astype(F32)
            return self.backend.derived(name, which, make)

        return self.e.external(f"{name}:cos", table("cos")), self.e.external(f"{name}:sin", table("sin"))

    def _gqa_lengths(self, kv_idx: str) -> tuple[str, str]:
        """``seqlens_k`` [1] = the last cell written (c0 + T - 1) and ``total_sequence_length`` (a scalar, + 1),
        int32, from the ubatch's cells — shared by the layers of one cache."""
        def make() -> tuple[str, str]:
            last = self.e.op("Slice", [kv_idx, self.e.const([-1]), self.e.const([np.iinfo(np.int64).max])])
            seqlens = self.e.op("Cast", [last], to=ONNX_INT32, hint="seqlens_k")
            total = self.e.op("Squeeze", [self.e.op("Add", [seqlens, self.e.const([1], np.int32)])], hint="total_len")
            return seqlens, total
        return self.shared(("gqa_lengths", kv_idx), make)
