"""The numpy backend's split compiler: a split's nodes -> a flat list of closures over a list of value slots."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, cast

import numpy as np

from llmfw.core.exec.backend import Backend, CompiledSplit, Split
from llmfw.core.exec.compiler import SplitCompilerBase, check_inputs
from llmfw.core.ir.graph import Node
from llmfw.core.ir.ops import attention_extras
from llmfw.core.ir.rope import rope_cos_sin
from llmfw.plugins.backends.numpy.kernels import (F32, NumpyKV, attention, gelu, layer_norm, rms_norm, rope_apply,
                                                  rope_apply_full, rope_table, silu, visible_limits, write_kv)
from llmfw.plugins.backends.numpy.moe import MoeSteps
from llmfw.plugins.backends.numpy.recurrent import RecurrentSteps
from llmfw.plugins.backends.numpy.weights import get_rows

#: a compiled step: reads its inputs from the slot list and stores its value in its own slot
Step = Callable[[], None]


class SplitCompiler(MoeSteps, RecurrentSteps, SplitCompilerBase[NumpyKV]):
    """Maps a split's nodes to kernels: ``run(inputs) -> outputs`` is a flat list of closures over a list of
    value slots (no dict look-ups per op); the slots, the walk and the checks are the core's
    :class:`~llmfw.core.exec.compiler.SplitCompilerBase`.

    Each node gets a slot; ``weight`` slots are filled once, at compile time. The graph arrives optimised by the
    core passes (fused matmuls on fused weights, norms with their weight, this backend's rewrite rules); after
    each node the values the core's liveness (``split.release_after``) marks dead are cleared, so a prefill holds
    only the live activations. Rope angles are computed once per run and shared. The MoE ops' steps come from
    :class:`~llmfw.plugins.backends.numpy.moe.MoeSteps`.
    """

    backend_name = "numpy"
    kv_class = NumpyKV

    def __init__(self, backend: Backend, split: Split, kv: Mapping[tuple[str, int], NumpyKV]):
        super().__init__(split, kv)
        self.backend = backend
        self.nodes = split.nodes
        self.env: list[Any] = [None] * len(self.slot)
        self.steps: list[Step] = []
        #: per-run tables shared by several steps (rope angles, attention limits), cleared by ``run``
        self.memo: dict[Any, Any] = {}

    # -- helpers ------------------------------------------------------------------------------------------
    def weight_array(self, node: Node) -> np.ndarray | None:
        """The dense float32 handle of a weight node (None for other nodes and quantized tables)."""
        if node.op != "weight":
            return None
        handle = self.backend.weight(node.attr_str("name"))
        return handle if isinstance(handle, np.ndarray) else None

    # -- compile ------------------------------------------------------------------------------------------
    def compile(self) -> CompiledSplit:
        self.walk()
        env, memo, steps = self.env, self.memo, self.steps
        required = self.required_inputs()
        input_slots = [(node_id, self.slot[node_id]) for node_id, _ in required]
        output_slots = [(node_id, self.slot[node_id]) for node_id in self.split.output_ids]
        activation_slots = [slot for slot, value in enumerate(env) if value is None]

        def run(inputs: Mapping[int, Any]) -> dict[int, Any]:
            check_inputs(required, inputs)
            for node_id, slot in input_slots:
                env[slot] = inputs[node_id]
            try:
                for step in steps:
                    step()
                return {node_id: env[slot] for node_id, slot in output_slots}
            finally:
                for slot in activation_slots:  # keep nothing of this run alive between runs
                    env[slot] = None
                memo.clear()

        return run

    def compile_weight(self, node: Node) -> None:
        self.env[self.s(node)] = self.backend.weight(node.attr_str("name"))

    def compile_node(self, node: Node) -> None:
        self.steps.append(self.op_handler(node)(node, [self.s(i) for i in node.inputs], self.s(node)))

    def compile_release(self, node_ids: Sequence[int]) -> None:
        env = self.env
        dead = tuple(self.slot[i] for i in node_ids)

        def clear() -> None:
            for slot in dead:
                env[slot] = None

        self.steps.append(clear)

    # -- ops (each returns the Step of one node) -----------------------------------------------------------
    def _unary(self, fn: Callable[[np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        env = self.env
        (a,) = ins

        def step() -> None:
            env[out] = fn(env[a])

        return step

    def _binary(self, fn: Callable[[np.ndarray, np.ndarray], np.ndarray], ins: list[int], out: int) -> Step:
        env = self.env
        a, b = ins

        def step() -> None:
            env[out] = fn(env[a], env[b])

        return step

    def _op_get_rows(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(get_rows, ins, out)

    def _op_mul_mat(self, node: Node, ins: list[int], out: int) -> Step:
        weight = self.weight_array(node.inputs[0])
        env = self.env
        if weight is not None:
            weight_t = weight.T  # a view in the layout load_weight chose: BLAS reads either without a copy
            x_slot = ins[1]

            def step() -> None:
                env[out] = np.matmul(env[x_slot], weight_t)

            return step
        return self._binary(lambda w, x: np.matmul(x, w.T), ins, out)

    def _op_add(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(np.add, ins, out)

    def _op_sub(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(np.subtract, ins, out)

    def _op_mul(self, node: Node, ins: list[int], out: int) -> Step:
        return self._binary(np.multiply, ins, out)

    def _op_scale(self, node: Node, ins: list[int], out: int) -> Step:
        s = F32(node.attr_float("s"))
        return self._unary(lambda x: x * s, ins, out)

    def _op_rms_norm(self, node: Node, ins: list[int], out: int) -> Step:
        eps = node.attr_float("eps")
        return self._norm_step(lambda x, w: rms_norm(x, eps, w), ins, out)

    def _op_norm(self, node: Node, ins: list[int], out: int) -> Step:
        eps = node.attr_float("eps")
        return self._norm_step(lambda x, w: layer_norm(x, eps, w), ins, out)

    def _norm_step(self, kernel: Callable[[np.ndarray, np.ndarray | None], np.ndarray], ins: list[int],
                   out: int) -> Step:
        """A norm with its optional weight (the core folded ``norm → mul`` by a weight into its 2nd input)."""
        env, x_slot = self.env, ins[0]
        w_slot = ins[1] if len(ins) > 1 else None

        def step() -> None:
            env[out] = kernel(env[x_slot], None if w_slot is None else env[w_slot])

        return step

    def _op_swiglu(self, node: Node, ins: list[int], out: int) -> Step:
        """The rewrite rule :data:`SWIGLU`: ``silu(gate) * up`` in one step, the product in place."""
        env, gate_slot, up_slot = self.env, ins[0], ins[1]

        def step() -> None:
            h, up = silu(env[gate_slot]), env[up_slot]
            if h.shape == up.shape:
                h *= up  # silu's result is a fresh array: multiply in place
            else:
                h = h * up
            env[out] = h

        return step

    def _op_silu(self, node: Node, ins: list[int], out: int) -> Step:
        return self._unary(silu, ins, out)

    def _op_relu(self, node: Node, ins: list[int], out: int) -> Step:
        return self._unary(lambda x: np.maximum(x, F32(0.0)), ins, out)

    def _op_gelu(self, node: Node, ins: list[int], out: int) -> Step:
        return self._unary(gelu, ins, out)

    def _op_softcap(self, node: Node, ins: list[int], out: int) -> Step:
        cap = F32(node.attr_float("cap"))
        return self._unary(lambda x: np.tanh(x / cap) * cap, ins, out)

    def _op_clamp(self, node: Node, ins: list[int], out: int) -> Step:
        lo, hi = F32(node.attr_float("min")), F32(node.attr_float("max"))
        return self._unary(lambda x: np.clip(x, lo, hi), ins, out)

    def _op_reshape(self, node: Node, ins: list[int], out: int) -> Step:
        shape = tuple(cast("tuple[int, ...]", node.attrs["shape"]))
        return self._unary(lambda x: x.reshape(shape), ins, out)

    def _op_slice(self, node: Node, ins: list[int], out: int) -> Step:
        axis, start, stop = node.attr_int("axis", -1), node.attrs.get("start"), node.attrs.get("stop")

        def take(x: np.ndarray) -> np.ndarray:
            index = [slice(None)] * x.ndim
            index[axis] = slice(start, stop)
            return x[tuple(index)]

        return self._unary(take, ins, out)

    def _op_rope(self, node: Node, ins: list[int], out: int) -> Step:
        attrs: dict[str, Any] = dict(node.attrs)  # rope_cos_sin takes the node's attributes by name
        n_dims, mode = node.attr_int("n_dims"), node.attr_str("mode")
        x_slot, pos_slot = ins[0], ins[1]
        ff_slot = ins[2] if len(ins) > 2 else None
        key = ("rope", pos_slot, ff_slot, tuple(sorted(attrs.items())))
        env, memo = self.env, self.memo

        def step() -> None:
            table = memo.get(key)
            if table is None:
                ff = env[ff_slot] if ff_slot is not None else None
                cos, sin = rope_cos_sin(np.asarray(env[pos_slot]), freq_factors=ff, **attrs)
                table = memo[key] = rope_table(cos, sin, mode)
            env[out] = rope_apply_full(env[x_slot], table, n_dims, mode)

        return step

    def _write_kv(self, storage: NumpyKV, k: np.ndarray, v: np.ndarray, idx: np.ndarray) -> None:
        """Store a ubatch's K/V rows in the cache (a subclass may round them first)."""
        write_kv(storage, k, v, idx)

    def _attend(self, q: np.ndarray, storage: NumpyKV, mask: np.ndarray, scale: float, softcap: float,
                limits: list[tuple[int, int, int]]) -> np.ndarray:
        """Attention of ``q`` over the cache (a subclass may use its own arithmetic)."""
        return attention(q, storage, mask.shape[1], mask, scale, softcap, limits)

    def _attend_with_sinks(self, q: np.ndarray, storage: NumpyKV, mask: np.ndarray, scale: float, softcap: float,
                           limits: list[tuple[int, int, int]], sinks: np.ndarray) -> np.ndarray:
        return attention(q, storage, mask.shape[1], mask, scale, softcap, limits, sinks=sinks)

    def _op_attention(self, node: Node, ins: list[int], out: int) -> Step:
        q_slot, k_slot, v_slot, idx_slot, mask_slot = ins[:5]
        storage = self.kv_storage(node)
        scale, softcap = node.attr_float("scale"), node.attr_float("softcap", 0.0)
        env, memo, write, attend = self.env, self.memo, self._write_kv, self._attend
        # the sinks are the last input when present (numpy ignores the kv_order: its sums follow numpy's)
        sinks_slot = ins[-1] if attention_extras(node.inputs)[1] is not None else None
        attend_with_sinks = self._attend_with_sinks
        key = ("attn_limits", mask_slot)

        def step() -> None:
            write(storage, env[k_slot], env[v_slot], env[idx_slot])
            mask = env[mask_slot]
            limits = memo.get(key)
            if limits is None:
                limits = memo[key] = visible_limits(mask)
            if sinks_slot is None:
                env[out] = attend(env[q_slot], storage, mask, scale, softcap, limits)
            else:  # attention sinks (gpt-oss): an extra softmax term per head
                env[out] = attend_with_sinks(env[q_slot], storage, mask, scale, softcap, limits, env[sinks_slot])

        return step

    def _op_k_shift(self, node: Node, ins: list[int], out: int) -> Step:
        attrs: dict[str, Any] = {k: v for k, v in node.attrs.items() if k not in ("layer", "cache")}
        storage = self.kv_storage(node)
        n_dims, mode = node.attr_int("n_dims"), node.attr_str("mode")
        shift_slot = ins[0]
        ff_slot = ins[1] if len(ins) > 1 else None
        env = self.env

        def step() -> None:
            shift = np.asarray(env[shift_slot])
            n_kv = shift.shape[0]
            ff = env[ff_slot] if ff_slot is not None else None
            cos, sin = rope_cos_sin(shift, freq_factors=ff, **attrs)
            cached = storage.k[:, :n_kv].transpose(1, 0, 2)  # [n_kv, Hkv, D] view
            storage.k[:, :n_kv] = rope_apply(cached, cos, sin, n_dims, mode).transpose(1, 0, 2)
            env[out] = np.zeros(0, dtype=F32)

        return step
