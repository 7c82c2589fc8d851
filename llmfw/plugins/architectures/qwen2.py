"""The ``qwen2`` architecture (Qwen 1.5 / Qwen 2 / Qwen 2.5 dense models), as llama.cpp's ``llm_build_qwen2``.

The llama block with two differences: Q, K and V carry biases (``attn_{q,k,v}.bias``, used by the shared
``build_qkv`` whenever present) and RoPE is NEOX (rotates the two halves of each head instead of adjacent
pairs). An optional ``output.bias`` is added to the logits; the head is tied to ``token_embd`` when
``output.weight`` is absent.
"""
from __future__ import annotations

from llmfw.sdk import HParams, OUTPUT_LAYER, TensorSpec
from llmfw.plugins.architectures.llama import LlamaArchitecture


class Qwen2Architecture(LlamaArchitecture):
    name = "qwen2"
    rope_type = "neox"
    experts = False  # qwen2moe is a family of its own in llama.cpp

    def tensors(self, hp: HParams) -> list[TensorSpec]:
        head_bias = TensorSpec("output.bias", (hp.n_vocab,), OUTPUT_LAYER, optional=True, usage="add")
        return super().tensors(hp) + [head_bias]

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        # qwen2 files have no rope_freqs (llama3 scaling is a llama-only convention)
        return [t for t in super().layer_tensors(hp, il) if not t.name.endswith("rope_freqs.weight")]

    def rope_freq_factors(self, hp: HParams, il: int) -> str | None:
        return None
