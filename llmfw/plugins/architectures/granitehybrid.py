"""The ``granitehybrid`` architecture (IBM Granite 4.0-H), as llama.cpp's ``llama_model_granite_hybrid``: Granite's
layer stack and multipliers (embedding / residual / attention / logit scales, RoPE switched by
``rope.scaling.finetuned``) where the layers without KV heads (``attention.head_count_kv`` 0) are Mamba-2 mixers
(:mod:`.mamba2`) instead of attention. Memory: ``"hybrid"`` (KV cache for the attention layers, the Mamba-2
convolution window and SSM state for the others).

Granite 4.0-H's MoE files (``expert_count`` > 1: Tiny, Small) put routed experts in every FFN — softmax router,
top ``expert_used_count`` renormalised, SiLU-gated ``ffn_{gate,up,down}_exps`` of width ``feed_forward_length``
(the gate optional) — plus, when ``expert_shared_feed_forward_length`` is set, one shared SwiGLU expert of that
width added to them (llama.cpp's "Granite MoE Shared"); the dense variant has a SwiGLU FFN.
"""
from __future__ import annotations

from typing import Any

from llmfw.core.arch.architecture import TensorSpec, attention_qkv_tensors
from llmfw.core.arch.moe import ROUTING_KEYS, MoeHParams, build_shared_experts, read_moe_hparams, \
    shared_expert_tensors
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.plugins.architectures.granite import GraniteArchitecture, GraniteHParams, read_granite_multipliers
from llmfw.plugins.architectures.mamba2 import (Mamba2Dims, build_mamba2, mamba2_dims, mamba2_state,
                                                mamba2_tensors, read_mamba2_dims)


class GraniteHybridHParams(GraniteHParams, MoeHParams):
    ssm: Mamba2Dims | None = None


def is_mamba_layer(hp: HParams, il: int) -> bool:
    """llama.cpp's ``is_recr``: a layer without KV heads is recurrent."""
    return hp.n_head_kv(il) == 0


class GraniteHybridArchitecture(GraniteArchitecture):
    name = "granitehybrid"
    hparams_class = GraniteHybridHParams
    memory = "hybrid"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required: ModelError names it when absent
        # llama.cpp reads the expert counts and the shared expert's width; no weight scale, gating or norm key
        moe = read_moe_hparams(keys)
        return {**read_granite_multipliers(keys, logit_scale_required=False), **read_mamba2_dims(keys),
                **{k: moe[k] for k in (*ROUTING_KEYS, "n_ff_shexp")}}

    def check_hparams(self, hp: HParams) -> None:
        super(GraniteArchitecture, self).check_hparams(hp)  # logit_scale is optional here
        if mamba2_dims(hp).d_inner != 2 * hp.n_embd:
            raise ModelError(f"{hp.arch}: ssm.inner_size must be 2 × embedding_length (llama.cpp supports only "
                             f"that expansion), found {mamba2_dims(hp).d_inner}")

    def recurrent_state(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]] | None:
        return mamba2_state(mamba2_dims(hp)) if is_mamba_layer(hp, il) else None

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        specs = super().layer_tensors(hp, il)  # llama's: attention, then the dense FFN or the routed experts
        if is_mamba_layer(hp, il):
            attention = {s.name for s in attention_qkv_tensors(hp, il)} | {f"blk.{il}.attn_output.{k}"
                                                                          for k in ("weight", "bias")}
            specs = [s for s in specs if s.name not in attention] + mamba2_tensors(mamba2_dims(hp), hp.n_embd, il)
        if isinstance(hp, MoeHParams) and hp.n_expert and hp.n_ff_shexp:
            specs += shared_expert_tensors(hp, il, hp.n_ff_shexp)
        return specs

    def build_feed_forward(self, b: GraphBuilder, h: Node, il: int) -> Node:
        out = super().build_feed_forward(b, h, il)
        hp = b.hp
        if isinstance(hp, MoeHParams) and hp.n_expert and hp.n_ff_shexp:
            return b.op("add", out, build_shared_experts(b, h, il))
        return out

    def mixer(self, b: GraphBuilder, h: Node) -> Node:
        if is_mamba_layer(b.hp, b.layer):
            return build_mamba2(b, h, mamba2_dims(b.hp))
        return super().mixer(b, h)
