"""Split compilation: the nodes of one split (optimised by the core passes) → a list of closures over a value table.

Each node gets a slot in a value table; ``weight`` slots are filled once, at compile time, with the form the
op reading them needs (a linear for ``mul_mat``, raw blocks for ``get_rows``, a dense tensor otherwise). A run
copies that table, sets the inputs, calls every step (``step(env)`` reads its inputs' slots and writes its
own), and returns the outputs. The graph arrives with the core's rewrites done (fused matmuls on fused
weights, ``rms_norm(x, w)``) and its liveness (``Split.release_after``): after each node the values it was
the last to read are dropped, so a long prefill holds one layer's temporaries at a time. Per-run tables that
several layers share (rope angles, the grouped attention mask) are steps of their own, placed once before
their first reader. No source text is generated.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence

from llmfw.core.arch.architecture import RopeParams
from llmfw.core.exec.backend import Split
from llmfw.core.exec.compiler import SplitCompilerBase, check_inputs
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import Node
from llmfw.core.ir.ops import attention_extras
from llmfw.plugins.backends.torch.environment import import_torch
from llmfw.plugins.backends.torch.weights import Linear, TorchWeight
from llmfw.plugins.backends.torch.kernels import (
    KVStorage,
    attention,
    get_rows_raw,
    grouped_mask,
    k_shift,
    rope_apply,
    rope_tables,
    slice_op,
    softcap_op,
)



class TorchWeightSource(Protocol):
    """What compiling reads of the backend (:class:`~llmfw.plugins.backends.torch.runtime.TorchBackend`)."""

    @property
    def spec(self) -> str: ...

    @property
    def weights(self) -> Mapping[str, TorchWeight]: ...

    def dense_tensor(self, name: str) -> Any: ...

    def linear(self, name: str) -> Linear: ...

#: the value table of one run: one slot per node (and per shared table), weights filled in at compile time
Env = list[Any]
#: one compiled node: reads its inputs' slots of the table, writes its own
Step = Callable[[Env], None]
#: a split's compiled form: inputs by node id → outputs by node id
RunSplit = Callable[[Mapping[int, Any]], dict[int, Any]]


def value_step(fn: Callable[..., Any], ins: Sequence[int], out: int) -> Step:
    """``env[out] = fn(env[ins[0]], ...)``; one- and two-input steps avoid building an argument list."""
    if len(ins) == 1:
        (a,) = ins

        def unary(env: Env) -> None:
            env[out] = fn(env[a])

        return unary
    if len(ins) == 2:
        a, b = ins

        def binary(env: Env) -> None:
            env[out] = fn(env[a], env[b])

        return binary
    slots = tuple(ins)

    def nary(env: Env) -> None:
        env[out] = fn(*[env[i] for i in slots])

    return nary


def release_step(slots: Sequence[int]) -> Step:
    """Drop the values in ``slots`` (their last reader ran)."""
    dead = tuple(slots)

    def release(env: Env) -> None:
        for slot in dead:
            env[slot] = None

    return release


class SplitCompiler(SplitCompilerBase[KVStorage]):
    """Maps a split's nodes to torch kernels (the slots, the walk and the checks are the core's
    :class:`~llmfw.core.exec.compiler.SplitCompilerBase`); :attr:`plan` describes the steps (``-v`` dumps, tests)."""

    backend_name = "torch"

    def __init__(self, backend: TorchWeightSource, split: Split, kv: Mapping[tuple[str, int], KVStorage]):
        super().__init__(split, kv)
        self.backend = backend
        self.table: Env = [None] * len(self.slot)
        self.steps: list[Step] = []
        #: one line per step: what it computes, from which slots
        self.plan: list[str] = []
        #: per-run tables shared by several nodes (rope angles, grouped masks): key → their slot
        self.shared: dict[tuple[Any, ...], int] = {}

    # -- compile ------------------------------------------------------------------------------------------
    def compile(self) -> RunSplit:
        self.walk()
        return self._runner()

    def compile_weight(self, node: Node) -> None:
        self._loaded_weight(node)

    def compile_release(self, node_ids: Sequence[int]) -> None:
        dead = [self.slot[i] for i in node_ids if self.table[self.slot[i]] is None]  # not weights in the table
        if dead:
            self.steps.append(release_step(dead))
            self.plan.append(f"drop {', '.join(f'%{i}' for i in dead)}")

    def _runner(self) -> RunSplit:
        table, steps = tuple(self.table), tuple(self.steps)
        required = self.required_inputs()
        input_slots = [(node_id, self.slot[node_id]) for node_id, _ in required]
        output_slots = [(node_id, self.slot[node_id]) for node_id in self.split.output_ids]

        def run(inputs: Mapping[int, Any]) -> dict[int, Any]:
            check_inputs(required, inputs)
            env = list(table)
            for node_id, slot in input_slots:
                env[slot] = inputs[node_id]
            for step in steps:
                step(env)
            return {node_id: env[slot] for node_id, slot in output_slots}

        return run

    # -- emitting -----------------------------------------------------------------------------------------
    def emit(self, node: Node, label: str, fn: Callable[..., Any], ins: Sequence[int]) -> None:
        """The step computing ``node`` as ``fn`` of the values in slots ``ins``."""
        out = self.slot[node.id]
        self.steps.append(value_step(fn, ins, out))
        self.plan.append(f"%{out} = {label}({', '.join(f'%{i}' for i in ins)})  # {node.op} L{node.layer} {node.name}")

    def emit_shared(self, key: tuple[Any, ...], label: str, fn: Callable[..., Any], ins: Sequence[int]) -> int:
        """The slot of a per-run table computed once (first request) and read by every later node asking for
        the same ``key``."""
        slot = self.shared.get(key)
        if slot is None:
            slot = self.shared[key] = len(self.table)
            self.table.append(None)
            self.steps.append(value_step(fn, ins, slot))
            self.plan.append(f"%{slot} = {label}({', '.join(f'%{i}' for i in ins)})  # shared by this run")
        return slot

    # -- weights -------------------------------------------------------------------------------------------
    def _loaded_weight(self, node: Node) -> None:
        name = node.attr_str("name")
        if name not in self.backend.weights:
            raise ModelError(f"weight {name!r} is not loaded on backend {self.backend.spec}")

    def dense(self, node: Node) -> int:
        """The slot of a node's value as a dense tensor: weights get their dense form put in the table."""
        slot = self.slot[node.id]
        if node.op == "weight" and self.table[slot] is None:
            self.table[slot] = self.backend.dense_tensor(node.attr_str("name"))
        return slot

    # -- ops ----------------------------------------------------------------------------------------------
    def _op_get_rows(self, node: Node) -> None:
        table, ids = node.inputs
        weight = self.backend.weights.get(table.attr_str("name")) if table.op == "weight" else None
        if weight is not None and weight.raw is not None:
            self.emit(node, f"get_rows_raw[{weight.name}]", lambda i: get_rows_raw(weight, i), [self.slot[ids.id]])
            return
        torch = import_torch()
        self.emit(node, "index_select", lambda t, i: torch.index_select(t, 0, i),
                  [self.dense(table), self.slot[ids.id]])

    def _op_mul_mat(self, node: Node) -> None:
        w, x = node.inputs
        if w.op == "weight":
            name = w.attr_str("name")
            self.emit(node, f"linear[{name}]", self.backend.linear(name), [self.slot[x.id]])
            return
        torch = import_torch()
        self.emit(node, "matmul", lambda a, b: torch.matmul(b, a.transpose(-1, -2)), [self.slot[w.id], self.slot[x.id]])

    def _elementwise(self, node: Node, fn: Callable[[Any, Any], Any]) -> None:
        a, b = node.inputs
        self.emit(node, node.op, fn, [self.dense(a), self.dense(b)])

    def _op_add(self, node: Node) -> None:
        self._elementwise(node, import_torch().add)

    def _op_sub(self, node: Node) -> None:
        self._elementwise(node, import_torch().sub)

    def _op_mul(self, node: Node) -> None:
        self._elementwise(node, import_torch().mul)

    def _unary(self, node: Node, label: str, fn: Callable[[Any], Any]) -> None:
        self.emit(node, label, fn, [self.dense(node.inputs[0])])

    def _op_scale(self, node: Node) -> None:
        torch, s = import_torch(), node.attr_float("s")
        self._unary(node, f"scale[{s!r}]", lambda x: torch.mul(x, s))

    def _op_rms_norm(self, node: Node) -> None:
        functional, eps = import_torch().nn.functional, node.attr_float("eps")
        self._norm(node, lambda x, w=None: functional.rms_norm(x, (x.shape[-1],), w, eps))

    def _op_norm(self, node: Node) -> None:
        functional, eps = import_torch().nn.functional, node.attr_float("eps")
        self._norm(node, lambda x, w=None: functional.layer_norm(x, (x.shape[-1],), w, None, eps))

    def _norm(self, node: Node, fn: Callable[..., Any]) -> None:
        """A norm with or without the weight the core folded into it (``rms_norm(x, w)``): one torch call."""
        self.emit(node, node.op, fn, [self.dense(i) for i in node.inputs])

    def _op_silu(self, node: Node) -> None:
        self._unary(node, "silu", import_torch().nn.functional.silu)

    def _op_relu(self, node: Node) -> None:
        self._unary(node, "relu", import_torch().relu)

    def _op_gelu(self, node: Node) -> None:
        gelu = import_torch().nn.functional.gelu
        self._unary(node, "gelu[tanh]", lambda x: gelu(x, approximate="tanh"))

    def _op_softcap(self, node: Node) -> None:
        cap = node.attr_float("cap")
        self._unary(node, f"softcap[{cap!r}]", lambda x: softcap_op(x, cap))

    def _op_clamp(self, node: Node) -> None:
        torch, lo, hi = import_torch(), optional_float(node, "min"), optional_float(node, "max")
        self._unary(node, f"clamp[{lo!r}, {hi!r}]", lambda x: torch.clamp(x, lo, hi))

    def _op_reshape(self, node: Node) -> None:
        shape = reshape_target(node)
        self._unary(node, f"reshape{shape!r}", lambda x: x.reshape(shape))

    def _op_slice(self, node: Node) -> None:
        axis = node.attr_int("axis", -1)
        start, stop = optional_int(node, "start"), optional_int(node, "stop")
        self._unary(node, f"slice[{axis}, {start!r}:{stop!r}]", lambda x: slice_op(x, axis, start, stop))

    def _op_rope(self, node: Node) -> None:
        x, pos = node.inputs[0], node.inputs[1]
        ff = node.inputs[2] if len(node.inputs) > 2 else None
        params = RopeParams.from_attrs(node.attrs)
        neox = params.mode == "neox"
        ins = [self.slot[pos.id]] + ([self.dense(ff)] if ff is not None else [])
        tables = self.emit_shared(("rope", params, *ins), "rope_tables",
                                  lambda p, f=None: rope_tables(p, params, f), ins)
        self.emit(node, f"rope[{params.mode}]", lambda v, t: rope_apply(v, t, params.n_dims, neox),
                  [self.slot[x.id], tables])

    def _op_k_shift(self, node: Node) -> None:
        storage, params = self.kv_storage(node), RopeParams.from_attrs(node.attrs)
        ins = [self.slot[node.inputs[0].id]] + ([self.dense(node.inputs[1])] if len(node.inputs) > 1 else [])
        self.emit(node, "k_shift", lambda shift, f=None: k_shift(shift, f, storage, params), ins)

    def _op_attention(self, node: Node) -> None:
        q, k, v, kv_idx, mask = node.inputs[:5]  # the kv_order is not used: torch's sums have no promised order
        if attention_extras(node.inputs)[1] is not None:
            raise ModelError(f"torch backend: attention node %{node.id} has sinks, which it has no kernel for")
        storage = self.kv_storage(node)
        group = query_heads_per_kv_head(node)
        scale, softcap = node.attr_float("scale"), node.attr_float("softcap", 0.0)
        mask_slot = self.slot[mask.id]
        grouped = self.emit_shared(("mask", mask_slot, group), f"grouped_mask[{group}]",
                                   lambda m: grouped_mask(m, group), [mask_slot])
        self.emit(node, "attention",
                  lambda q_, k_, v_, idx, m: attention(q_, k_, v_, idx, m, storage, scale, softcap),
                  [self.slot[n.id] for n in (q, k, v, kv_idx)] + [grouped])


