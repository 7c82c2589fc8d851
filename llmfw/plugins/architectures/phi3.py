"""The ``phi3`` architecture (Phi-3 / Phi-3.5 mini and medium, Phi-4), as llama.cpp's ``llm_build_phi3``.

Per layer::

    q, k, v = split(attn_qkv(h))                          with h = rms_norm(x) * attn_norm  (fused Q/K/V rows)
    x       = x + attn_output(attention(rope(q), rope(k), v))            NEOX rope, LongRoPE factors
    x       = x + ffn_down(silu(g) * u)    with [g | u] = ffn_up(rms_norm(x) * ffn_norm)   (fused gate/up)

LongRoPE: files of the 128k models carry ``rope_factors_long`` and ``rope_factors_short`` (per-dimension
frequency divisors) and ``rope.scaling.attn_factor`` (the cos/sin magnitude). Like llama.cpp, the long
factors apply when the context per sequence exceeds ``rope.scaling.original_context_length``, else the short
ones.

Sliding window: Phi-3 files may carry ``attention.sliding_window``, but llama.cpp turns the window off for this
architecture (its loader warns "Phi SWA is currently disabled", ggml-org/llama.cpp#13676) and attends to the
whole context; so do we, to stay identical to llama.cpp.
"""
from __future__ import annotations

from typing import Any

from llmfw.sdk import Architecture, GraphBuilder, HParams, MetadataView, TensorSpec, attention_qkv_tensors

ROPE_FACTORS = ("rope_factors_long", "rope_factors_short")


class Phi3Architecture(Architecture):
    name = "phi3"
    rope_type = "neox"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required: ModelError names it when absent
        return {"n_swa": 0, "swa_type": "none", "swa_layers": []}  # llama.cpp disables Phi's window

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        n_embd, n_ff = hp.n_embd, hp.n_ff(il)
        n_q = hp.n_embd_head_k * hp.n_head(il)

        def t(name: str, ne: tuple[int, ...], usage: str = "mul_mat", **kw: Any) -> TensorSpec:
            return TensorSpec(f"blk.{il}.{name}", ne, il, usage=usage, **kw)

        specs = [
            t("attn_norm.weight", (n_embd,), "mul"),
            # fused in every converted Phi-3; separate Q/K/V are accepted like llama.cpp's create_tensor_qkv
            *attention_qkv_tensors(hp, il),
            t("attn_output.weight", (n_q, n_embd)),
            t("ffn_norm.weight", (n_embd,), "mul"),
            t("ffn_up.weight", (n_embd, 2 * n_ff)),
            t("ffn_down.weight", (n_ff, n_embd)),
        ]
        # one tensor of each kind in the file serves every layer (llama.cpp's TENSOR_DUPLICATED); Phi-3-mini-4k
        # files have none (TENSOR_NOT_REQUIRED): rope then runs unscaled
        specs += [t(f"{f}.weight", (hp.n_rot // 2,), "rope", optional=True, duplicate_of=f"{f}.weight")
                  for f in ROPE_FACTORS]
        return specs

    def rope_factors_for(self, b: GraphBuilder, il: int) -> str | None:
        """llama.cpp's ``get_rope_factors``: long factors past the original context, else short ones."""
        long_ctx = b.params.n_ctx_seq > (b.hp.n_ctx_orig_yarn or b.hp.n_ctx_train)
        name = f"blk.{il}.{ROPE_FACTORS[0] if long_ctx else ROPE_FACTORS[1]}.weight"
        return name if b.has_weight(name) else None

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            p = f"blk.{il}"
            residual = x
            q, k, v = b.build_qkv(b.build_norm(x, f"{p}.attn_norm.weight"))
            q, k = b.build_rope(q), b.build_rope(k)
            h = b.build_attn(q, k, v)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
            x = b.op("add", b.build_ffn(b.build_norm(x, f"{p}.ffn_norm.weight"), act="silu", gate_in_up=True), x)
        b.build_output(x)
