"""The ``olmoe`` architecture (OLMoE-1B-7B), as llama.cpp's ``llm_build_olmoe``::

    q, k, v = attn_q(h), attn_k(h), attn_v(h)                        with h = rms_norm(x) * attn_norm
    q, k    = rms_norm(q) * attn_q_norm, rms_norm(k) * attn_k_norm  over all heads at once (n_embd wide)
    x       = x + attn_output(attention(rope(q), rope(k), v))        NEOX rope
    x       = x + Σ_k w_k · expert_k(h)                              with h = rms_norm(x) * ffn_norm

Routing: softmax over ``expert_count`` router logits, the top ``expert_used_count`` experts weighted by their
probabilities as they are (no renormalisation, unlike Mixtral / Qwen3-MoE); SiLU-gated experts. The output head
is its own tensor (never tied).
"""
from __future__ import annotations

from typing import Any

from llmfw.core.architecture import OUTPUT_LAYER, TensorSpec
from llmfw.core.errors import ModelError
from llmfw.core.graph import GraphBuilder, Node
from llmfw.core.hparams import HParams
from llmfw.core.loader import MetadataView
from llmfw.core.moe import ROUTING_KEYS, MoeHParams, read_moe_hparams
from llmfw.plugins.architectures.llama import LlamaArchitecture


class OlmoeArchitecture(LlamaArchitecture):
    name = "olmoe"
    rope_type = "neox"
    norm_expert_weights = False

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        moe = read_moe_hparams(keys)
        return {k: moe[k] for k in ROUTING_KEYS}

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if not isinstance(hp, MoeHParams) or not hp.n_expert:
            raise ModelError("olmoe: expert_count must be > 1")

    def tensors(self, hp: HParams) -> list[TensorSpec]:
        specs = super().tensors(hp)
        return [TensorSpec("output.weight", s.ne, OUTPUT_LAYER) if s.name == "output.weight" else s for s in specs]

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        norms = [TensorSpec(f"blk.{il}.attn_{qk}_norm.weight", (hp.n_embd,), il, usage="mul") for qk in "qk"]
        specs = [s for s in super().layer_tensors(hp, il) if not s.name.endswith("rope_freqs.weight")]
        return specs + norms

    def rope_freq_factors(self, hp: HParams, il: int) -> str | None:
        return None

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            q, k, v = b.build_qkv(b.build_norm(x, f"{p}.attn_norm.weight"))
            q = b.build_rope(self._wide_norm(b, q, f"{p}.attn_q_norm.weight"))
            k = b.build_rope(self._wide_norm(b, k, f"{p}.attn_k_norm.weight"))
            h = b.build_attn(q, k, v)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
            x = b.op("add", self.build_feed_forward(b, b.build_norm(x, f"{p}.ffn_norm.weight"), il), x)
        b.build_output(x)

    @staticmethod
    def _wide_norm(b: GraphBuilder, x: Node, weight: str) -> Node:
        """RMS norm of [T, H, D] over all H*D values of a token (OLMoE normalises q and k before the head split)."""
        assert x.shape is not None
        heads, head_dim = x.shape[1], x.shape[2]
        flat = b.build_norm(b.op("reshape", x, shape=(-1, heads * head_dim)), weight)
        return b.op("reshape", flat, shape=(-1, heads, head_dim))
