"""The ``gemma2`` architecture (Gemma 2: 2B, 9B, 27B), as llama.cpp's ``llm_build_gemma2_iswa``.

Per layer::

    h = attn_output(attention(rope(q) * scale, rope(k), v))        with q, k, v from rms_norm(x) * attn_norm
        attention scores soft-capped: cap * tanh(scores / cap)          (attn_logit_softcapping)
    x = x + rms_norm(h) * post_attention_norm
    h = ffn_down(gelu(ffn_gate(h)) * ffn_up(h))                     with h = rms_norm(x) * ffn_norm
    x = x + rms_norm(h) * post_ffw_norm

then ``softcap(output(rms_norm(x) * output_norm))`` with ``final_logit_softcapping``. The embeddings are scaled
by ``sqrt(n_embd)``; the head is tied to ``token_embd`` (converted files have no ``output.weight``); NEOX rope.

Queries are scaled as llama.cpp does: ``1/sqrt(head_dim)``, except for the 27B model (46 layers), which
uses ``1/sqrt(n_embd / n_head)`` (gemma_pytorch's query_pre_attn_scalar).

Sliding window: even layers (``il % 2 == 0``, llama.cpp's ``set_swa_pattern(2)``, or
``attention.sliding_window_pattern``) attend only to the last ``attention.sliding_window`` positions (4096 by
default) and keep their own small KV cache (memory module ``kv_cache_iswa``); odd layers see the whole context.
"""
from __future__ import annotations

import math
from typing import Any

from llmfw.sdk import Architecture, GraphBuilder, HParams, MetadataView, ModelError, TensorSpec
from llmfw.plugins.architectures.gemma3 import gemma_layer_tensors, gemma_post_attention, swa_layer_pattern

#: llama.cpp's defaults for Gemma 2
DEFAULT_SWA = 4096
DEFAULT_SWA_PATTERN = 2
N_LAYER_27B = 46


def _swa_layers(keys: MetadataView, n_layer: int) -> list[bool]:
    """``sliding_window_pattern`` as an array of per-layer flags, a period, or llama.cpp's default period 2."""
    pattern = keys.get("{arch}.attention.sliding_window_pattern", default=None)
    if pattern is None:
        return swa_layer_pattern(n_layer, DEFAULT_SWA_PATTERN)
    if isinstance(pattern, (list, tuple)) or hasattr(pattern, "shape"):
        flags = [bool(v) for v in list(pattern)]
        if len(flags) != n_layer:
            raise ModelError(f"{keys.expand('{arch}.attention.sliding_window_pattern')} has {len(flags)} entries, "
                             f"expected block_count = {n_layer}")
        return flags
    return swa_layer_pattern(n_layer, keys.as_int("{arch}.attention.sliding_window_pattern", pattern))


class Gemma2Architecture(Architecture):
    name = "gemma2"
    rope_type = "neox"
    memory = "kv_cache_iswa"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required: ModelError names it when absent
        n_layer = common["n_layer"]
        if n_layer == N_LAYER_27B:
            scale = 1.0 / math.sqrt(common["n_embd"] // common["n_head_arr"][0])
        else:
            scale = 1.0 / math.sqrt(common["n_embd_head_k"])
        return {
            "n_swa": keys.get_int("{arch}.attention.sliding_window", DEFAULT_SWA),
            "swa_type": "standard",
            "swa_layers": _swa_layers(keys, n_layer),
            "f_attention_scale": scale,
        }

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if hp.f_final_logit_softcapping <= 0 or hp.f_attn_logit_softcapping <= 0:
            raise ModelError("gemma2: attn_logit_softcapping and final_logit_softcapping must be > 0, found "
                             f"{hp.f_attn_logit_softcapping} and {hp.f_final_logit_softcapping}")

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        return gemma_layer_tensors(hp, il, qk_norm=False)

    def build_graph(self, b: GraphBuilder) -> None:
        hp = b.hp
        x = b.op("scale", b.build_inp_embd(), s=math.sqrt(hp.n_embd), name="inp_scaled")
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            q, k, v = b.build_qkv(b.build_norm(x, f"{p}.attn_norm.weight"))
            q, k = b.build_rope(q), b.build_rope(k)
            # llama.cpp scales q, then soft-caps the scores and attends with scale 1: the same numbers
            h = b.build_attn(q, k, v, kq_scale=hp.f_attention_scale, softcap=hp.f_attn_logit_softcapping)
            x = gemma_post_attention(b, il, h, residual)
        b.build_output(x)
