"""OLMo (allenai/OLMo-1B, OLMo-7B; ``general.architecture = olmo``) for llmfw, as llama.cpp's ``llm_build_olmo``.

A complete third-party architecture in one file. Per layer::

    q, k, v = clamp(attn_q(h)), clamp(attn_k(h)), clamp(attn_v(h))    with h = layer_norm(x)   (no weights)
    x       = x + attn_output(attention(rope(q), rope(k), v))                   NORM rope
    x       = x + ffn_down(silu(ffn_gate(h)) * ffn_up(h))                       with h = layer_norm(x)

then ``output(layer_norm(x))``. OLMo's layer norms are non-parametric (no weight, no bias); the optional
``olmo.attention.clamp_kqv`` clips Q, K and V to ``[-c, c]`` (OLMo's ``clip_qkv``).

Registered through the entry point ``olmo = "llmfw_olmo"`` in the group ``llmfw`` (see pyproject.toml).
"""
from __future__ import annotations

from typing import Any

from llmfw.sdk import (Architecture, GraphBuilder, HParams, INPUT_LAYER, MetadataView, ModelError, Node, OUTPUT_LAYER,
                       TensorSpec, hookimpl)

__version__ = "0.1.0"


class OlmoHParams(HParams):
    #: clip Q, K and V to [-f_clamp_kqv, f_clamp_kqv]; 0 = no clipping
    f_clamp_kqv: float = 0.0


class OlmoArchitecture(Architecture):
    name = "olmo"
    hparams_class = OlmoHParams
    rope_type = "norm"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        keys.get_float("{arch}.attention.layer_norm_epsilon")  # required: ModelError names it when absent
        return {"f_clamp_kqv": keys.get_float("{arch}.attention.clamp_kqv", 0.0)}

    def check_hparams(self, hp: HParams) -> None:
        if hp.f_norm_eps <= 0:
            raise ModelError(f"olmo: attention.layer_norm_epsilon must be > 0, found {hp.f_norm_eps}")
        if hp.f_clamp_kqv < 0:
            raise ModelError(f"olmo: attention.clamp_kqv must be >= 0, found {hp.f_clamp_kqv}")
        if hp.n_embd_head_k != hp.n_embd_head_v or hp.n_rot != hp.n_embd_head_k:
            raise ModelError(f"olmo: head sizes must agree: key {hp.n_embd_head_k}, value {hp.n_embd_head_v}, "
                             f"rope {hp.n_rot}")

    def tensors(self, hp: HParams) -> list[TensorSpec]:
        n_embd, n_vocab = hp.n_embd, hp.n_vocab
        specs = [
            TensorSpec("token_embd.weight", (n_embd, n_vocab), INPUT_LAYER, usage="get_rows"),
            TensorSpec("output.weight", (n_embd, n_vocab), OUTPUT_LAYER, duplicate_of="token_embd.weight"),
        ]
        for il in range(hp.n_layer):
            n_ff, n_q = hp.n_ff(il), hp.n_embd_head_k * hp.n_head(il)
            shapes = {
                "attn_q": (n_embd, n_q), "attn_k": (n_embd, hp.n_embd_k_gqa(il)),
                "attn_v": (n_embd, hp.n_embd_v_gqa(il)), "attn_output": (n_q, n_embd),
                "ffn_gate": (n_embd, n_ff), "ffn_down": (n_ff, n_embd), "ffn_up": (n_embd, n_ff),
            }
            specs += [TensorSpec(f"blk.{il}.{name}.weight", ne, il) for name, ne in shapes.items()]
        return specs

    def _clamp(self, b: GraphBuilder, *nodes: Node) -> tuple[Node, ...]:
        limit = b.hp.f_clamp_kqv
        if not limit:
            return nodes
        return tuple(b.op("clamp", n, min=-limit, max=limit) for n in nodes)

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            residual = x
            q, k, v = self._clamp(b, *b.build_qkv(b.build_norm(x, None, kind="layer")))
            h = b.build_attn(b.build_rope(q), b.build_rope(k), v)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
            x = b.op("add", b.build_ffn(b.build_norm(x, None, kind="layer"), act="silu"), x)
        b.build_output(b.build_norm(x, None, kind="layer"), norm=None)


@hookimpl
def register_architectures(register) -> None:
    register("olmo", "llmfw_olmo:OlmoArchitecture")
