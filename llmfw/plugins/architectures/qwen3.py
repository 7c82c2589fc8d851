"""The ``qwen3`` architecture (Qwen 3 dense models), as llama.cpp's ``llm_build_qwen3``.

Per layer::

    q, k, v = attn_q(h), attn_k(h), attn_v(h)                    with h = rms_norm(x) * attn_norm
    q, k    = rope(rms_norm(q) * attn_q_norm), rope(rms_norm(k) * attn_k_norm)     per head, NEOX rope
    x       = x + attn_output(attention(q, k, v))
    x       = x + ffn_down(silu(ffn_gate(h)) * ffn_up(h))        with h = rms_norm(x) * ffn_norm

No biases. The head size is explicit (``attention.key_length``, e.g. 128 on Qwen3-0.6B whose n_embd / n_head
is 64), so ``attn_q`` maps n_embd to head_dim * n_head and ``attn_output`` maps it back.
"""
from __future__ import annotations

from llmfw.sdk import GraphBuilder, HParams, ModelError, Node, TensorSpec
from llmfw.plugins.architectures.qwen2 import Qwen2Architecture


class Qwen3Architecture(Qwen2Architecture):
    name = "qwen3"

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if hp.n_rot != hp.n_embd_head_k:
            raise ModelError(f"qwen3: rope.dimension_count {hp.n_rot} must equal the head size {hp.n_embd_head_k}")

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        return super().layer_tensors(hp, il) + self.qk_norm_tensors(hp, il)

    def qk_norm_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        """The Q and K norm weights: one head wide (applied per head)."""
        return [TensorSpec(f"blk.{il}.attn_{qk}_norm.weight", (hp.n_embd_head_k,), il, usage="mul") for qk in "qk"]

    def qk_norm(self, b: GraphBuilder, x: Node, weight: str) -> Node:
        """RMS norm of q or k [T, H, D] by ``weight``, per head."""
        return b.build_norm(x, weight)

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            q, k, v = b.build_qkv(b.build_norm(x, f"{p}.attn_norm.weight"))
            q = b.build_rope(self.qk_norm(b, q, f"{p}.attn_q_norm.weight"))
            k = b.build_rope(self.qk_norm(b, k, f"{p}.attn_k_norm.weight"))
            h = b.build_attn(q, k, v)
            x = b.add_residual(h, residual)
            x = b.op("add", self.build_feed_forward(b, b.build_norm(x, f"{p}.ffn_norm.weight"), il), x)
        b.build_output(x)
