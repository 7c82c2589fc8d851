"""The ``lfm2`` architecture (Liquid LFM2 dense models), as llama.cpp's ``llama_model_lfm2``: a hybrid of short
gated convolutions and attention, the simplest family on the recurrent memory (issue 34).

Each layer is one of two operators (a layer is a convolution layer when its ``attention.head_count_kv`` is 0),
then a SwiGLU FFN::

    h = rms_norm(x) * attn_norm                                     ("operator norm", both kinds)
    conv layer:  b, c, u = split3(shortconv.in_proj(h))             (in that order, n_embd each)
                 y = shortconv.out_proj(c * short_conv(b * u))      causal depthwise conv, K = shortconv.l_cache
    attn layer:  q, k, v = attn_q/k/v(h); q, k = rope(rms_norm(q) * q_norm), rope(rms_norm(k) * k_norm)
                 y = attn_output(attention(q, k, v))                NEOX rope, scale 1/sqrt(head_dim)
    x = x + y
    x = x + ffn_down(silu(ffn_gate(h)) * ffn_up(h))                 with h = rms_norm(x) * ffn_norm

then ``output(rms_norm(x) * token_embd_norm)`` (the converter names the final norm ``token_embd_norm``), the head
tied to ``token_embd`` when ``output.weight`` is absent.

Memory: ``"hybrid"`` — a KV cache for the attention layers, and for each convolution layer the last K-1 values of
``b * u`` per sequence (the carried window, state ``"conv"`` [K-1, n_embd]). The MoE sibling ``lfm2moe`` and
sliding-window LFM2 files (llama.cpp's hybrid iSWA memory) are not supported yet.
"""
from __future__ import annotations

from typing import Any

from llmfw.core.arch.architecture import (Architecture, TensorSpec, attention_qkv_tensors, gated_ffn_tensors,
                                     layer_tensor)
from llmfw.core.errors import ModelError, UnsupportedVariant
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView

#: the final norm's tensor (llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2: "fix for wrong tensor name")
OUTPUT_NORM = "token_embd_norm.weight"


class LFM2HParams(HParams):
    #: the convolution's width K (``shortconv.l_cache``): each step sees itself and the K-1 values before it
    n_shortconv_l_cache: int = 0


def is_conv_layer(hp: HParams, il: int) -> bool:
    """llama.cpp's ``is_recr``: a layer without KV heads is a convolution layer."""
    return hp.n_head_kv(il) == 0


class LFM2Architecture(Architecture):
    name = "lfm2"
    hparams_class = LFM2HParams
    memory = "hybrid"
    rope_type = "neox"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required: ModelError names it when absent
        if keys.get_int("{arch}.attention.sliding_window", 0) > 0:
            raise UnsupportedVariant("lfm2: sliding-window attention (llama.cpp's hybrid iSWA memory) is not supported yet")
        if keys.get_int("{arch}.expert_count", 0) > 0:
            raise UnsupportedVariant("lfm2: mixture-of-experts LFM2 files (expert_count > 0) are not supported")
        return {"n_shortconv_l_cache": keys.get_int("{arch}.shortconv.l_cache")}

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if not isinstance(hp, LFM2HParams) or not 1 < hp.n_shortconv_l_cache <= 64:
            raise ModelError(f"lfm2: shortconv.l_cache must be in 2..64, found {getattr(hp, 'n_shortconv_l_cache', 0)}")
        for il in range(hp.n_layer):
            if not is_conv_layer(hp, il) and hp.n_embd_head_k * hp.n_head(il) != hp.n_embd:
                raise ModelError(f"lfm2: layer {il}: head_count * key_length must equal embedding_length")

    def recurrent_state(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]] | None:
        if not is_conv_layer(hp, il):
            return None
        return {"conv": (getattr(hp, "n_shortconv_l_cache", 2) - 1, hp.n_embd)}

    def tensors(self, hp: HParams) -> list[TensorSpec]:
        specs = super().tensors(hp)
        return [TensorSpec(OUTPUT_NORM, s.ne, s.layer, usage="mul") if s.name == "output_norm.weight" else s
                for s in specs]

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        n_embd = hp.n_embd
        specs = [layer_tensor(il, "attn_norm.weight", (n_embd,), "mul"),
                 layer_tensor(il, "ffn_norm.weight", (n_embd,), "mul"), *gated_ffn_tensors(hp, il)]
        if is_conv_layer(hp, il):
            width = getattr(hp, "n_shortconv_l_cache", 2)
            return specs + [layer_tensor(il, "shortconv.conv.weight", (width, n_embd), "mul"),
                            layer_tensor(il, "shortconv.in_proj.weight", (n_embd, 3 * n_embd)),
                            layer_tensor(il, "shortconv.out_proj.weight", (n_embd, n_embd))]
        head_dim = hp.n_embd_head_k
        return specs + [layer_tensor(il, "attn_q_norm.weight", (head_dim,), "mul"),
                        layer_tensor(il, "attn_k_norm.weight", (head_dim,), "mul"), *attention_qkv_tensors(hp, il),
                        layer_tensor(il, "attn_output.weight", (n_embd, n_embd))]

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            residual = x
            h = b.build_norm(x, f"blk.{il}.attn_norm.weight")
            h = self._conv_block(b, h) if is_conv_layer(b.hp, il) else self._attn_block(b, h)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", residual, h)
            x = b.op("add", x, b.build_ffn(b.build_norm(x, f"blk.{il}.ffn_norm.weight"), act="silu"))
        b.build_output(x, norm=OUTPUT_NORM)

    @staticmethod
    def _conv_block(b: GraphBuilder, h: Node) -> Node:
        p, n_embd = f"blk.{b.layer}.shortconv", b.hp.n_embd
        bcx = b.mul_mat(f"{p}.in_proj.weight", h)
        gate_in, gate_out, u = (b.op("slice", bcx, axis=-1, start=i * n_embd, stop=(i + 1) * n_embd)
                                for i in range(3))
        conv = b.build_short_conv(b.op("mul", gate_in, u), f"{p}.conv.weight")
        return b.mul_mat(f"{p}.out_proj.weight", b.op("mul", gate_out, conv))

    @staticmethod
    def _attn_block(b: GraphBuilder, h: Node) -> Node:
        p = f"blk.{b.layer}"
        q, k, v = b.build_qkv(h)
        q = b.build_rope(b.build_norm(q, f"{p}.attn_q_norm.weight"))
        k = b.build_rope(b.build_norm(k, f"{p}.attn_k_norm.weight"))
        return b.build_attn(q, k, v)
