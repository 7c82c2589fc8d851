"""Mixture-of-experts for model families: the ``{arch}.expert_*`` keys a file holds, the experts' tensors, and the
layer FFNs DeepSeek-V3-style families share.

The graph block itself (:func:`build_moe_ffn`, llama.cpp's ``build_moe_ffn``) and :class:`MoeHParams` are the
graph IR's (:mod:`llmfw.core.ir.moe`, which has the formulas); they are importable from here too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ModelError
from ..ir.moe import (SWIGLU_OAI_ALPHA as SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT as SWIGLU_OAI_LIMIT,
                      WEIGHT_SUM_FLOOR as WEIGHT_SUM_FLOOR, Activation as Activation, Gating as Gating,
                      MoeHParams as MoeHParams, build_moe_ffn as build_moe_ffn)

if TYPE_CHECKING:
    from .architecture import TensorSpec
    from ..ir.graph import GraphBuilder, Node
    from ..format.metadata import MetadataView

#: llama.cpp's ``llama_expert_gating_func_type`` values in ``{arch}.expert_gating_func``
GATING_BY_CODE: dict[int, str] = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
#: llama.cpp's most experts per layer (LLAMA_MAX_EXPERTS); a file asking for more is refused before allocating
MAX_EXPERTS = 1024


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
