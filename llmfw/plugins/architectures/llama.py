"""The ``llama`` architecture (Llama 1/2/3, Mistral, SmolLM, TinyLlama... anything converted as ``llama``).

Graph, per layer (llama.cpp's ``llm_build_llama``)::

    x  = x + attn_output(attention(rope(q), rope(k), v))      with q, k, v from rms_norm(x) * attn_norm
    x  = x + ffn_down(silu(ffn_gate(h)) * ffn_up(h))          with h = rms_norm(x) * ffn_norm

then ``output(rms_norm(x) * output_norm)``; the head is tied to ``token_embd`` when ``output.weight`` is absent.
Biases (``attn_q.bias``...) are used when present. RoPE is NORM mode; scaling ``linear`` (freq_scale),
``yarn`` (ext_factor / mscale / corr dims) and ``llama3`` (per-dimension frequency factors from
``rope_freqs.weight`` or, when absent, computed from ``rope.scaling.*`` keys) are supported.

Mixtral-style files (``expert_count`` > 1) replace each FFN by routed experts: softmax router, top
``expert_used_count``, the chosen weights renormalised, SiLU-gated ``ffn_{gate,up,down}_exps`` (llama.cpp's
``build_moe_ffn`` with ``norm_w``; no weight scale).
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from llmfw.core.arch.moe import ROUTING_KEYS, MoeHParams, expert_tensors, read_moe_hparams
from llmfw.sdk import (Architecture, GraphBuilder, HParams, MetadataView, ModelError, Node, RopeType, TensorSpec,
                       attention_qkv_tensors)


def llama3_rope_factors(hp: HParams) -> np.ndarray:
    """Frequency divisors of Llama 3.x's rope scaling, as the HF→GGUF converter computes ``rope_freqs``.

    Float32 arithmetic throughout, as the converter does it, with every operation a correctly rounded scalar one:
    numpy's vectorised float32 power gives other last bits on AVX-512 than on AVX2, and the same file must get
    the same factors on every CPU."""
    f32 = np.float32
    factor = f32(hp.rope_scaling_factor or 8.0)
    low, high = hp.rope_llama3_low_freq_factor, hp.rope_llama3_high_freq_factor
    old_ctx = hp.n_ctx_orig_yarn or 8192
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for dim in range(0, hp.n_rot, 2):
        exponent = f32(dim) / f32(hp.n_rot)
        freq = f32(1.0) / f32(float(hp.rope_freq_base_train) ** float(exponent))
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            out.append(f32(1.0))
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (f32(old_ctx) / wavelen - f32(low)) / f32(high - low)
            out.append(f32(1.0) / ((f32(1.0) - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


class LlamaArchitecture(Architecture):
    name = "llama"
    rope_type: ClassVar[RopeType] = "norm"
    hparams_class: ClassVar[type[HParams]] = MoeHParams
    #: whether files of this family may have routed experts (llama: Mixtral; the dense families built on it not)
    experts: bool = True
    #: whether the chosen experts' weights are renormalised to sum to one (llama.cpp's ``norm_w``)
    norm_expert_weights: bool = True

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if keys.get_int("{arch}.expert_count", 0) > 0:
            if not self.experts:
                raise ModelError(f"{keys.arch}: mixture-of-experts {keys.arch} models (expert_count > 0) are not "
                                 "supported")
            # llama.cpp's llama reads only the counts: no weight scale, normalisation always on
            extra.update({k: v for k, v in read_moe_hparams(keys).items() if k in ROUTING_KEYS})
        if common["rope_scaling_type"] == "llama3":
            # the factor scales frequencies through rope_freqs, not through freq_scale
            extra["rope_freq_scale_train"] = 1.0
            extra["rope_freq_scale_train_swa"] = 1.0
        return extra

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        n_embd = hp.n_embd
        n_q = hp.n_embd_head_k * hp.n_head(il)
        p = f"blk.{il}"

        def t(name: str, ne: tuple[int, ...], usage: str = "mul_mat", optional: bool = False,
              **kw: Any) -> TensorSpec:
            return TensorSpec(f"{p}.{name}", ne, il, optional=optional, usage=usage, **kw)

        specs = [
            t("attn_norm.weight", (n_embd,), "mul"),
            *attention_qkv_tensors(hp, il),
            t("attn_output.weight", (n_q, n_embd)),
            t("attn_output.bias", (n_embd,), "add", True),
            t("ffn_norm.weight", (n_embd,), "mul"),
        ]
        if isinstance(hp, MoeHParams) and hp.n_expert:
            specs += expert_tensors(hp, il, self.expert_ff(hp, il), gate_optional=True)
        else:
            specs += self._dense_ffn_tensors(hp, il)
        # one rope_freqs tensor in the file serves every layer; each layer gets its own handle so that layers
        # on different backends each hold a copy (llama.cpp's TENSOR_DUPLICATED)
        generate = llama3_rope_factors if hp.rope_scaling_type == "llama3" else None
        specs.append(TensorSpec(f"{p}.rope_freqs.weight", (hp.n_rot // 2,), il, optional=True, usage="rope",
                                duplicate_of="rope_freqs.weight", generate=generate))
        return specs

    def expert_ff(self, hp: MoeHParams, il: int) -> int:
        """The routed experts' hidden size (llama: ``feed_forward_length``)."""
        return hp.n_ff(il)

    @staticmethod
    def _dense_ffn_tensors(hp: HParams, il: int) -> list[TensorSpec]:
        n_embd, n_ff = hp.n_embd, hp.n_ff(il)
        p = f"blk.{il}"

        def t(name: str, ne: tuple[int, ...], usage: str = "mul_mat", optional: bool = False) -> TensorSpec:
            return TensorSpec(f"{p}.{name}", ne, il, optional=optional, usage=usage)

        return [
            t("ffn_gate.weight", (n_embd, n_ff)),
            t("ffn_down.weight", (n_ff, n_embd)),
            t("ffn_up.weight", (n_embd, n_ff)),
            t("ffn_gate.bias", (n_ff,), "add", True),
            t("ffn_down.bias", (n_embd,), "add", True),
            t("ffn_up.bias", (n_ff,), "add", True),
        ]

    def rope_freq_factors(self, hp: HParams, il: int) -> str | None:
        return f"blk.{il}.rope_freqs.weight"

    def build_graph(self, b: GraphBuilder) -> None:
        x = self.input_embeddings(b)
        for il in b.layers():
            residual = x
            h = self.block_output(b, self.mixer(b, b.build_norm(x, f"blk.{il}.attn_norm.weight")))
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
            h = b.build_norm(x, f"blk.{il}.ffn_norm.weight")
            x = b.op("add", self.block_output(b, self.build_feed_forward(b, h, il)), x)
        b.build_output(x)
        self.finish_output(b)

    def build_feed_forward(self, b: GraphBuilder, h: Node, il: int) -> Node:
        """The layer's FFN on the normed ``h``: SwiGLU, or Mixtral's routed experts when the layer has a router."""
        if b.has_weight(f"blk.{il}.ffn_gate_inp.weight"):
            return b.build_moe_ffn(h, il, gating="softmax", norm_w=self.norm_expert_weights, act="silu")
        return b.build_ffn(h, act="silu")


    # -- what llama's relatives change (smollm3, granite, mistral3) ---------------------------------------------
    def input_embeddings(self, b: GraphBuilder) -> Node:
        """The token embeddings entering layer 0."""
        return b.build_inp_embd()

    def mixer(self, b: GraphBuilder, h: Node) -> Node:
        """The current layer's token mixer on the normed input: self-attention (a hybrid family puts its
        recurrent block here for its recurrent layers)."""
        q, k, v = b.build_qkv(h)
        q, k = self.position_qk(b, q, k)
        return b.build_attn(q, k, v)

    def position_qk(self, b: GraphBuilder, q: Node, k: Node) -> tuple[Node, Node]:
        """Queries and keys of the current layer after position encoding: RoPE where :meth:`has_rope`."""
        if not self.has_rope(b.hp, b.layer):
            return q, k
        return b.build_rope(q), b.build_rope(k)

    def block_output(self, b: GraphBuilder, h: Node) -> Node:
        """An attention or FFN block's output, as it joins the residual stream."""
        return h

    def finish_output(self, b: GraphBuilder) -> None:
        """After the head (``b.graph.outputs`` is set): a family's last touch on the logits."""
