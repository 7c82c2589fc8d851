"""The ``qwen35moe`` architecture (Qwen3.5 / Qwen3.6 MoE: 35B-A3B, 122B-A10B, 397B-A17B), as llama.cpp's
``llama_model_qwen35moe``: the :mod:`.qwen35` layer stack (Gated DeltaNet layers beside gated attention, hybrid
memory) with every FFN a mixture of experts plus one shared expert behind a sigmoid gate::

    probs = softmax(ffn_gate_inp(h));  ids = top_k(probs, expert_used_count);  w = probs[ids] / Σ probs[ids]
    moe   = Σ_k w_k · ffn_down_exps[ids_k](silu(ffn_gate_exps[ids_k](h)) * ffn_up_exps[ids_k](h))
    y     = moe + sigmoid(h · ffn_gate_inp_shexp) · ffn_down_shexp(silu(ffn_gate_shexp(h)) * ffn_up_shexp(h))

The routed experts' width is ``expert_feed_forward_length`` (else ``feed_forward_length / expert_used_count``),
the shared expert's ``expert_shared_feed_forward_length`` (else ``feed_forward_length``); gate and up may be one
fused ``ffn_gate_up_exps``. llama.cpp fixes softmax routing with renormalised weights for this family and reads
no weight scale or gating key.
"""
from __future__ import annotations

from typing import Any, ClassVar

from llmfw.core.arch.architecture import TensorSpec, layer_tensor
from llmfw.core.arch.moe import ROUTING_KEYS, MoeHParams, build_shared_experts, expert_tensors, \
    read_moe_hparams, shared_expert_tensors
from llmfw.core.errors import ModelError
from llmfw.core.format.metadata import MetadataView
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.plugins.architectures.qwen35 import Qwen35Architecture, Qwen35HParams


class Qwen35MoeHParams(Qwen35HParams, MoeHParams):
    """Qwen3.5's Gated DeltaNet keys plus the expert counts and widths."""


class Qwen35MoeArchitecture(Qwen35Architecture):
    name = "qwen35moe"
    hparams_class: ClassVar[type[HParams]] = Qwen35MoeHParams
    #: whether the chosen experts' weights are renormalised to sum to one (llama.cpp's ``norm_w``, always on here)
    norm_expert_weights: bool = True

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        moe = read_moe_hparams(keys)
        return {**super().own_hparams(keys, common),
                **{k: moe[k] for k in (*ROUTING_KEYS, "n_ff_exp", "n_ff_shexp")}}

    def check_expert_count(self, keys: MetadataView) -> None:
        if keys.get_int("{arch}.expert_count", 0) <= 1:
            raise ModelError(f"{keys.arch}: expert_count must be > 1 (a dense Qwen3.5 is the qwen35 architecture)")

    def ffn_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        assert isinstance(hp, MoeHParams)
        n_ff_exp = hp.n_ff_exp or hp.n_ff(il) // hp.n_expert_used
        return [*expert_tensors(hp, il, n_ff_exp, fused_gate_up=True),
                *shared_expert_tensors(hp, il, hp.n_ff_shexp or hp.n_ff(il)),
                layer_tensor(il, "ffn_gate_inp_shexp.weight", (hp.n_embd,), "mul")]

    def feed_forward(self, b: GraphBuilder, h: Node, il: int) -> Node:
        routed = b.build_moe_ffn(h, il, gating="softmax", norm_w=self.norm_expert_weights, act="silu")
        # the shared expert's gate is one value per token: a dot product of h with a [n_embd] vector
        gate = b.op("sigmoid", b.op("sum_rows", b.op("mul", h, b.weight(f"blk.{il}.ffn_gate_inp_shexp.weight"))))
        return b.op("add", routed, b.op("mul", build_shared_experts(b, h, il), gate))
