"""The ``glm4moe`` architecture (GLM-4.5, GLM-4.5-Air, GLM-4.6/4.7), as llama.cpp's ``llm_build_glm4_moe``::

    q, k, v = attn_q(h) + b, attn_k(h) + b, attn_v(h) + b              with h = rms_norm(x) * attn_norm
    q, k    = rms_norm(q) * attn_q_norm, rms_norm(k) * attn_k_norm      per head, when the file has them
    x       = x + attn_output(attention(rope(q), rope(k), v))            NEOX rope on the first n_rot dims
    h       = rms_norm(x) * post_attention_norm
    x       = x + ffn(h)                                 the first leading_dense_block_count layers (dense)
    x       = x + moe(h) + shared_expert(h)              the others

Routing (llama.cpp's ``build_moe_ffn``): gating by ``expert_gating_func`` (sigmoid when absent), the expert
probability bias ``exp_probs_b`` added for the selection only, grouped selection when ``expert_group_count`` > 1,
the chosen weights renormalised when ``expert_weights_norm`` and scaled by ``expert_weights_scale``. The shared
experts are one dense SiLU FFN of width ``expert_feed_forward_length * expert_shared_count``. Multi-token
prediction layers (``nextn_predict_layers``, the last blocks of the file) are not part of the model's forward
pass: their tensors are left unread, as llama.cpp does by default.
"""
from __future__ import annotations

from typing import Any

from llmfw.core.arch.architecture import Architecture, TensorSpec, attention_qkv_tensors
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.core.arch.moe import (MoeHParams, build_layer_ffn, expert_tensors, mtp_trunk, read_moe_hparams,
                            shared_expert_tensors)

class Glm4MoeArchitecture(Architecture):
    name = "glm4moe"
    rope_type = "neox"
    hparams_class = MoeHParams

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        extra = read_moe_hparams(keys, default_gating="sigmoid")
        extra["n_expert_shared"] = keys.get_int("{arch}.expert_shared_count")
        return {**extra, **mtp_trunk(keys, common)}

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if not isinstance(hp, MoeHParams) or not hp.n_expert:
            raise ModelError("glm4moe: expert_count must be > 1")

    def expert_ff(self, hp: MoeHParams, il: int) -> int:
        return hp.n_ff_exp or hp.n_ff(il) // hp.n_expert_used

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        assert isinstance(hp, MoeHParams)
        n_embd, p = hp.n_embd, f"blk.{il}"
        specs = [TensorSpec(f"{p}.attn_norm.weight", (n_embd,), il, usage="mul"),
                 *attention_qkv_tensors(hp, il),
                 TensorSpec(f"{p}.attn_output.weight", (hp.n_embd_head_k * hp.n_head(il), n_embd), il),
                 TensorSpec(f"{p}.post_attention_norm.weight", (n_embd,), il, usage="mul"),
                 *[TensorSpec(f"{p}.attn_{qk}_norm.weight", (hp.n_embd_head_k,), il, optional=True, usage="mul")
                   for qk in "qk"]]
        if not hp.is_moe_layer(il):
            n_ff = hp.n_ff(il)
            return specs + [TensorSpec(f"{p}.ffn_gate.weight", (n_embd, n_ff), il),
                            TensorSpec(f"{p}.ffn_up.weight", (n_embd, n_ff), il),
                            TensorSpec(f"{p}.ffn_down.weight", (n_ff, n_embd), il)]
        n_ff_exp = self.expert_ff(hp, il)
        specs += expert_tensors(hp, il, n_ff_exp)
        specs.append(TensorSpec(f"{p}.exp_probs_b.bias", (hp.n_expert,), il, usage="add"))
        if hp.n_expert_shared:
            specs += shared_expert_tensors(hp, il, n_ff_exp * hp.n_expert_shared)
        return specs

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            q, k, v = b.build_qkv(b.build_norm(x, f"{p}.attn_norm.weight"))
            if b.has_weight(f"{p}.attn_q_norm.weight"):
                q = b.build_norm(q, f"{p}.attn_q_norm.weight")
            if b.has_weight(f"{p}.attn_k_norm.weight"):
                k = b.build_norm(k, f"{p}.attn_k_norm.weight")
            h = b.build_attn(b.build_rope(q), b.build_rope(k), v)
            x = b.add_residual(h, residual)
            x = b.op("add", build_layer_ffn(b, b.build_norm(x, f"{p}.post_attention_norm.weight"), il), x)
        b.build_output(x)
