"""The ``granitehybrid`` architecture (IBM Granite 4.0-H), as llama.cpp's ``llama_model_granite_hybrid``: Granite's
layer stack and multipliers (embedding / residual / attention / logit scales, RoPE switched by
``rope.scaling.finetuned``) where the layers without KV heads (``attention.head_count_kv`` 0) are Mamba-2 mixers
(:mod:`.mamba2`) instead of attention. Memory: ``"hybrid"`` (KV cache for the attention layers, the Mamba-2
convolution window and SSM state for the others).

Granite 4.0-H's released models put a mixture of experts with a shared expert in every FFN: those files
(``expert_count`` > 0) are refused until the MoE block lands; the dense variant (every FFN a SwiGLU) runs.
"""
from __future__ import annotations

from typing import Any

from llmfw.core.arch.architecture import TensorSpec, attention_qkv_tensors
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.plugins.architectures.granite import GraniteArchitecture, GraniteHParams, read_granite_multipliers
from llmfw.plugins.architectures.mamba2 import (Mamba2Dims, build_mamba2, mamba2_state, mamba2_tensors,
                                                read_mamba2_dims)


class GraniteHybridHParams(GraniteHParams):
    ssm: Mamba2Dims | None = None


def is_mamba_layer(hp: HParams, il: int) -> bool:
    """llama.cpp's ``is_recr``: a layer without KV heads is recurrent."""
    return hp.n_head_kv(il) == 0


def _dims(hp: HParams) -> Mamba2Dims:
    dims = getattr(hp, "ssm", None)
    if not isinstance(dims, Mamba2Dims):
        raise ModelError(f"{hp.arch}: the Mamba-2 ssm.* hyperparameters are missing")
    return dims


class GraniteHybridArchitecture(GraniteArchitecture):
    name = "granitehybrid"
    hparams_class = GraniteHybridHParams
    memory = "hybrid"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        if keys.get_int("{arch}.expert_count", 0) > 0:
            raise ModelError(f"{keys.arch}: this file's FFNs are a mixture of experts (expert_count > 0), which "
                             "needs the MoE block; only the dense Granite 4.0-H variant runs for now")
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required: ModelError names it when absent
        return {**read_granite_multipliers(keys, logit_scale_required=False), **read_mamba2_dims(keys)}

    def check_hparams(self, hp: HParams) -> None:
        super(GraniteArchitecture, self).check_hparams(hp)  # logit_scale is optional here
        if _dims(hp).d_inner != 2 * hp.n_embd:
            raise ModelError(f"{hp.arch}: ssm.inner_size must be 2 × embedding_length (llama.cpp supports only "
                             f"that expansion), found {_dims(hp).d_inner}")

    def recurrent_state(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]] | None:
        return mamba2_state(_dims(hp)) if is_mamba_layer(hp, il) else None

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        if not is_mamba_layer(hp, il):
            return super().layer_tensors(hp, il)
        attention = {s.name for s in attention_qkv_tensors(hp, il)} | {f"blk.{il}.attn_output.{k}"
                                                                      for k in ("weight", "bias")}
        shared = [s for s in super().layer_tensors(hp, il) if s.name not in attention]
        return shared + mamba2_tensors(_dims(hp), hp.n_embd, il)

    def mixer(self, b: GraphBuilder, h: Node) -> Node:
        if is_mamba_layer(b.hp, b.layer):
            return build_mamba2(b, h, _dims(b.hp))
        return super().mixer(b, h)
