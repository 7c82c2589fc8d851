"""The ``deepseek2`` architecture (DeepSeek-V2/V3/R1 and their derivatives), as llama.cpp's
``llm_build_deepseek2`` with multi-head latent attention in its absorbed form (the files llama.cpp's converter
writes today: ``attn_k_b`` / ``attn_v_b``, ``attention.key_length_mla``)::

    q          = attn_q_b(rms_norm(attn_q_a(h)) * attn_q_a_norm)  or attn_q(h)      [T, H, nope + rope]
    kv, k_pe   = attn_kv_a_mqa(h)                                  [T, kv_lora], [T, rope]
    kv         = rms_norm(kv) * attn_kv_a_norm
    Q          = [rope(q_pe), attn_k_b[h] · q_nope]               per head: [T, H, rope + kv_lora]
    K, V       = [rope(k_pe), kv], kv                             one KV head: the cache holds the latent
    x          = x + attn_output(attn_v_b[h] · attention(Q, K, V))  (scale mscale² / sqrt(nope + rope))
    x          = x + ffn(h) | moe(h) + shared_experts(h)            with h = rms_norm(x) * ffn_norm

The file's ``key_length`` / ``value_length`` / ``head_count_kv`` are the cache's (kv_lora + rope, kv_lora, 1):
the rope part comes first in Q and K so that llama.cpp's K-shift (which rotates a cached row's first dims)
applies. Routing as glm4moe (llama.cpp's ``build_moe_ffn``: gating by ``expert_gating_func``, softmax when
absent; selection bias, grouped routing, normalisation and scale from the file), the first
``leading_dense_block_count`` layers dense, the experts' gate and up optionally fused (``ffn_gate_up_exps``).

YaRN (DeepSeek V2/V3 files scale their rope by 40 from a 4k original context) follows llama.cpp's bookkeeping:
the file's ``rope.scaling.yarn_log_multiplier`` is 0.1 · ``mscale_all_dim`` (the converter's factor, taken back
out); with it set, the context's rope magnitude is ``attn_factor / (1 + 0.1 ln f)`` (DeepSeek's ``mscale`` equals
``mscale_all_dim``, so their ratio is 1, and ggml's own ``1 + 0.1 ln f`` is cancelled), and the attention scale
is ``mscale² / sqrt(nope + rope)`` with ``mscale = attn_factor · (1 + 0.1 · mscale_all_dim · ln f)`` (f = the
scaling factor). Not supported: the legacy unsplit ``attn_kv_b`` files, refused at load with a clear error.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from llmfw.core.arch.architecture import Architecture, RopeParams, TensorSpec
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.ir.rope import yarn_magnitude
from llmfw.core.format.metadata import MetadataView
from llmfw.core.arch.moe import (MoeHParams, build_layer_ffn, expert_tensors, mtp_trunk, read_moe_hparams,
                            shared_expert_tensors)


class Deepseek2HParams(MoeHParams):
    n_lora_q: int = 0
    n_lora_kv: int = 0
    #: the per-head query/key size (nope + rope) and value size of the decompressed attention
    n_embd_head_k_mla: int = 0
    n_embd_head_v_mla: int = 0
    #: YaRN's ``mscale_all_dim`` (the file's ``rope.scaling.yarn_log_multiplier`` / 0.1; 0: none)
    rope_yarn_log_mul: float = 0.0


class Deepseek2Architecture(Architecture):
    name = "deepseek2"
    rope_type = "norm"
    hparams_class = Deepseek2HParams

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        if keys.get_int("{arch}.attention.key_length_mla", 0) <= 0:
            raise ModelError("deepseek2: only files with multi-head latent attention in absorbed form "
                             "(attention.key_length_mla, attn_k_b / attn_v_b) are supported; reconvert this file")
        extra = read_moe_hparams(keys, default_gating="softmax")
        # the converter writes 0.1 * mscale_all_dim; llama.cpp divides the factor back out
        extra["rope_yarn_log_mul"] = keys.get_float("{arch}.rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        extra["n_expert_shared"] = keys.get_int("{arch}.expert_shared_count")
        return {**extra, **mtp_trunk(keys, common), "n_lora_q": keys.get_int("{arch}.attention.q_lora_rank", 0),
                "n_lora_kv": keys.get_int("{arch}.attention.kv_lora_rank"),
                "n_embd_head_k_mla": keys.get_int("{arch}.attention.key_length_mla"),
                "n_embd_head_v_mla": keys.get_int("{arch}.attention.value_length_mla")}

    def check_hparams(self, hp: HParams) -> None:
        # the cache's key (rope + latent) and value (latent) sizes differ by design: no k == v check
        assert isinstance(hp, Deepseek2HParams)
        if hp.f_norm_rms_eps <= 0:
            raise ModelError(f"deepseek2: attention.layer_norm_rms_epsilon must be > 0, found {hp.f_norm_rms_eps}")
        if (hp.n_embd_head_k, hp.n_embd_head_v) != (hp.n_lora_kv + hp.n_rot, hp.n_lora_kv) or \
                any(n != 1 for n in hp.n_head_kv_arr) or not 0 < hp.n_rot < hp.n_embd_head_k_mla:
            raise ModelError(f"deepseek2: key/value length {hp.n_embd_head_k}/{hp.n_embd_head_v} and head_count_kv "
                             f"must be kv_lora_rank + rope ({hp.n_lora_kv} + {hp.n_rot}), kv_lora_rank and 1")
        if not hp.n_expert:
            raise ModelError("deepseek2: expert_count must be > 1")

    def rope_params(self, hp: HParams, il: int) -> RopeParams:
        """With YaRN and a log multiplier, the rope magnitude cancels ggml's ``1 + 0.1 ln f`` (llama.cpp's
        context set-up for deepseek2, where mscale equals mscale_all_dim)."""
        params = super().rope_params(hp, il)
        if params.ext_factor and params.freq_scale < 1.0 and isinstance(hp, Deepseek2HParams) and \
                hp.rope_yarn_log_mul:
            return replace(params, attn_factor=hp.rope_attn_factor / yarn_magnitude(params.freq_scale, 1.0))
        return params

    def kq_scale(self, hp: Deepseek2HParams) -> float:
        """``mscale² / sqrt(nope + rope)``: llama.cpp's deepseek2 graph takes the rope magnitude's cancelled
        factor back (``attn_factor · (1 + 0.1 ln(1/freq_scale))``) and applies YaRN's ``mscale_all_dim`` term."""
        params = self.rope_params(hp, 0)
        log_f = math.log(1.0 / params.freq_scale)
        mscale = params.attn_factor * (1.0 + 0.1 * log_f) * (1.0 + 0.1 * hp.rope_yarn_log_mul * log_f)
        return mscale * mscale / math.sqrt(hp.n_embd_head_k_mla)

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        assert isinstance(hp, Deepseek2HParams)
        n_embd, n_head, p = hp.n_embd, hp.n_head(il), f"blk.{il}"
        nope, q_width = hp.n_embd_head_k_mla - hp.n_rot, n_head * hp.n_embd_head_k_mla

        def t(name: str, ne: tuple[int, ...], usage: str = "mul_mat") -> TensorSpec:
            return TensorSpec(f"{p}.{name}", ne, il, usage=usage)

        specs = [t("attn_norm.weight", (n_embd,), "mul"), t("attn_kv_a_norm.weight", (hp.n_lora_kv,), "mul"),
                 t("attn_kv_a_mqa.weight", (n_embd, hp.n_lora_kv + hp.n_rot)),
                 t("attn_k_b.weight", (nope, hp.n_lora_kv, n_head), "mul_mat_heads"),
                 t("attn_v_b.weight", (hp.n_lora_kv, hp.n_embd_head_v_mla, n_head), "mul_mat_heads"),
                 t("attn_output.weight", (n_head * hp.n_embd_head_v_mla, n_embd)),
                 t("ffn_norm.weight", (n_embd,), "mul")]
        if hp.n_lora_q:
            specs += [t("attn_q_a_norm.weight", (hp.n_lora_q,), "mul"), t("attn_q_a.weight", (n_embd, hp.n_lora_q)),
                      t("attn_q_b.weight", (hp.n_lora_q, q_width))]
        else:
            specs.append(t("attn_q.weight", (n_embd, q_width)))
        if not hp.is_moe_layer(il):
            return specs + [t("ffn_gate.weight", (n_embd, hp.n_ff(il))), t("ffn_up.weight", (n_embd, hp.n_ff(il))),
                            t("ffn_down.weight", (hp.n_ff(il), n_embd))]
        specs += expert_tensors(hp, il, hp.n_ff_exp, fused_gate_up=True)
        specs.append(TensorSpec(f"{p}.exp_probs_b.bias", (hp.n_expert,), il, optional=True, usage="add"))
        return specs + shared_expert_tensors(hp, il, hp.n_ff_exp * hp.n_expert_shared)

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            h = self._attention(b, b.build_norm(x, f"{p}.attn_norm.weight"), il)
            x = b.add_residual(h, residual)
            x = b.op("add", build_layer_ffn(b, b.build_norm(x, f"{p}.ffn_norm.weight"), il), x)
        b.build_output(x)

    def _attention(self, b: GraphBuilder, h: Node, il: int) -> Node:
        """MLA in absorbed form: one KV head holding [rope(k_pe), latent], the queries absorbed into it."""
        hp = b.hp
        assert isinstance(hp, Deepseek2HParams)
        p, n_head, rope, latent = f"blk.{il}", hp.n_head(il), hp.n_rot, hp.n_lora_kv
        if hp.n_lora_q:
            q = b.build_norm(b.mul_mat(f"{p}.attn_q_a.weight", h), f"{p}.attn_q_a_norm.weight")
            q = b.mul_mat(f"{p}.attn_q_b.weight", q)
        else:
            q = b.mul_mat(f"{p}.attn_q.weight", h)
        q = b.op("reshape", q, shape=(-1, n_head, hp.n_embd_head_k_mla))
        nope = hp.n_embd_head_k_mla - rope
        q_nope = b.op("slice", q, axis=-1, start=0, stop=nope)
        q_pe = b.build_rope(b.op("slice", q, axis=-1, start=nope, stop=nope + rope))
        kv_pe = b.mul_mat(f"{p}.attn_kv_a_mqa.weight", h)
        kv = b.build_norm(b.op("slice", kv_pe, axis=-1, start=0, stop=latent), f"{p}.attn_kv_a_norm.weight")
        kv = b.op("reshape", kv, shape=(-1, 1, latent))
        k_pe = b.build_rope(b.op("reshape", b.op("slice", kv_pe, axis=-1, start=latent, stop=latent + rope),
                                 shape=(-1, 1, rope)))
        q_all = b.op("concat", q_pe, b.op("mul_mat_heads", b.weight(f"{p}.attn_k_b.weight"), q_nope))
        out = b.build_attn(q_all, b.op("concat", k_pe, kv), kv, kq_scale=self.kq_scale(hp),
                           out_weight="")
        out = b.op("mul_mat_heads", b.weight(f"{p}.attn_v_b.weight"), b.op("reshape", out, shape=(-1, n_head, latent)))
        return b.mul_mat(f"{p}.attn_output.weight", b.op("reshape", out, shape=(-1, n_head * hp.n_embd_head_v_mla)))
