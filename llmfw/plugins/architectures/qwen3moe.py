"""The ``qwen3moe`` architecture (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder...), as llama.cpp's
``llm_build_qwen3moe``: the qwen3 block (Q/K RMS norms per head, NEOX rope, no biases) with every FFN replaced by
routed experts::

    probs = softmax(ffn_gate_inp(h));  ids = top_k(probs, expert_used_count);  w = probs[ids] / Σ probs[ids]
    x     = x + Σ_k w_k · ffn_down_exps[ids_k](silu(ffn_gate_exps[ids_k](h)) * ffn_up_exps[ids_k](h))

The experts' width is ``expert_feed_forward_length`` (else ``feed_forward_length / expert_used_count``);
llama.cpp renormalises the chosen weights always and reads no weight scale for this family.
"""
from __future__ import annotations

from typing import Any

from llmfw.core.errors import ModelError
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.core.arch.moe import ROUTING_KEYS, MoeHParams, read_moe_hparams
from llmfw.plugins.architectures.qwen3 import Qwen3Architecture


class Qwen3MoeArchitecture(Qwen3Architecture):
    name = "qwen3moe"
    experts = True

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        extra = super().own_hparams(keys, common)
        moe = read_moe_hparams(keys)
        extra.update({k: moe[k] for k in (*ROUTING_KEYS, "n_ff_exp")})
        return extra

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if not isinstance(hp, MoeHParams) or not hp.n_expert:
            raise ModelError("qwen3moe: expert_count must be > 1 (a dense Qwen3 is the qwen3 architecture)")

    def expert_ff(self, hp: MoeHParams, il: int) -> int:
        return hp.n_ff_exp or hp.n_ff(il) // hp.n_expert_used
