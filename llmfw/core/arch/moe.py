"""Mixture-of-experts: the hyperparameters MoE families share and the MoE feed-forward block of the graph.

:func:`build_moe_ffn` is llama.cpp's ``llm_graph_context::build_moe_ffn`` in graph IR ops (core/graph.py's MoE
table)::

    logits   = ffn_gate_inp(x) (+ ffn_gate_inp.bias)                         [T, E]
    probs    = softmax(logits) | sigmoid(logits) | logits (softmax after top-k)
    select   = probs (+ exp_probs_b)        masked to the best groups when experts are grouped
    ids      = top_k(select, K)                                              [T, K] int32
    weights  = probs[ids]  → softmax (softmax-after-top-k) → / sum (norm) → × scale
    h        = act(gate_exps[ids] x (+ bias)) * (up_exps[ids] x (+ bias))    one mul_mat_id per matrix
    out      = Σ_k weights[k] · (down_exps[ids] h (+ bias))                  + shared experts

Expert matrices are the 3-D ``blk.N.ffn_{gate,up,down}_exps.weight`` tensors (ggml ``ne`` = [n_in, n_out, E],
numpy [E, n_out, n_in]); a fused ``ffn_gate_up_exps`` holds the gate rows, then the up rows of each expert.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from ..errors import ModelError
from .hparams import HParams

if TYPE_CHECKING:
    from .architecture import TensorSpec
    from ..ir.graph import GraphBuilder, Node
    from ..runtime.loader import MetadataView

#: llama.cpp's ``llama_expert_gating_func_type`` values in ``{arch}.expert_gating_func``
GATING_BY_CODE: dict[int, str] = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
Gating = Literal["softmax", "sigmoid", "softmax_weight"]
Activation = Literal["silu", "gelu", "swiglu_oai"]
#: the smallest normal float16: llama.cpp clamps the sum of the chosen weights to it before dividing
WEIGHT_SUM_FLOOR = 6.103515625e-5
#: llama.cpp's most experts per layer (LLAMA_MAX_EXPERTS); a file asking for more is refused before allocating
MAX_EXPERTS = 1024
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


#: what llama.cpp reads for every MoE family (the group counts in its common loader, so grouped routing applies to
#: any family whose file has them); the weight scale / normalisation / gating keys only some families read
ROUTING_KEYS = ("n_expert", "n_expert_used", "n_expert_groups", "n_group_used")


def read_moe_hparams(keys: "MetadataView", default_gating: Gating = "softmax") -> dict[str, Any]:
    """The ``{arch}.expert_*`` keys as :class:`MoeHParams` fields, checked as llama.cpp's loader checks them."""
    n_expert = keys.get_int("{arch}.expert_count", 0)
    n_used = keys.get_int("{arch}.expert_used_count", 0)
    if n_expert <= 1:  # llama.cpp: one expert or none is a dense model
        n_expert, n_used = 0, 0
    if n_expert > MAX_EXPERTS:
        raise ModelError(f"{keys.expand('{arch}.expert_count')} = {n_expert} exceeds {MAX_EXPERTS} experts")
    if n_expert and not 0 < n_used <= n_expert:
        raise ModelError(f"{keys.expand('{arch}.expert_used_count')} = {n_used} must be within 1..{n_expert}")
    code = keys.get_int("{arch}.expert_gating_func", 0)
    if code and code not in GATING_BY_CODE:
        raise ModelError(f"{keys.expand('{arch}.expert_gating_func')} = {code}: only "
                         f"{', '.join(f'{c} ({n})' for c, n in GATING_BY_CODE.items())} are supported")
    groups = keys.get_int("{arch}.expert_group_count", 0)
    group_used = keys.get_int("{arch}.expert_group_used_count", 0)
    if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        raise ModelError(f"{keys.arch}: {n_expert} experts in {groups} groups with {group_used} used groups")
    return {
        "n_expert": n_expert, "n_expert_used": n_used,
        "n_expert_shared": keys.get_int("{arch}.expert_shared_count", 0),
        "n_ff_exp": keys.get_int("{arch}.expert_feed_forward_length", 0),
        "n_ff_shexp": keys.get_int("{arch}.expert_shared_feed_forward_length", 0),
        "expert_weights_scale": keys.get_float("{arch}.expert_weights_scale", 0.0),
        "expert_weights_norm": keys.get_bool("{arch}.expert_weights_norm", False),
        "expert_gating_func": GATING_BY_CODE.get(code, default_gating),
        "n_expert_groups": groups, "n_group_used": group_used,
        "n_layer_dense_lead": keys.get_int("{arch}.leading_dense_block_count", 0),
    }


def mtp_trunk(keys: "MetadataView", common: dict[str, Any]) -> dict[str, Any]:
    """Without the multi-token-prediction layers (``nextn_predict_layers``, the last blocks of GLM-4.5 and
    DeepSeek-V3 files): the trunk's ``n_layer`` and per-layer lists. llama.cpp skips those layers' tensors unless
    asked for MTP; so does llmfw (their tensors are not declared, hence never read)."""
    nextn = keys.get_int("{arch}.nextn_predict_layers", 0)
    if not 0 <= nextn < common["n_layer"]:
        raise ModelError(f"{keys.arch}: nextn_predict_layers {nextn} leaves no layers of {common['n_layer']}")
    if not nextn:
        return {}
    n_layer = common["n_layer"] - nextn
    return {"n_layer": n_layer, **{k: common[k][:n_layer] for k in ("n_head_arr", "n_head_kv_arr", "n_ff_arr")}}


