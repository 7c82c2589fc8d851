"""The ``gemma4`` architecture (Gemma 4 text models: E2B, E4B, 31B), as llama.cpp's ``llama_model_gemma4``.

Graph, per layer (``h = rms_norm(x) * attn_norm``)::

    q = rope(rms_norm(attn_q(h)) * attn_q_norm)                 per head
    k = rope(rms_norm(attn_k(h)) * attn_k_norm);  v = rms_norm(attn_v(h))   (no weight; v = attn_k(h) without attn_v)
    x = x + rms_norm(attn_output(attention(q, k, v))) * post_attention_norm        scale 1 (the q/k norms set it)
    x = x + rms_norm(ffn_down(gelu(ffn_gate(h2)) * ffn_up(h2))) * post_ffw_norm    h2 = rms_norm(x) * ffn_norm
    per-layer input (files with ``embedding_length_per_layer_input`` > 0):
        x = x + rms_norm(proj(gelu(inp_gate(x)) * ple[il])) * post_norm
    x = x * layer_output_scale                                  when the file has it

then ``softcap(output(rms_norm(x) * output_norm))`` with ``final_logit_softcapping``; the token embeddings are
scaled by ``sqrt(n_embd)``. The per-layer inputs of a token are its row of ``per_layer_token_embd`` (× sqrt of
their width) plus a projection of the scaled embedding (``per_layer_model_proj`` / sqrt(n_embd), RMS-normed with
``per_layer_proj_norm``), the sum × 1/sqrt(2), one slice per layer.

Layers: ``attention.sliding_window_pattern`` marks the sliding-window layers, which have their own head size
(``attention.key_length_swa``), rotary width (``rope.dimension_count_swa``) and base (``rope.freq_base_swa``);
the global layers divide their rotary frequencies by ``rope_freqs`` (proportional rope). The last
``attention.shared_kv_layers`` layers compute no keys or values: they attend to the cache of the last layer of
their kind before them (llama.cpp's layer reuse), so they have no cache of their own. Memory: the iSWA KV cache.

Not supported (refused at load): the mixture-of-experts variant (26B-A4B, ``expert_count`` > 0: a router on its
own normed input, GELU experts with per-expert output scales) and the ``gemma4-assistant`` MTP drafter.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from llmfw.core.arch.architecture import (INPUT_LAYER, Architecture, RopeParams, TensorSpec,
                                          default_rope_params, layer_tensor)
from llmfw.core.errors import ModelError, UnsupportedVariant
from llmfw.core.format.metadata import MetadataView
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams


class Gemma4HParams(HParams):
    n_embd_head_k_swa: int = 0
    n_embd_head_v_swa: int = 0
    n_rot_swa: int = 0
    #: width of each layer's per-layer input (0: the file has none)
    n_embd_per_layer: int = 0
    #: layers from this index on reuse an earlier layer's KV cache
    n_layer_kv_from_start: int = 0

    def head_dim_k(self, il: int = 0) -> int:
        return self.n_embd_head_k_swa if self.is_swa(il) else self.n_embd_head_k

    def head_dim_v(self, il: int = 0) -> int:
        return self.n_embd_head_v_swa if self.is_swa(il) else self.n_embd_head_v

    def kv_source(self, il: int) -> int:
        """The layer whose KV cache layer ``il`` attends to: itself, or for a shared layer the last layer of its
        kind that has a cache (llama.cpp's reuse rule: the last cached layer is global, the one before it local)."""
        if il < self.n_layer_kv_from_start:
            return il
        return self.n_layer_kv_from_start - (2 if self.is_swa(il) else 1)


def _hp(hp: HParams) -> Gemma4HParams:
    if not isinstance(hp, Gemma4HParams):
        raise ModelError(f"{hp.arch}: not Gemma 4 hyperparameters")
    return hp


class Gemma4Architecture(Architecture):
    name = "gemma4"
    hparams_class: ClassVar[type[HParams]] = Gemma4HParams
    rope_type = "neox"
    memory = "kv_cache_iswa"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        if keys.get_int("{arch}.expert_count", 0) > 0:
            raise UnsupportedVariant(f"{keys.arch}: the mixture-of-experts Gemma 4 (expert_count > 0) is not supported: its "
                             "router reads its own normed input and its experts carry per-expert output scales")
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required: ModelError names it when absent
        n_layer = common["n_layer"]
        pattern = [bool(v) for v in list(keys.get("{arch}.attention.sliding_window_pattern"))]
        if len(pattern) != n_layer:
            raise ModelError(f"{keys.arch}: attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{n_layer} layers")
        shared = keys.get_int("{arch}.attention.shared_kv_layers", 0)
        return {
            "n_swa": keys.get_int("{arch}.attention.sliding_window"), "swa_type": "standard", "swa_layers": pattern,
            "n_embd_head_k_swa": keys.get_int("{arch}.attention.key_length_swa"),
            "n_embd_head_v_swa": keys.get_int("{arch}.attention.value_length_swa"),
            "n_rot_swa": keys.get_int("{arch}.rope.dimension_count_swa", common["n_rot"]),
            "n_embd_per_layer": keys.get_int("{arch}.embedding_length_per_layer_input"),
            "n_layer_kv_from_start": n_layer - shared,
            "f_attention_scale": 1.0, "f_attn_logit_softcapping": 0.0,
        }

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        g = _hp(hp)
        if g.n_embd_head_k_swa != g.n_embd_head_v_swa or g.n_embd_head_k_swa <= 0:
            raise ModelError(f"{hp.arch}: key_length_swa {g.n_embd_head_k_swa} must equal value_length_swa "
                             f"{g.n_embd_head_v_swa} and be positive")
        if not 0 < g.n_rot_swa <= g.n_embd_head_k_swa:
            raise ModelError(f"{hp.arch}: rope.dimension_count_swa {g.n_rot_swa} does not fit the head size")
        first_shared = g.n_layer_kv_from_start
        if first_shared < hp.n_layer:
            if first_shared < 2 or g.is_swa(first_shared - 1) or not g.is_swa(first_shared - 2):
                raise ModelError(f"{hp.arch}: with shared_kv_layers the last two layers that keep a cache "
                                 f"({first_shared - 2}, {first_shared - 1}) must be a sliding-window then a global "
                                 "one: the shared layers reuse their caches")
        for il in range(hp.n_layer):
            if g.kv_source(il) == il and hp.n_head_kv(il) <= 0:
                raise ModelError(f"{hp.arch}: layer {il} keeps a KV cache but has no KV heads")

    def has_kv(self, hp: HParams, il: int) -> bool:
        return _hp(hp).kv_source(il) == il

    def rope_params(self, hp: HParams, il: int) -> RopeParams:
        params = default_rope_params(hp, self.rope_type, swa=hp.is_swa(il))
        return dataclasses.replace(params, n_dims=_hp(hp).n_rot_swa) if hp.is_swa(il) else params

    def rope_freq_factors(self, hp: HParams, il: int) -> str | None:
        return None if hp.is_swa(il) else f"blk.{il}.rope_freqs.weight"

    # -- tensors -------------------------------------------------------------------------------------------
    def tensors(self, hp: HParams) -> list[TensorSpec]:
        g, specs = _hp(hp), super().tensors(hp)
        width = g.n_embd_per_layer * hp.n_layer
        if g.n_embd_per_layer:
            specs += [TensorSpec("per_layer_token_embd.weight", (width, hp.n_vocab), INPUT_LAYER, usage="get_rows"),
                      TensorSpec("per_layer_model_proj.weight", (hp.n_embd, width), INPUT_LAYER),
                      TensorSpec("per_layer_proj_norm.weight", (g.n_embd_per_layer,), INPUT_LAYER, usage="mul")]
        return specs

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        g, n_embd, n_ff = _hp(hp), hp.n_embd, hp.n_ff(il)
        head, n_q = g.head_dim_k(il), g.head_dim_k(il) * hp.n_head(il)
        cached = g.kv_source(il) == il

        def opt(name: str, ne: tuple[int, ...], usage: str = "mul_mat", optional: bool = True) -> TensorSpec:
            return TensorSpec(f"blk.{il}.{name}", ne, il, optional=optional, usage=usage)

        specs = [layer_tensor(il, "attn_norm.weight", (n_embd,), "mul"),
                 layer_tensor(il, "attn_q.weight", (n_embd, n_q)),
                 opt("attn_k.weight", (n_embd, g.n_embd_k_gqa(il)), optional=not cached),
                 opt("attn_v.weight", (n_embd, g.n_embd_v_gqa(il))),
                 layer_tensor(il, "attn_output.weight", (n_q, n_embd)),
                 layer_tensor(il, "attn_q_norm.weight", (head,), "mul"),
                 opt("attn_k_norm.weight", (head,), "mul", optional=not cached),
                 layer_tensor(il, "post_attention_norm.weight", (n_embd,), "mul"),
                 opt("layer_output_scale.weight", (1,), "mul"),
                 layer_tensor(il, "ffn_norm.weight", (n_embd,), "mul"),
                 layer_tensor(il, "ffn_gate.weight", (n_embd, n_ff)),
                 layer_tensor(il, "ffn_up.weight", (n_embd, n_ff)),
                 layer_tensor(il, "ffn_down.weight", (n_ff, n_embd)),
                 layer_tensor(il, "post_ffw_norm.weight", (n_embd,), "mul")]
        if not hp.is_swa(il):  # one rope_freqs tensor serves every global layer
            specs.append(TensorSpec(f"blk.{il}.rope_freqs.weight", (head // 2,), il, usage="rope",
                                    duplicate_of="rope_freqs.weight"))
        if g.n_embd_per_layer:
            specs += [layer_tensor(il, "inp_gate.weight", (n_embd, g.n_embd_per_layer)),
                      layer_tensor(il, "proj.weight", (g.n_embd_per_layer, n_embd)),
                      layer_tensor(il, "post_norm.weight", (n_embd,), "mul")]
        return specs

    # -- graph ---------------------------------------------------------------------------------------------
    def build_graph(self, b: GraphBuilder) -> None:
        g = _hp(b.hp)
        x = b.build_inp_embd()
        if not b.params.use_embd:  # embeddings handed in (encoded images) are used as they are
            x = b.op("scale", x, s=math.sqrt(g.n_embd))
        per_layer = self._per_layer_inputs(b, x) if g.n_embd_per_layer else None
        kv: dict[int, tuple[Node, Node]] = {}  # layer -> its keys and values, for the layers sharing its cache
        for il in b.layers():
            p = f"blk.{il}"
            h = b.build_norm(x, f"{p}.attn_norm.weight")
            out = self._attention(b, h, il, kv)
            x = b.op("add", b.build_norm(out, f"{p}.post_attention_norm.weight"), x)
            ffn = b.build_ffn(b.build_norm(x, f"{p}.ffn_norm.weight"), act="gelu")
            x = b.op("add", b.build_norm(ffn, f"{p}.post_ffw_norm.weight"), x)
            if per_layer is not None:
                x = b.op("add", x, self._per_layer_block(b, x, per_layer, il))
            if b.has_weight(f"{p}.layer_output_scale.weight"):
                x = b.op("mul", x, b.weight(f"{p}.layer_output_scale.weight"))
        b.build_output(x, softcap=g.f_final_logit_softcapping)

    @staticmethod
    def _attention(b: GraphBuilder, h: Node, il: int, kv: dict[int, tuple[Node, Node]]) -> Node:
        g, p = _hp(b.hp), f"blk.{il}"
        head = g.head_dim_k(il)
        q = b.op("reshape", b.mul_mat(f"{p}.attn_q.weight", h), shape=(-1, g.n_head(il), head))
        q = b.build_rope(b.build_norm(q, f"{p}.attn_q_norm.weight"))
        source = g.kv_source(il)
        if source == il:
            k_raw = b.mul_mat(f"{p}.attn_k.weight", h)
            v_raw = b.mul_mat(f"{p}.attn_v.weight", h) if b.has_weight(f"{p}.attn_v.weight") else k_raw
            k = b.op("reshape", k_raw, shape=(-1, g.n_head_kv(il), head))
            v = b.op("reshape", v_raw, shape=(-1, g.n_head_kv(il), head))
            kv[il] = (b.build_rope(b.build_norm(k, f"{p}.attn_k_norm.weight")), b.build_norm(v, None))
        # a shared layer hands the source layer's own keys and values to its cache again (the same rows, written
        # once more) and attends over that cache: llama.cpp's attention without K/V over a reused cache
        k, v = kv[source]
        return b.build_attn(q, k, v, source, out_weight=f"{p}.attn_output.weight", kq_scale=g.f_attention_scale,
                            softcap=0.0)

    @staticmethod
    def _per_layer_inputs(b: GraphBuilder, x: Node) -> Node:
        """[T, n_layer, n_embd_per_layer]: the token's per-layer embeddings plus the projected embedding."""
        g = _hp(b.hp)
        n_pl, shape = g.n_embd_per_layer, (-1, g.n_layer, g.n_embd_per_layer)
        if b.params.use_embd:
            raise ModelError("gemma4: per-layer inputs need token ids, not embeddings handed in")
        rows = b.op("get_rows", b.weight("per_layer_token_embd.weight"), b.input("tokens"))
        rows = b.op("scale", b.op("reshape", rows, shape=shape), s=math.sqrt(n_pl))
        proj = b.op("scale", b.mul_mat("per_layer_model_proj.weight", x), s=1.0 / math.sqrt(g.n_embd))
        proj = b.build_norm(b.op("reshape", proj, shape=shape), "per_layer_proj_norm.weight")
        return b.op("scale", b.op("add", proj, rows), s=1.0 / math.sqrt(2.0))

    @staticmethod
    def _per_layer_block(b: GraphBuilder, x: Node, per_layer: Node, il: int) -> Node:
        g, p = _hp(b.hp), f"blk.{il}"
        mine = b.op("reshape", b.op("slice", per_layer, axis=1, start=il, stop=il + 1), shape=(-1, g.n_embd_per_layer))
        gated = b.op("mul", b.op("gelu", b.mul_mat(f"{p}.inp_gate.weight", x)), mine)
        return b.build_norm(b.mul_mat(f"{p}.proj.weight", gated), f"{p}.post_norm.weight")
