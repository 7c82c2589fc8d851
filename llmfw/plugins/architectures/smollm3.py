"""The ``smollm3`` architecture (SmolLM3), as llama.cpp's ``llama_model_smollm3``.

A llama layer stack (NORM rope, SwiGLU, tied head when ``output.weight`` is absent) where every fourth layer
(``(il + 1) % 4 == 0``, llama.cpp's ``n_no_rope_layer_step = 4``) attends without rotary embeddings (NoPE):
its queries and keys carry no position, the causal mask alone orders them.
"""
from __future__ import annotations

from llmfw.core.graph import GraphBuilder
from llmfw.core.hparams import HParams
from llmfw.plugins.architectures.llama import LlamaArchitecture

#: every this-many-th layer skips RoPE (fixed in llama.cpp's loader, not a file key)
NO_ROPE_LAYER_STEP = 4


def uses_rope(il: int, step: int = NO_ROPE_LAYER_STEP) -> bool:
    """Whether layer ``il`` rotates its queries and keys (the last of every ``step`` layers does not)."""
    return (il + 1) % step != 0


class SmolLM3Architecture(LlamaArchitecture):
    name = "smollm3"

    def has_rope(self, hp: HParams, il: int) -> bool:
        return uses_rope(il)

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            residual = x
            q, k, v = b.build_qkv(b.build_norm(x, f"blk.{il}.attn_norm.weight"))
            if self.has_rope(b.hp, il):
                q, k = b.build_rope(q), b.build_rope(k)
            h = b.build_attn(q, k, v)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
            x = b.op("add", b.build_ffn(b.build_norm(x, f"blk.{il}.ffn_norm.weight"), act="silu"), x)
        b.build_output(x)
