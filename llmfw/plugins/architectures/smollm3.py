"""The ``smollm3`` architecture (SmolLM3), as llama.cpp's ``llama_model_smollm3``.

A llama layer stack (NORM rope, SwiGLU, tied head when ``output.weight`` is absent) where every fourth layer
(``(il + 1) % 4 == 0``, llama.cpp's ``n_no_rope_layer_step = 4``) attends without rotary embeddings (NoPE):
its queries and keys carry no position, the causal mask alone orders them.
"""
from __future__ import annotations

from llmfw.core.ir.hparams import HParams
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