def query_heads_per_kv_head(node: Node) -> int:
    """GQA's group size of an attention node, from its typed q [T, H, D] and k [T, Hkv, D]."""
    q, k = node.inputs[0].shape, node.inputs[1].shape
    if q is None or k is None or len(q) != 3 or len(k) != 3 or k[1] <= 0 or q[1] % k[1]:
        raise ModelError(f"attention node %{node.id} needs typed q [T, H, D] and k [T, Hkv, D] with Hkv | H, "
                         f"got {q} and {k}")
    return q[1] // k[1]


def optional_int(node: Node, key: str) -> int | None:
    """An integer attribute that may be absent (a slice bound); anything else is a ModelError naming the node."""
    value = node.attrs.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise ModelError(f"graph node {node!r}: attribute {key!r} must be an integer, got {value!r}")


def optional_float(node: Node, key: str) -> float | None:
    """A number attribute that may be absent (a clamp bound)."""
    value = node.attrs.get(key)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ModelError(f"graph node {node!r}: attribute {key!r} must be a number, got {value!r}")


def reshape_target(node: Node) -> tuple[int, ...]:
    shape = node.attrs.get("shape")
    if not isinstance(shape, tuple) or not all(isinstance(d, int) for d in shape):
        raise ModelError(f"graph node {node!r}: reshape needs a tuple of integers as 'shape', got {shape!r}")
    return tuple(int(d) for d in shape)
