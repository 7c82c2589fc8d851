"""The mixture-of-experts block of the graph (llama.cpp's ``llm_graph_context::build_moe_ffn`` in graph IR ops,
the MoE table of :mod:`llmfw.core.ir.graph`) and the hyperparameters it reads::

    logits   = ffn_gate_inp(x) (+ ffn_gate_inp.bias)                         [T, E]
    probs    = softmax(logits) | sigmoid(logits) | logits (softmax after top-k)
    select   = probs (+ exp_probs_b)        masked to the best groups when experts are grouped
    ids      = top_k(select, K)                                              [T, K] int32
    weights  = probs[ids]  → softmax (softmax-after-top-k) → / sum (norm) → × scale
    h        = act(gate_exps[ids] x (+ bias)) * (up_exps[ids] x (+ bias))    one mul_mat_id per matrix
    out      = Σ_k weights[k] · (down_exps[ids] h (+ bias))                  + shared experts

Expert matrices are the 3-D ``blk.N.ffn_{gate,up,down}_exps.weight`` tensors (ggml ``ne`` = [n_in, n_out, E],
numpy [E, n_out, n_in]); a fused ``ffn_gate_up_exps`` holds the gate rows, then the up rows of each expert.

:meth:`GraphBuilder.build_moe_ffn <llmfw.core.ir.graph.GraphBuilder.build_moe_ffn>` calls :func:`build_moe_ffn`;
this module sees the builder only through :class:`MoeBuilder` (what the block calls of it), so the graph module
and this one do not import each other. What MoE families read from files and declare as tensors is in
:mod:`llmfw.core.arch.moe`, one layer up.
"""
from __future__ import annotations

from typing import Any, Literal, Protocol, TypeVar

from .hparams import HParams

Gating = Literal["softmax", "sigmoid", "softmax_weight"]
Activation = Literal["silu", "gelu", "swiglu_oai"]
#: the smallest normal float16: llama.cpp clamps the sum of the chosen weights to it before dividing
WEIGHT_SUM_FLOOR = 6.103515625e-5
#: gpt-oss's clamped SwiGLU (fixed in llama.cpp's graph)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


class MoeHParams(HParams):
    """:class:`HParams` plus the ``{arch}.expert_*`` keys (zero / off when a file has none: a dense model)."""

    n_expert: int = 0
    n_expert_used: int = 0
    n_expert_shared: int = 0
    #: the experts' hidden size (``expert_feed_forward_length``; 0: the family's default)
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    expert_weights_scale: float = 0.0
    expert_weights_norm: bool = False
    expert_gating_func: Gating = "softmax"
    n_expert_groups: int = 0
    n_group_used: int = 0
    #: the first layers with a dense FFN (deepseek2, glm4moe)
    n_layer_dense_lead: int = 0

    def is_moe_layer(self, il: int) -> bool:
        return self.n_expert > 0 and il >= self.n_layer_dense_lead


class Shaped(Protocol):
    """A graph value as the block reads it (:class:`~llmfw.core.ir.graph.Node`): its shape, when known."""

    @property
    def shape(self) -> tuple[int, ...] | None: ...


V = TypeVar("V", bound=Shaped)


class MoeBuilder(Protocol[V]):
    """What the MoE block calls of the graph builder (:class:`~llmfw.core.ir.graph.GraphBuilder`)."""

    @property
    def hp(self) -> HParams: ...

    def op(self, op: str, *inputs: V, name: str = "", **attrs: Any) -> V: ...

    def mul_mat(self, weight_name: str, x: V, bias_name: str | None = None) -> V: ...

    def weight(self, name: str) -> V: ...

    def has_weight(self, name: str) -> bool: ...


