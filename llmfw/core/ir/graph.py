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

Recurrent state (issue 34) travels as graph inputs and outputs, not as backend storage: the memory gathers the
ubatch's sequences' states into the input ``rs:<kind>:<layer>`` f32 [S, ...] (S = ``BuildParams.n_seqs``
sequences of ``n_tokens / S`` tokens each, laid out sequence after sequence: llama.cpp's equal split) and reads
the graph output of the same name back after the compute (``GraphBuilder.build_rs`` / ``store_rs``).

Graph outputs are named: ``logits`` f32 [n_outputs, n_vocab], or in embeddings mode (``BuildParams.embeddings``)
``embd`` f32 [n_outputs, n_embd], the final hidden state after the output norm.

The op table (every op's inputs, attributes and semantics) is :mod:`llmfw.core.ir.ops`; :class:`Node` and the
value types are :mod:`llmfw.core.ir.node`, both re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Literal, Mapping, Protocol, Sequence

from ..errors import ModelError
from .moe import build_moe_ffn
# the values and the op table, importable from here as before they moved out
from .node import (DYNAMIC as DYNAMIC, AttrValue as AttrValue, Attrs as Attrs, DType as DType, Node as Node,
                   Shape as Shape, ShapeError as ShapeError)
from .ops import (MOE_OP_TABLE as MOE_OP_TABLE, OP_TABLE as OP_TABLE, OPS as OPS, RECURRENT_OPS as RECURRENT_OPS,
                  Inference as Inference, OpSpec as OpSpec, broadcast as broadcast,
                  infer_type as infer_type)

if TYPE_CHECKING:
    from .hparams import HParams


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
            "kq_mask": ((p.n_tokens, n_kv), "f32"), "kv_order": ((n_kv,), "i32"), "k_shift": ((DYNAMIC,), "i32"),
            "attn_temp": ((p.n_tokens, 1, 1), "f32"),
        }
        if kind not in types:
            raise ModelError(f"unknown graph input {name!r}; known: {', '.join(sorted(types))} (<kind>:<cache> "
                             f"for kv_idx, kq_mask, kv_order, k_shift)")
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
            self.input(f"kv_order:{cache}"), *([self.weight(sinks)] if sinks else []),
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