def build_moe_ffn(b: "GraphBuilder", x: "Node", il: int, *, gating: Gating = "softmax", norm_w: bool = False,
                  scale: float = 0.0, act: Activation = "silu", exp_probs_bias: bool = False,
                  prefix: str | None = None) -> "Node":
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


def _sum_experts(b: "GraphBuilder", out: "Node", n_used: int) -> "Node":
    """Σ over the K chosen experts of ``out`` [T, K, n] → [T, n], in slot order like llama.cpp's adds."""
    assert out.shape is not None
    width = out.shape[-1]

    def slot(k: int) -> "Node":
        return b.op("reshape", b.op("slice", out, axis=1, start=k, stop=k + 1), shape=(-1, width))

    total = slot(0)
    for k in range(1, n_used):
        total = b.op("add", total, slot(k))
    return total


def _experts_hidden(b: "GraphBuilder", x: "Node", ids: "Node", p: str, act: Activation) -> "Node":
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


def _expert_matmul(b: "GraphBuilder", stem: str, x: "Node", ids: "Node") -> "Node":
    """``stem.weight`` of each row's chosen experts applied to x (+ ``stem.bias`` rows when present)."""
    out = b.op("mul_mat_id", b.weight(f"{stem}.weight"), x, ids)
    if b.has_weight(f"{stem}.bias"):
        out = b.op("add_id", out, b.weight(f"{stem}.bias"), ids)
    return out


def _mask_unused_groups(b: "GraphBuilder", selection: "Node", hp: MoeHParams) -> "Node":
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


def build_layer_ffn(b: "GraphBuilder", h: "Node", il: int) -> "Node":
    """The FFN of a DeepSeek-V3-style layer on the normed ``h``: dense SwiGLU in the leading dense layers, else
    the routed experts as the file's routing keys say (gating, selection bias, normalisation, scale) plus the
    shared experts (glm4moe, deepseek2)."""
    hp = b.hp
    assert isinstance(hp, MoeHParams)
    if not hp.is_moe_layer(il):
        return b.build_ffn(h, il, act="silu")
    out = b.build_moe_ffn(h, il, gating=hp.expert_gating_func, norm_w=hp.expert_weights_norm,
                          scale=hp.expert_weights_scale, act="silu", exp_probs_bias=True)
    return b.op("add", out, build_shared_experts(b, h, il)) if hp.n_expert_shared else out


def build_shared_experts(b: "GraphBuilder", x: "Node", il: int, *, act: str = "silu") -> "Node":
    """The shared experts ``ffn_{gate,up,down}_shexp`` of layer ``il`` as one dense FFN."""
    p = f"blk.{il}"
    return b.build_ffn(x, il, act=act, up=f"{p}.ffn_up_shexp.weight", gate=f"{p}.ffn_gate_shexp.weight",
                       down=f"{p}.ffn_down_shexp.weight")


def expert_tensors(hp: MoeHParams, il: int, n_ff_exp: int, *, gate_optional: bool = False,
                   fused_gate_up: bool = False) -> list["TensorSpec"]:
    """The routed experts' tensors of layer ``il`` as llama.cpp creates them: the router ``ffn_gate_inp``
    (+ an optional bias), 3-D ``ffn_{gate,up,down}_exps`` [n_in, n_out, E] with optional per-expert biases
    [n_out, E], and, with ``fused_gate_up``, the alternative ``ffn_gate_up_exps`` [n_embd, 2·n_ff, E] that makes
    the separate gate and up unnecessary."""
    from .architecture import TensorSpec

    n_embd, n_expert, p = hp.n_embd, hp.n_expert, f"blk.{il}"

    def t(name: str, ne: tuple[int, ...], usage: str, **kw: Any) -> TensorSpec:
        return TensorSpec(f"{p}.{name}", ne, il, usage=usage, **kw)

    fused = f"{p}.ffn_gate_up_exps.weight" if fused_gate_up else None
    specs = [t("ffn_gate_inp.weight", (n_embd, n_expert), "mul_mat"),
             t("ffn_gate_inp.bias", (n_expert,), "add", optional=True),
             t("ffn_gate_exps.weight", (n_embd, n_ff_exp, n_expert), "mul_mat_id", optional=gate_optional,
               unless=fused),
             t("ffn_up_exps.weight", (n_embd, n_ff_exp, n_expert), "mul_mat_id", unless=fused),
             t("ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert), "mul_mat_id")]
    specs += [t(f"ffn_{part}_exps.bias", (size, n_expert), "add_id", optional=True)
              for part, size in (("gate", n_ff_exp), ("up", n_ff_exp), ("down", n_embd))]
    if fused_gate_up:
        specs.append(t("ffn_gate_up_exps.weight", (n_embd, 2 * n_ff_exp, n_expert), "mul_mat_id", optional=True))
    return specs


def shared_expert_tensors(hp: MoeHParams, il: int, n_ff_shexp: int) -> list["TensorSpec"]:
    """The shared experts of layer ``il``: one dense FFN of width ``n_ff_shexp``."""
    from .architecture import TensorSpec

    n_embd, p = hp.n_embd, f"blk.{il}"
    return [TensorSpec(f"{p}.ffn_gate_shexp.weight", (n_embd, n_ff_shexp), il),
            TensorSpec(f"{p}.ffn_up_shexp.weight", (n_embd, n_ff_shexp), il),
            TensorSpec(f"{p}.ffn_down_shexp.weight", (n_ff_shexp, n_embd), il)]