def build_moe_ffn(b: MoeBuilder[V], x: V, il: int, *, gating: Gating = "softmax", norm_w: bool = False,
                  scale: float = 0.0, act: Activation = "silu", exp_probs_bias: bool = False,
                  prefix: str | None = None) -> V:
    """The MoE block of layer ``il`` on ``x`` [T, n_embd] → [T, n_embd], without the shared experts (see
    :func:`build_shared_experts`). Optional tensors are used when the model has them: the router bias
    ``ffn_gate_inp.bias``, per-expert biases ``ffn_{gate,up,down}_exps.bias``, the fused ``ffn_gate_up_exps``;
    ``exp_probs_bias``: add ``exp_probs_b.bias`` to the probabilities for the selection only (DeepSeek-V3)."""
    hp = b.hp
    assert isinstance(hp, MoeHParams), "an MoE architecture declares hparams_class = MoeHParams"
    p = prefix or f"blk.{il}"
    n_used = hp.n_expert_used
    logits = b.mul_mat(f"{p}.ffn_gate_inp.weight", x, f"{p}.ffn_gate_inp.bias")   # [T, E]
    probs = {"softmax": "softmax", "sigmoid": "sigmoid"}.get(gating)
    probs_node = b.op(probs, logits) if probs else logits
    selection = probs_node
    if exp_probs_bias and b.has_weight(f"{p}.exp_probs_b.bias"):
        selection = b.op("add", selection, b.weight(f"{p}.exp_probs_b.bias"))
    if hp.n_expert_groups > 1:
        selection = _mask_unused_groups(b, selection, hp)
    ids = b.op("top_k", selection, k=n_used, name="ffn_moe_topk")                    # [T, K]
    weights = b.op("take", probs_node, ids)                                            # [T, K]
    if gating == "softmax_weight":
        weights = b.op("softmax", weights)
    if norm_w:
        total = b.op("clamp", b.op("sum_rows", weights), min=WEIGHT_SUM_FLOOR, max=float("inf"))
        weights = b.op("div", weights, total)
    if scale and scale != 1.0:
        weights = b.op("scale", weights, s=scale)
    h = _experts_hidden(b, x, ids, p, act)                                             # [T, K, n_ff]
    out = _expert_matmul(b, f"{p}.ffn_down_exps", h, ids)                              # [T, K, n_embd]
    out = b.op("mul", out, b.op("reshape", weights, shape=(-1, n_used, 1)))
    return _sum_experts(b, out, n_used)


def _sum_experts(b: MoeBuilder[V], out: V, n_used: int) -> V:
    """Σ over the K chosen experts of ``out`` [T, K, n] → [T, n], in slot order like llama.cpp's adds."""
    assert out.shape is not None
    width = out.shape[-1]

    def slot(k: int) -> V:
        return b.op("reshape", b.op("slice", out, axis=1, start=k, stop=k + 1), shape=(-1, width))

    total = slot(0)
    for k in range(1, n_used):
        total = b.op("add", total, slot(k))
    return total


def _experts_hidden(b: MoeBuilder[V], x: V, ids: V, p: str, act: Activation) -> V:
    """``act(gate) * up`` of the chosen experts, [T, K, n_ff] (gate and up from a fused tensor when present)."""
    if b.has_weight(f"{p}.ffn_gate_up_exps.weight"):
        gate_up = _expert_matmul(b, f"{p}.ffn_gate_up_exps", x, ids)
        assert gate_up.shape is not None
        n_ff = gate_up.shape[-1] // 2
        gate = b.op("slice", gate_up, axis=-1, start=0, stop=n_ff)
        up = b.op("slice", gate_up, axis=-1, start=n_ff, stop=2 * n_ff)
    else:
        up = _expert_matmul(b, f"{p}.ffn_up_exps", x, ids)
        if not b.has_weight(f"{p}.ffn_gate_exps.weight"):  # ungated experts (llama's gate is optional)
            return b.op(act, up)
        gate = _expert_matmul(b, f"{p}.ffn_gate_exps", x, ids)
    if act == "swiglu_oai":
        return b.op("swiglu_oai", gate, up, alpha=SWIGLU_OAI_ALPHA, limit=SWIGLU_OAI_LIMIT)
    return b.op("mul", b.op(act, gate), up)


def _expert_matmul(b: MoeBuilder[V], stem: str, x: V, ids: V) -> V:
    """``stem.weight`` of each row's chosen experts applied to x (+ ``stem.bias`` rows when present)."""
    out = b.op("mul_mat_id", b.weight(f"{stem}.weight"), x, ids)
    if b.has_weight(f"{stem}.bias"):
        out = b.op("add_id", out, b.weight(f"{stem}.bias"), ids)
    return out


def _mask_unused_groups(b: MoeBuilder[V], selection: V, hp: MoeHParams) -> V:
    """DeepSeek-V3's grouped routing: a group's score is the sum of its two best experts; the experts of all
    but the ``n_group_used`` best groups are set to -inf so that top-k never picks them."""
    n_groups = hp.n_expert_groups
    per_group = hp.n_expert // n_groups
    groups = b.op("reshape", selection, shape=(-1, n_groups, per_group))             # [T, G, E/G]
    best_two = b.op("take", groups, b.op("top_k", groups, k=min(2, per_group)))       # [T, G, 2]
    scores = b.op("reshape", b.op("sum_rows", best_two), shape=(-1, n_groups))        # [T, G]
    kept = b.op("top_k", scores, k=hp.n_group_used)                                   # [T, G_used]
    mask = b.op("reshape", b.op("id_mask", scores, kept), shape=(-1, n_groups, 1))    # 0 / -inf per group
    return b.op("reshape", b.op("add", groups, mask), shape=(-1, hp.n_expert))
