"""The ``granite`` architecture (IBM Granite 3.x dense), as llama.cpp's ``llama_model_granite``.

A llama layer stack with four multipliers from the file:

* ``embedding_scale``: the token embeddings are multiplied by it (0 / absent: not applied);
* ``residual_scale``: each block's output (attention, then FFN) is multiplied by it before the residual add;
* ``attention.scale``: the attention's ``q·k`` scale instead of ``1/sqrt(head_dim)``;
* ``logit_scale`` (required): the logits are divided by it.

RoPE is NORM mode and switched by ``rope.scaling.finetuned`` (default true: on for every layer). The MoE variant
(``expert_count`` > 0, Granite MoE) is refused: it needs the mixture-of-experts block.
"""
from __future__ import annotations

from typing import Any

from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.plugins.architectures.llama import LlamaArchitecture


class GraniteHParams(HParams):
    #: logits are divided by this (``{arch}.logit_scale``)
    f_logit_scale: float = 1.0
    #: block outputs are multiplied by this before each residual add (0: not applied)
    f_residual_scale: float = 0.0
    #: token embeddings are multiplied by this (0: not applied)
    f_embedding_scale: float = 0.0


def read_granite_multipliers(keys: MetadataView, logit_scale_required: bool = True) -> dict[str, Any]:
    """The multipliers every Granite family shares (dense: logit_scale required; hybrid: optional, 0 = off)."""
    return {
        "f_logit_scale": keys.get_float("{arch}.logit_scale") if logit_scale_required
        else keys.get_float("{arch}.logit_scale", 0.0),
        "f_residual_scale": keys.get_float("{arch}.residual_scale", 0.0),
        "f_embedding_scale": keys.get_float("{arch}.embedding_scale", 0.0),
        # RoPE is on unless the file switches it off with rope.scaling.finetuned = false
        "rope_finetuned": keys.get_bool("{arch}.rope.scaling.finetuned", True),
    }


def check_logit_scale(hp: HParams) -> None:
    if not isinstance(hp, GraniteHParams) or hp.f_logit_scale == 0:
        raise ModelError(f"{hp.arch}: logit_scale must be non-zero (the logits are divided by it)")


def scaled_embeddings(b: GraphBuilder, x: Node) -> Node:
    """The input embeddings × ``embedding_scale`` when the file sets one."""
    scale = b.hp.f_embedding_scale if isinstance(b.hp, GraniteHParams) else 0.0
    return b.op("scale", x, s=scale) if scale else x


def scaled_residual(b: GraphBuilder, block_out: Node) -> Node:
    """A block's output × ``residual_scale`` when the file sets one (before it joins the residual)."""
    scale = b.hp.f_residual_scale if isinstance(b.hp, GraniteHParams) else 0.0
    return b.op("scale", block_out, s=scale) if scale else block_out


def scaled_logits(b: GraphBuilder) -> None:
    """Divide the graph's logits by ``logit_scale`` when set (embeddings mode has no logits)."""
    hp = b.hp
    if "logits" in b.graph.outputs and isinstance(hp, GraniteHParams) and hp.f_logit_scale:
        b.layer = hp.n_layer
        b.graph.outputs["logits"] = b.op("scale", b.graph.outputs["logits"], s=1.0 / hp.f_logit_scale)


class GraniteArchitecture(LlamaArchitecture):
    name = "granite"
    hparams_class = GraniteHParams

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        return {**super().own_hparams(keys, common), **read_granite_multipliers(keys)}

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        check_logit_scale(hp)

    def has_rope(self, hp: HParams, il: int) -> bool:
        return hp.rope_finetuned

    def input_embeddings(self, b: GraphBuilder) -> Node:
        return scaled_embeddings(b, super().input_embeddings(b))

    def block_output(self, b: GraphBuilder, h: Node) -> Node:
        return scaled_residual(b, h)

    def finish_output(self, b: GraphBuilder) -> None:
        scaled_logits(b)
