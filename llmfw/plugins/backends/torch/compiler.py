"""Split compilation: graph nodes -> generated Python source -> a function."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping

from llmfw.core.architecture import RopeParams
from llmfw.core.backend import CompiledSplit, Split
from llmfw.core.errors import ModelError
from llmfw.core.graph import Node
from llmfw.plugins.backends.torch.environment import import_torch
from llmfw.plugins.backends.torch.kernels import KERNELS, KVStorage
from llmfw.plugins.backends.torch.weights import Linear, TorchWeight

if TYPE_CHECKING:
    from llmfw.plugins.backends.torch.runtime import TorchBackend


class SplitCompiler:
    """Turns one split into straight-line code. ``lines`` is kept for ``--verbose`` dumps and debugging."""

    def __init__(self, backend: "TorchBackend", split: Split, kv: Mapping[tuple[str, int], Any]):
        self.backend = backend
        self.split = split
        self.kv = kv
        self.nodes = split.nodes
        self.by_id = {n.id: n for n in self.nodes}
        self.consts: dict[str, Any] = {}
        self.lines: list[str] = []
        self.uses = self._count_uses()
        self.skip: set[int] = set()
        self.memo: dict[tuple, str] = {}

    # -- analysis ---------------------------------------------------------------------------------------
    def _count_uses(self) -> dict[int, int]:
        uses: dict[int, int] = {}
        for node in self.nodes:
            for src in node.inputs:
                uses[src.id] = uses.get(src.id, 0) + 1
        for out_id in self.split.output_ids:
            uses[out_id] = uses.get(out_id, 0) + 1
        return uses

    def _sole_consumer(self, node: Node, op: str) -> Node | None:
        """The next node if it is the only consumer of ``node`` and has op ``op``."""
        if self.uses.get(node.id, 0) != 1:
            return None
        for later in self.nodes[self.nodes.index(node) + 1:]:
            if any(src is node for src in later.inputs):
                return later if later.op == op else None
        return None

    def _weight_of(self, node: Node) -> TorchWeight | None:
        if node.op != "weight" or node.id not in self.by_id:
            return None
        return self.backend.weights.get(node.attrs["name"])

    # -- naming -----------------------------------------------------------------------------------------
    def const(self, value: Any, hint: str = "c") -> str:
        name = f"{hint}{len(self.consts)}"
        self.consts[name] = value
        return name

    @staticmethod
    def var(node: Node) -> str:
        return f"v{node.id}"

    def emit(self, node: Node, expr: str) -> None:
        self.lines.append(f"    {self.var(node)} = {expr}  # {node.op} L{node.layer} {node.name}")

    # -- code generation --------------------------------------------------------------------------------
    def compile(self) -> CompiledSplit:
        body = [f"    v{i} = inputs[{i}]" for i in self.split.input_ids]
        self._plan_fused_matmuls()
        for node in self.nodes:
            if node.id in self.skip:
                continue
            handler = getattr(self, f"_op_{node.op}", None)
            if handler is None:
                raise ModelError(f"torch backend cannot compile op {node.op!r} (node %{node.id})")
            handler(node)
        outputs = ", ".join(f"{i}: v{i}" for i in self.split.output_ids)
        lines = free_dead_values(body + self.lines, {f"v{i}" for i in self.split.output_ids})
        source = "def run(inputs):\n" + "\n".join(lines) + f"\n    return {{{outputs}}}\n"
        namespace: dict[str, Any] = {"torch": import_torch(), "F": import_torch().nn.functional, **self.consts,
                                     **KERNELS}
        exec(compile(source, f"<torch split {id(self.split):x}>", "exec"), namespace)  # noqa: S102 - our codegen
        self.source = source
        return namespace["run"]

    def _plan_fused_matmuls(self) -> None:
        """Group mul_mats whose weights live here and that read the same input: one fused matmul each."""
        groups: dict[int, list[Node]] = {}
        for node in self.nodes:
            if node.op == "mul_mat" and self._weight_of(node.inputs[0]) is not None:
                groups.setdefault(node.inputs[1].id, []).append(node)
        self.fused: dict[int, tuple[list[Node], Linear]] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            names = tuple(m.inputs[0].attrs["name"] for m in members)
            fused = self.backend.fused_linear(names)
            if fused is None:
                continue
            for m in members:
                self.fused[m.id] = (members, fused)

    def _op_weight(self, node: Node) -> None:
        weight = self.backend.weights.get(node.attrs["name"])
        if weight is None:
            raise ModelError(f"weight {node.attrs['name']!r} is not loaded on backend {self.backend.spec}")
        # weights are resolved where they are used (linear, dense tensor or raw rows)

    def _dense(self, node: Node) -> str:
        """The expression for a node's value as a dense tensor (weights: their dense form)."""
        weight = self._weight_of(node)
        if weight is None:
            return self.var(node)
        key = ("dense", weight.name)
        if key not in self.memo:
            self.memo[key] = self.const(self.backend.dense_tensor(weight.name), "w")
        return self.memo[key]

    def _op_get_rows(self, node: Node) -> None:
        table, ids = node.inputs
        weight = self._weight_of(table)
        if weight is not None and weight.raw is not None:
            self.emit(node, f"get_rows_raw({self.const(weight, 'w')}, {self.var(ids)})")
        else:
            self.emit(node, f"torch.index_select({self._dense(table)}, 0, {self.var(ids)})")

    def _op_mul_mat(self, node: Node) -> None:
        w, x = node.inputs
        if node.id in self.fused:
            members, fused = self.fused[node.id]
            first = members[0]
            if node is first:
                out = f"f{node.id}"
                self.lines.append(f"    {out} = {self.const(fused, 'lin')}({self.var(x)})  # fused "
                                  f"{'+'.join(m.inputs[0].attrs['name'] for m in members)}")
                self.memo[("fused", first.id)] = out
            offset = 0
            for m in members:
                if m is node:
                    break
                offset += self.backend.weights[m.inputs[0].attrs["name"]].shape[0]
            n_out = self.backend.weights[w.attrs["name"]].shape[0]
            self.emit(node, f"{self.memo[('fused', first.id)]}.narrow(-1, {offset}, {n_out})")
            return
        weight = self._weight_of(w)
        if weight is not None:
            self.emit(node, f"{self.const(self.backend.linear(weight.name), 'lin')}({self.var(x)})")
        else:
            self.emit(node, f"torch.matmul({self.var(x)}, {self.var(w)}.transpose(-1, -2))")

    def _binary(self, node: Node, fn: str) -> None:
        a, b = node.inputs
        self.emit(node, f"torch.{fn}({self._dense(a)}, {self._dense(b)})")

    def _op_add(self, node: Node) -> None:
        self._binary(node, "add")

    def _op_sub(self, node: Node) -> None:
        self._binary(node, "sub")

    def _op_mul(self, node: Node) -> None:
        self._binary(node, "mul")

    def _op_scale(self, node: Node) -> None:
        self.emit(node, f"torch.mul({self.var(node.inputs[0])}, {float(node.attrs['s'])!r})")

    def _norm_with_weight(self, node: Node) -> tuple[str, Node]:
        """A norm's following ``mul`` by a 1-D weight of the normalised size, folded into the norm call."""
        mul = self._sole_consumer(node, "mul")
        if mul is not None:
            other = mul.inputs[1] if mul.inputs[0] is node else mul.inputs[0]
            weight = self._weight_of(other)
            if weight is not None and len(weight.shape) == 1:
                self.skip.add(mul.id)
                return self._dense(other), mul
        return "None", node

    def _op_rms_norm(self, node: Node) -> None:
        x = node.inputs[0]
        weight, target = self._norm_with_weight(node)
        expr = f"F.rms_norm({self.var(x)}, ({self.var(x)}.shape[-1],), {weight}, {float(node.attrs['eps'])!r})"
        self.emit(node, expr)
        if target is not node:
            self.emit(target, self.var(node))

    def _op_norm(self, node: Node) -> None:
        x = node.inputs[0]
        weight, target = self._norm_with_weight(node)
        expr = (f"F.layer_norm({self.var(x)}, ({self.var(x)}.shape[-1],), {weight}, None, "
                f"{float(node.attrs['eps'])!r})")
        self.emit(node, expr)
        if target is not node:
            self.emit(target, self.var(node))

    def _op_silu(self, node: Node) -> None:
        self.emit(node, f"F.silu({self.var(node.inputs[0])})")

    def _op_relu(self, node: Node) -> None:
        self.emit(node, f"torch.relu({self.var(node.inputs[0])})")

    def _op_gelu(self, node: Node) -> None:
        self.emit(node, f"F.gelu({self.var(node.inputs[0])}, approximate='tanh')")

    def _op_softcap(self, node: Node) -> None:
        self.emit(node, f"softcap_op({self.var(node.inputs[0])}, {float(node.attrs['cap'])!r})")

    def _op_clamp(self, node: Node) -> None:
        lo, hi = node.attrs.get("min"), node.attrs.get("max")
        self.emit(node, f"torch.clamp({self.var(node.inputs[0])}, {lo!r}, {hi!r})")

    def _op_reshape(self, node: Node) -> None:
        shape = tuple(int(d) for d in node.attrs["shape"])
        self.emit(node, f"{self._dense(node.inputs[0])}.reshape({shape!r})")

    def _op_slice(self, node: Node) -> None:
        axis = int(node.attrs.get("axis", -1))
        start, stop = node.attrs.get("start"), node.attrs.get("stop")
        self.emit(node, f"slice_op({self._dense(node.inputs[0])}, {axis}, {start!r}, {stop!r})")

    def _op_rope(self, node: Node) -> None:
        x, pos = node.inputs[0], node.inputs[1]
        ff = node.inputs[2] if len(node.inputs) > 2 else None
        params = RopeParams.from_attrs(node.attrs)
        key = ("rope", pos.id, params, ff.id if ff is not None else None)
        if key not in self.memo:
            cs = f"cs{node.id}"
            ff_expr = self._dense(ff) if ff is not None else "None"
            self.lines.append(f"    {cs} = rope_tables({self.var(pos)}, {self.const(params, 'rp')}, {ff_expr})")
            self.memo[key] = cs
        cs = self.memo[key]
        self.emit(node, f"rope_apply({self.var(x)}, {cs}, {params.n_dims}, {params.mode == 'neox'})")

    def _kv_storage(self, node: Node) -> KVStorage:
        cache_key = (node.attrs.get("cache", "kv"), int(node.attrs.get("layer", node.layer)))
        storage = self.kv.get(cache_key)
        if storage is None:
            raise ModelError(f"no KV storage for cache {cache_key[0]!r} layer {cache_key[1]} on {self.backend.spec}")
        return storage

    def _op_k_shift(self, node: Node) -> None:
        shift = node.inputs[0]
        ff = self._dense(node.inputs[1]) if len(node.inputs) > 1 else "None"
        params = RopeParams.from_attrs(node.attrs)
        self.emit(node, f"k_shift({self.var(shift)}, {ff}, {self.const(self._kv_storage(node), 'kv')}, "
                        f"{self.const(params, 'rp')})")

    def _op_attention(self, node: Node) -> None:
        q, k, v, kv_idx, mask = node.inputs
        storage = self._kv_storage(node)
        mkey = ("mask", mask.id)
        if mkey not in self.memo:
            self.memo[mkey] = f"masks{mask.id}"
            self.lines.append(f"    {self.memo[mkey]} = {{}}  # grouped masks of %{mask.id}, made once per run")
        args = ", ".join(self.var(n) for n in (q, k, v, kv_idx, mask))
        self.emit(node, f"attention({args}, {self.memo[mkey]}, {self.const(storage, 'kv')}, "
                        f"{float(node.attrs['scale'])!r}, {float(node.attrs.get('softcap', 0.0) or 0.0)!r})")


_LOCAL_NAME = re.compile(r"\b(?:v|f|cs|masks)\d+\b")


def free_dead_values(lines: list[str], keep: set[str]) -> list[str]:
    """Insert ``del`` after the last use of every local, so that a long prefill holds one layer's temporaries at
    a time instead of all of them until the split returns (measured: +700 MB peak for SmolLM2's pp512)."""
    last_use: dict[str, int] = {}
    for index, line in enumerate(lines):
        code = line.split("#", 1)[0]
        target, _, expr = code.partition("=")
        for name in _LOCAL_NAME.findall(expr):
            last_use[name] = index
        for name in _LOCAL_NAME.findall(target):
            last_use.setdefault(name, index)
    dead_after: dict[int, list[str]] = {}
    for name, index in last_use.items():
        if name not in keep:
            dead_after.setdefault(index, []).append(name)
    out = []
    for index, line in enumerate(lines):
        out.append(line)
        if index in dead_after:
            out.append(f"    del {', '.join(sorted(dead_after[index]))}")
    return out
