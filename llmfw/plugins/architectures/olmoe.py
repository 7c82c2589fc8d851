"""The ``olmoe`` architecture (OLMoE-1B-7B), as llama.cpp's ``llm_build_olmoe``: the qwen3 block (NEOX rope, Q/K RMS
norms, no biases) with two differences::

    q, k = rms_norm(q) * attn_q_norm, rms_norm(k) * attn_k_norm      over all heads at once (n_embd wide)
    x    = x + Σ_k w_k · expert_k(h)                                 with h = rms_norm(x) * ffn_norm

Routing: softmax over ``expert_count`` router logits, the top ``expert_used_count`` experts weighted by their
probabilities as they are (no renormalisation, unlike Mixtral / Qwen3-MoE); SiLU-gated experts. The output head
is its own tensor (never tied).
"""
from __future__ import annotations

from typing import Any

from llmfw.core.arch.architecture import OUTPUT_LAYER, TensorSpec
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.core.arch.moe import ROUTING_KEYS, MoeHParams, read_moe_hparams
from llmfw.plugins.architectures.qwen3 import Qwen3Architecture


class OlmoeArchitecture(Qwen3Architecture):
    name = "olmoe"
    experts = True
    norm_expert_weights = False

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        moe = read_moe_hparams(keys)
        return {k: moe[k] for k in ROUTING_KEYS}

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if not isinstance(hp, MoeHParams) or not hp.n_expert:
            raise ModelError("olmoe: expert_count must be > 1")

    def tensors(self, hp: HParams) -> list[TensorSpec]:
        specs = [s for s in super().tensors(hp) if s.name != "output.bias"]
        return [TensorSpec("output.weight", s.ne, OUTPUT_LAYER) if s.name == "output.weight" else s for s in specs]

    def qk_norm_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        return [TensorSpec(f"blk.{il}.attn_{qk}_norm.weight", (hp.n_embd,), il, usage="mul") for qk in "qk"]

    def qk_norm(self, b: GraphBuilder, x: Node, weight: str) -> Node:
        """RMS norm of [T, H, D] over all H*D values of a token (OLMoE normalises q and k before the head split)."""
        assert x.shape is not None
        heads, head_dim = x.shape[1], x.shape[2]
        flat = b.build_norm(b.op("reshape", x, shape=(-1, heads * head_dim)), weight)
        return b.op("reshape", flat, shape=(-1, heads, head_dim))
