"""The ``gemma3`` architecture (Gemma 3 text models: 270M, 1B, 4B, 12B, 27B), as llama.cpp's ``llm_build_gemma3``.

Graph, per layer::

    h = attn_output(attention(rope(rms_norm(q) * attn_q_norm), rope(rms_norm(k) * attn_k_norm), v))
    x = x + rms_norm(h) * post_attention_norm                   with q, k, v from rms_norm(x) * attn_norm
    h = ffn_down(gelu(ffn_gate(h)) * ffn_up(h))                 with h = rms_norm(x) * ffn_norm
    x = x + rms_norm(h) * post_ffw_norm

The token embeddings are scaled by ``sqrt(n_embd)`` (not embeddings handed in by the caller); the head is tied
to ``token_embd``; the head size comes from ``attention.key_length`` (256 for every size, whatever
``n_embd / n_head`` is). Gemma's RMSNorm multiplies by ``1 + w``: the HF → GGUF converter already stored ``1 + w``,
so the norms are plain ``rms_norm(x) * w`` here.

Sliding window: with ``attention.sliding_window`` set, five of every six layers (``il % 6 < 5``) are *local*:
they attend only to the last ``n_swa`` positions and use RoPE base 10000; every sixth layer is *global*
(whole context, ``rope.freq_base``). Their KV caches are separate (memory module ``kv_cache_iswa``, llama.cpp's
``llama_kv_cache_iswa``), so the local layers only keep about a window of cells. Without the key every layer is
global and the final logits are soft-capped when ``final_logit_softcapping`` is set (llama.cpp's non-iSWA
variant).
"""
from __future__ import annotations

import math
from typing import Any

from llmfw.sdk import (Architecture, GraphBuilder, HParams, MetadataView, ModelError, Node, TensorSpec,
                       attention_qkv_tensors)

#: every SWA_PATTERN-th layer is global (llama.cpp's ``hparams.set_swa_pattern(6)``)
SWA_PATTERN = 6
#: RoPE base of the local (sliding-window) layers, fixed by llama.cpp for Gemma 3
ROPE_FREQ_BASE_SWA = 10000.0
#: Gemma 3 27B scales queries by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim) (gemma_pytorch config)
N_LAYER_27B = 62


def swa_layer_pattern(n_layer: int, n_pattern: int) -> list[bool]:
    """llama.cpp's ``set_swa_pattern``: layer ``il`` is sliding-window unless it is the last of its group."""
    return [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer)]


class Gemma3Architecture(Architecture):
    name = "gemma3"
    rope_type = "neox"
    memory = "kv_cache_iswa"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required (ModelError names it when absent)
        n_layer = common["n_layer"]
        extra: dict[str, Any] = {}
        if common["n_swa"] > 0:
            extra.update(swa_type="standard", swa_layers=swa_layer_pattern(n_layer, SWA_PATTERN),
                         rope_freq_base_train_swa=ROPE_FREQ_BASE_SWA, rope_freq_scale_train_swa=1.0)
            # the iSWA graph has no final soft-capping, whatever the file says
            extra["f_final_logit_softcapping"] = 0.0
        else:
            extra.update(n_swa=0, swa_type="none", swa_layers=[])
        # query scale (gemma_pytorch's query_pre_attn_scalar); a malformed size of 0 is left to the validation
        scaled_dim = (common["n_embd"] // max(common["n_head_arr"][0], 1) if n_layer == N_LAYER_27B
                      else common["n_embd_head_k"])
        extra["f_attention_scale"] = 1.0 / math.sqrt(scaled_dim) if scaled_dim > 0 else 0.0
        # Gemma 3 has no attention-logit soft-capping (Gemma 2 has)
        extra["f_attn_logit_softcapping"] = 0.0
        return extra

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if any(h <= 0 for h in hp.n_head_kv_arr):
            raise ModelError(f"gemma3: every layer needs KV heads, found head_count_kv {hp.n_head_kv_arr}")

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        return gemma_layer_tensors(hp, il, qk_norm=True)

    def build_graph(self, b: GraphBuilder) -> None:
        hp = b.hp
        x = b.build_inp_embd()
        if not b.params.use_embd:
            # only token embeddings are scaled; embeddings handed in (e.g. encoded images) are used as they are
            x = b.op("scale", x, s=math.sqrt(hp.n_embd), name="inp_scaled")
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            h = b.build_norm(x, f"{p}.attn_norm.weight")
            q, k, v = b.build_qkv(h)
            q = b.build_rope(b.build_norm(q, f"{p}.attn_q_norm.weight"))
            k = b.build_rope(b.build_norm(k, f"{p}.attn_k_norm.weight"))
            # llama.cpp scales q by f_attention_scale and attends with scale 1: the same product
            h = b.build_attn(q, k, v, kq_scale=hp.f_attention_scale, softcap=0.0)
            x = gemma_post_attention(b, il, h, residual)
        b.build_output(x)


def gemma_layer_tensors(hp: HParams, il: int, *, qk_norm: bool) -> list[TensorSpec]:
    """One Gemma layer: pre- and post-norms around attention and the gated FFN (Gemma 2 and 3);
    Gemma 3 adds per-head q/k RMS norms."""
    n_embd, n_ff, head_dim = hp.n_embd, hp.n_ff(il), hp.n_embd_head_k
    n_q = head_dim * hp.n_head(il)

    def t(name: str, ne: tuple[int, ...], usage: str = "mul_mat") -> TensorSpec:
        return TensorSpec(f"blk.{il}.{name}", ne, il, usage=usage)

    qk_norms = [t("attn_q_norm.weight", (head_dim,), "mul"), t("attn_k_norm.weight", (head_dim,), "mul")]
    return [
        t("attn_norm.weight", (n_embd,), "mul"),
        *attention_qkv_tensors(hp, il),
        *(qk_norms if qk_norm else []),
        t("attn_output.weight", (n_q, n_embd)),
        t("post_attention_norm.weight", (n_embd,), "mul"),
        t("ffn_norm.weight", (n_embd,), "mul"),
        t("ffn_gate.weight", (n_embd, n_ff)),
        t("ffn_up.weight", (n_embd, n_ff)),
        t("ffn_down.weight", (n_ff, n_embd)),
        t("post_ffw_norm.weight", (n_embd,), "mul"),
    ]


def gemma_post_attention(b: GraphBuilder, il: int, h: Node, residual: Node) -> Node:
    """The rest of a Gemma layer after attention (Gemma 2 and 3): post-attention norm and residual, then the
    normed GELU FFN with its post-norm and residual; the last layer keeps only the output rows first."""
    p = f"blk.{il}"
    if il == b.hp.n_layer - 1:
        h, residual = b.select_outputs(h, residual)
    x = b.op("add", b.build_norm(h, f"{p}.post_attention_norm.weight"), residual)
    h = b.build_ffn(b.build_norm(x, f"{p}.ffn_norm.weight"), act="gelu")
    return b.op("add", b.build_norm(h, f"{p}.post_ffw_norm.weight"), x)
