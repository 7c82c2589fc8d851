"""The ``nemotron_h`` architecture (NVIDIA Nemotron-H, Nemotron Nano 2 dense), as llama.cpp's
``llama_model_nemotron_h``: every layer is one block of one of three kinds, told apart by the per-layer
``attention.head_count_kv`` and ``feed_forward_length`` arrays::

    h = rms_norm(x) * attn_norm                                   (every kind)
    Mamba-2 (head_count_kv 0 and feed_forward_length 0):  y = mamba2(h)       (:mod:`.mamba2`)
    attention (feed_forward_length 0):                    y = attn_output(attention(q, k, v))   no RoPE
    MLP (the others):                                     y = ffn_down(relu(ffn_up(h))²)         ungated
    x = x + y

then ``output(rms_norm(x) * output_norm)``. Attention has no positional encoding (the Mamba-2 layers carry the
order) and the scale ``1/sqrt(head_dim)``; biases are used when present. Memory: ``"hybrid"`` (a KV cache for the
attention layers, the Mamba-2 convolution window and SSM state for the Mamba-2 layers; the MLP layers hold
nothing). The MoE sibling ``nemotron_h_moe`` is another family; multi-token-prediction layers are not run.
"""
from __future__ import annotations

from typing import Any, ClassVar

from llmfw.core.arch.architecture import Architecture, TensorSpec, attention_qkv_tensors, layer_tensor
from llmfw.core.errors import ModelError, UnsupportedVariant
from llmfw.core.format.metadata import MetadataView
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.plugins.architectures.mamba2 import (Mamba2Dims, build_mamba2, mamba2_dims, mamba2_state,
                                                mamba2_tensors, read_mamba2_dims)


class NemotronHHParams(HParams):
    ssm: Mamba2Dims | None = None


def is_mamba_layer(hp: HParams, il: int) -> bool:
    """llama.cpp's ``is_recr``: no KV heads and no FFN."""
    return hp.n_head_kv(il) == 0 and hp.n_ff(il) == 0


def is_attention_layer(hp: HParams, il: int) -> bool:
    return not is_mamba_layer(hp, il) and hp.n_ff(il) == 0


class NemotronHArchitecture(Architecture):
    name = "nemotron_h"
    hparams_class: ClassVar[type[HParams]] = NemotronHHParams
    memory = "hybrid"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        if keys.get_int("{arch}.expert_count", 0) > 0:
            raise UnsupportedVariant(f"{keys.arch}: mixture-of-experts Nemotron-H files are the nemotron_h_moe family, "
                             "which is not supported")
        extra: dict[str, Any] = read_mamba2_dims(keys)
        # llama.cpp requires the layer-norm epsilon (its MTP head's) and defaults the RMS one to it
        eps = keys.get_float("{arch}.attention.layer_norm_epsilon")
        if not common["f_norm_rms_eps"]:
            extra["f_norm_rms_eps"] = eps
        return extra

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        for il in range(hp.n_layer):
            if is_attention_layer(hp, il) and hp.n_head(il) <= 0:
                raise ModelError(f"{hp.arch}: attention layer {il} has no heads")

    def recurrent_state(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]] | None:
        return mamba2_state(mamba2_dims(hp)) if is_mamba_layer(hp, il) else None

    def has_kv(self, hp: HParams, il: int) -> bool:
        return is_attention_layer(hp, il)  # the MLP layers keep nothing between ubatches

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        n_embd = hp.n_embd
        specs = [layer_tensor(il, "attn_norm.weight", (n_embd,), "mul")]
        if is_mamba_layer(hp, il):
            return specs + mamba2_tensors(mamba2_dims(hp), n_embd, il)
        if is_attention_layer(hp, il):
            n_q = hp.n_embd_head_k * hp.n_head(il)
            return specs + [*attention_qkv_tensors(hp, il), layer_tensor(il, "attn_output.weight", (n_q, n_embd)),
                            TensorSpec(f"blk.{il}.attn_output.bias", (n_embd,), il, optional=True, usage="add")]
        n_ff = hp.n_ff(il)
        return specs + [layer_tensor(il, "ffn_up.weight", (n_embd, n_ff)),
                        layer_tensor(il, "ffn_down.weight", (n_ff, n_embd)),
                        TensorSpec(f"blk.{il}.ffn_up.bias", (n_ff,), il, optional=True, usage="add"),
                        TensorSpec(f"blk.{il}.ffn_down.bias", (n_embd,), il, optional=True, usage="add")]

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            residual = x
            h = self._block(b, b.build_norm(x, f"blk.{il}.attn_norm.weight"), il)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
        b.build_output(x)

    @staticmethod
    def _block(b: GraphBuilder, h: Node, il: int) -> Node:
        if is_mamba_layer(b.hp, il):
            return build_mamba2(b, h, mamba2_dims(b.hp))
        if is_attention_layer(b.hp, il):
            q, k, v = b.build_qkv(h)
            return b.build_attn(q, k, v)
        p = f"blk.{il}"
        up = b.op("relu", b.mul_mat(f"{p}.ffn_up.weight", h, f"{p}.ffn_up.bias"))
        return b.mul_mat(f"{p}.ffn_down.weight", b.op("mul", up, up), f"{p}.ffn_down.bias")
