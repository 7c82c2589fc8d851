"""The ``llama`` architecture (Llama 1/2/3, Mistral, SmolLM, TinyLlama... anything converted as ``llama``).

Graph, per layer (llama.cpp's ``llm_build_llama``)::

    x  = x + attn_output(attention(rope(q), rope(k), v))      with q, k, v from rms_norm(x) * attn_norm
    x  = x + ffn_down(silu(ffn_gate(h)) * ffn_up(h))          with h = rms_norm(x) * ffn_norm

then ``output(rms_norm(x) * output_norm)``; the head is tied to ``token_embd`` when ``output.weight`` is absent.
Biases (``attn_q.bias``...) are used when present. RoPE is NORM mode; scaling ``linear`` (freq_scale),
``yarn`` (ext_factor / mscale / corr dims) and ``llama3`` (per-dimension frequency factors from
``rope_freqs.weight`` or, when absent, computed from ``rope.scaling.*`` keys) are supported.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from llmfw.sdk import (Architecture, GraphBuilder, HParams, MetadataView, ModelError, RopeType, TensorSpec,
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

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        if keys.get_int("{arch}.expert_count", 0) > 0:
            raise ModelError(f"{keys.arch}: mixture-of-experts llama models (expert_count > 0) are not supported")
        extra: dict[str, Any] = {}
        if common["rope_scaling_type"] == "llama3":
            # the factor scales frequencies through rope_freqs, not through freq_scale
            extra["rope_freq_scale_train"] = 1.0
            extra["rope_freq_scale_train_swa"] = 1.0
        return extra

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        n_embd, n_ff = hp.n_embd, hp.n_ff(il)
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
            t("ffn_gate.weight", (n_embd, n_ff)),
            t("ffn_down.weight", (n_ff, n_embd)),
            t("ffn_up.weight", (n_embd, n_ff)),
            t("ffn_gate.bias", (n_ff,), "add", True),
            t("ffn_down.bias", (n_embd,), "add", True),
            t("ffn_up.bias", (n_ff,), "add", True),
        ]
        # one rope_freqs tensor in the file serves every layer; each layer gets its own handle so that layers
        # on different backends each hold a copy (llama.cpp's TENSOR_DUPLICATED)
        generate = llama3_rope_factors if hp.rope_scaling_type == "llama3" else None
        specs.append(t("rope_freqs.weight", (hp.n_rot // 2,), "rope", True, duplicate_of="rope_freqs.weight",
                       generate=generate))
        return specs

    def rope_freq_factors(self, hp: HParams, il: int) -> str | None:
        return f"blk.{il}.rope_freqs.weight"

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            residual = x
            h = b.build_norm(x, f"blk.{il}.attn_norm.weight")
            q, k, v = b.build_qkv(h)
            q, k = b.build_rope(q), b.build_rope(k)
            h = b.build_attn(q, k, v)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
            h = b.build_norm(x, f"blk.{il}.ffn_norm.weight")
            x = b.op("add", b.build_ffn(h, act="silu"), x)
        b.build_output(x)
