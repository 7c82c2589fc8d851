"""The ``gpt-oss`` architecture (gpt-oss-20b / -120b), as llama.cpp's ``llm_build_openai_moe``::

    h = attn_output(attention(rope(q), rope(k), v; sinks)) + bias      q, k, v from rms_norm(x) * attn_norm (+ biases)
    x = x + h
    x = x + moe(rms_norm(x) * post_attention_norm)

Attention: NEOX rope (YaRN in the released files), scale ``1/sqrt(head_dim)``, one learned *sink* logit per head
(``attn_sinks.weight``) in every softmax, and a sliding window (``attention.sliding_window``) on every other layer
(even layers; ``sliding_window_pattern`` may say otherwise) with a KV cache of its own (``kv_cache_iswa``).

Experts: router with a bias, the top ``expert_used_count`` router *logits* softmaxed among themselves
(llama.cpp's softmax-after-top-k gating), no renormalisation or scale, every expert matrix with a bias, and the
clamped SwiGLU ``min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clip(u, -7, 7) + 1)``. The released experts are
MXFP4 (E2M1 values with E8M0 block exponents). The output head is its own tensor.
"""
from __future__ import annotations

from typing import Any

from llmfw.core.arch.architecture import OUTPUT_LAYER, Architecture, TensorSpec, attention_qkv_tensors
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.core.arch.moe import ROUTING_KEYS, MoeHParams, expert_tensors, read_moe_hparams
from llmfw.plugins.architectures.gemma2 import _swa_layers


class GptOssArchitecture(Architecture):
    name = "gpt-oss"
    rope_type = "neox"
    memory = "kv_cache_iswa"
    hparams_class = MoeHParams

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        moe = read_moe_hparams(keys)
        return {
            **{k: moe[k] for k in ROUTING_KEYS},
            "n_ff_exp": keys.get_int("{arch}.expert_feed_forward_length"),
            "n_swa": keys.get_int("{arch}.attention.sliding_window"),
            "swa_type": "standard",
            "swa_layers": _swa_layers(keys, common["n_layer"]),
            # the window layers rotate like the others unless the file says otherwise
            "rope_freq_base_train_swa": keys.get_float("{arch}.rope.freq_base_swa", common["rope_freq_base_train"]),
            "rope_freq_scale_train_swa": common["rope_freq_scale_train"],
        }

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if not isinstance(hp, MoeHParams) or not hp.n_expert or hp.n_ff_exp <= 0:
            raise ModelError("gpt-oss: expert_count must be > 1 and expert_feed_forward_length > 0")

    def tensors(self, hp: HParams) -> list[TensorSpec]:
        specs = super().tensors(hp)
        return [TensorSpec("output.weight", s.ne, OUTPUT_LAYER) if s.name == "output.weight" else s for s in specs]

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        assert isinstance(hp, MoeHParams)
        n_embd, n_q, p = hp.n_embd, hp.n_head(il) * hp.n_rot, f"blk.{il}"
        specs = [TensorSpec(f"{p}.attn_norm.weight", (n_embd,), il, usage="mul"),
                 TensorSpec(f"{p}.post_attention_norm.weight", (n_embd,), il, usage="mul"),
                 *attention_qkv_tensors(hp, il),
                 TensorSpec(f"{p}.attn_output.weight", (n_q, n_embd), il),
                 TensorSpec(f"{p}.attn_output.bias", (n_embd,), il, usage="add"),
                 TensorSpec(f"{p}.attn_sinks.weight", (hp.n_head(il),), il, usage="attention")]
        required_biases = {f"{p}.ffn_gate_inp.bias"} | {f"{p}.ffn_{m}_exps.bias" for m in ("gate", "up", "down")}
        for spec in expert_tensors(hp, il, hp.n_ff_exp):
            specs.append(TensorSpec(spec.name, spec.ne, il, usage=spec.usage) if spec.name in required_biases
                         else spec)
        return specs

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            q, k, v = b.build_qkv(b.build_norm(x, f"{p}.attn_norm.weight"))
            h = b.build_attn(b.build_rope(q), b.build_rope(k), v, kq_scale=b.hp.n_rot ** -0.5,
                             sinks=f"{p}.attn_sinks.weight")
            x = b.add_residual(h, residual)
            h = b.build_norm(x, f"{p}.post_attention_norm.weight")
            x = b.op("add", b.build_moe_ffn(h, il, gating="softmax_weight", act="swiglu_oai"), x)
        b.build_output(x)
