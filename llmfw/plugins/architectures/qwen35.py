"""The ``qwen35`` architecture (Qwen3.5 / Qwen3.6 dense), as llama.cpp's ``llama_model_qwen35``: three of every four
layers are Gated DeltaNet linear attention with a recurrent state, the fourth is gated full attention.

Per layer (``h = rms_norm(x) * attn_norm``)::

    attention (every full_attention_interval-th layer):
        [q | gate] per head = attn_q(h); k, v = attn_k(h), attn_v(h)
        q, k = rope(rms_norm(q) * q_norm), rope(rms_norm(k) * k_norm)       NEOX pairs on rope.dimension_count
        y = attn_output(attention(q, k, v) * sigmoid(gate))
    Gated DeltaNet (the others):
        qkv = silu(short_conv(attn_qkv(h)))        carried window of ssm.conv_kernel - 1 steps
        q, k = l2_norm(qkv[:key]), l2_norm(qkv[key:2 key]) per head; v = qkv[2 key:]
        beta = sigmoid(ssm_beta(h)); g = softplus(ssm_alpha(h) + ssm_dt.bias) * ssm_a
        o = gated_delta(state, q, k, v, g, beta)   the delta rule, state [H, Dv, Dk] per sequence
        y = ssm_out(rms_norm(o) * ssm_norm * silu(attn_gate(h)))   per head
    x = x + y
    x = x + ffn_down(silu(ffn_gate(h2)) * ffn_up(h2))   with h2 = rms_norm(x) * post_attention_norm

RoPE is llama.cpp's interleaved multi-axis rope (IMROPE, ``rope.dimension_sections``); for text every axis
carries the token's position, which makes it NEOX rope over ``rope.dimension_count`` dims as long as the
sections give every rotated pair a text axis (checked at load). Multi-token-prediction layers
(``nextn_predict_layers``) are not run. The MoE sibling ``qwen35moe`` (:mod:`.qwen35moe`) changes only the FFN.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel

from llmfw.core.arch.architecture import Architecture, TensorSpec, gated_ffn_tensors, layer_tensor
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView

#: llama.cpp's default when the file names neither the recurrent layers nor the interval
DEFAULT_FULL_ATTENTION_INTERVAL = 4


class DeltaNetDims(BaseModel):
    """The ``ssm.*`` keys as Gated DeltaNet reads them."""

    d_conv: int
    d_inner: int       # value_dim = n_v_heads * head_dim
    head_dim: int      # ssm.state_size: the key (and value) head size
    n_v_heads: int     # ssm.time_step_rank
    n_k_heads: int     # ssm.group_count

    @property
    def key_dim(self) -> int:
        return self.head_dim * self.n_k_heads

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_dim + self.d_inner


class Qwen35HParams(HParams):
    delta: DeltaNetDims | None = None
    recurrent_layers: list[bool] = []
    rope_sections: list[int] = []


def imrope_text_axes_cover(sections: list[int], n_rot: int) -> bool:
    """Whether llama.cpp's interleaved M-RoPE gives every rotated pair one of the three text axes (t, h, w), so that
    with a text token's equal positions it is plain NEOX rope (a pair on the fourth axis would stay unrotated)."""
    total = sum(sections)
    if total <= 0:
        return False
    for pair in range(n_rot // 2):
        sector = pair % total
        if not any(sector % 3 == axis and sector < 3 * sections[axis] for axis in range(3)):
            return False
    return True


def _delta(hp: HParams) -> DeltaNetDims:
    dims = getattr(hp, "delta", None)
    if not isinstance(dims, DeltaNetDims):
        raise ModelError(f"{hp.arch}: the Gated DeltaNet ssm.* hyperparameters are missing")
    return dims


def is_delta_layer(hp: HParams, il: int) -> bool:
    return bool(getattr(hp, "recurrent_layers", [])[il])


class Qwen35Architecture(Architecture):
    name = "qwen35"
    hparams_class: ClassVar[type[HParams]] = Qwen35HParams
    memory = "hybrid"
    rope_type = "neox"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        keys.get_float("{arch}.attention.layer_norm_rms_epsilon")  # required: ModelError names it when absent
        self.check_expert_count(keys)
        n_layer = common["n_layer"]
        dims = DeltaNetDims(d_conv=keys.get_int("{arch}.ssm.conv_kernel"),
                            d_inner=keys.get_int("{arch}.ssm.inner_size"),
                            head_dim=keys.get_int("{arch}.ssm.state_size"),
                            n_v_heads=keys.get_int("{arch}.ssm.time_step_rank"),
                            n_k_heads=keys.get_int("{arch}.ssm.group_count"))
        layers = keys.get("{arch}.attention.recurrent_layers", default=None)
        if layers is None:
            interval = keys.get_int("{arch}.full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
            if interval <= 0:
                raise ModelError(f"{keys.arch}: full_attention_interval must be positive, found {interval}")
            flags = [(il + 1) % interval != 0 for il in range(n_layer)]
        else:
            flags = [bool(v) for v in list(layers)][:n_layer]
        sections = [int(v) for v in list(keys.get("{arch}.rope.dimension_sections"))]
        return {"delta": dims, "recurrent_layers": flags, "rope_sections": (sections + [0] * 4)[:4]}

    def check_expert_count(self, keys: MetadataView) -> None:
        """qwen35 is the dense family: a file with experts is qwen35moe's (llama.cpp's two model classes)."""
        if keys.get_int("{arch}.expert_count", 0) > 0:
            raise ModelError(f"{keys.arch}: mixture-of-experts files (expert_count > 0) are qwen35moe's")

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        dims = _delta(hp)
        if not (1 < dims.d_conv <= 64 and dims.n_k_heads > 0 and dims.n_v_heads % dims.n_k_heads == 0
                and dims.d_inner == dims.n_v_heads * dims.head_dim):
            raise ModelError(f"{hp.arch}: inconsistent ssm keys {dims.model_dump()} (inner_size must be "
                             "time_step_rank × state_size, time_step_rank a multiple of group_count)")
        if len(getattr(hp, "recurrent_layers", [])) != hp.n_layer:
            raise ModelError(f"{hp.arch}: attention.recurrent_layers must name every one of {hp.n_layer} layers")
        if not imrope_text_axes_cover(getattr(hp, "rope_sections", []), hp.n_rot):
            raise ModelError(f"{hp.arch}: rope.dimension_sections {getattr(hp, 'rope_sections', [])} leave some of "
                             f"the {hp.n_rot} rotated dims without a text axis; that M-RoPE layout is not supported")

    def recurrent_state(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]] | None:
        if not is_delta_layer(hp, il):
            return None
        dims = _delta(hp)
        return {"conv": (dims.d_conv - 1, dims.conv_channels), "delta": (dims.n_v_heads, dims.head_dim, dims.head_dim)}

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        n_embd, t = hp.n_embd, layer_tensor
        specs = [t(il, "attn_norm.weight", (n_embd,), "mul"), t(il, "post_attention_norm.weight", (n_embd,), "mul"),
                 *self.ffn_tensors(hp, il)]
        if is_delta_layer(hp, il):
            d = _delta(hp)
            return specs + [t(il, "attn_qkv.weight", (n_embd, d.conv_channels)),
                            t(il, "attn_gate.weight", (n_embd, d.d_inner)),
                            t(il, "ssm_conv1d.weight", (d.d_conv, d.conv_channels), "mul"),
                            t(il, "ssm_dt.bias", (d.n_v_heads,), "add"), t(il, "ssm_a", (d.n_v_heads,), "mul"),
                            t(il, "ssm_beta.weight", (n_embd, d.n_v_heads)),
                            t(il, "ssm_alpha.weight", (n_embd, d.n_v_heads)),
                            t(il, "ssm_norm.weight", (d.head_dim,), "mul"),
                            t(il, "ssm_out.weight", (d.d_inner, n_embd))]
        head, n_q = hp.n_embd_head_k, hp.n_embd_head_k * hp.n_head(il)
        return specs + [t(il, "attn_q.weight", (n_embd, 2 * n_q)),
                        t(il, "attn_k.weight", (n_embd, hp.n_embd_k_gqa(il))),
                        t(il, "attn_v.weight", (n_embd, hp.n_embd_v_gqa(il))),
                        t(il, "attn_output.weight", (n_q, n_embd)), t(il, "attn_q_norm.weight", (head,), "mul"),
                        t(il, "attn_k_norm.weight", (head,), "mul")]

    def ffn_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        """The FFN's tensors of layer ``il``: a SwiGLU here, the experts in qwen35moe."""
        return gated_ffn_tensors(hp, il)

    def feed_forward(self, b: GraphBuilder, h: Node, il: int) -> Node:
        """The FFN of layer ``il`` on the post-attention-normed ``h``."""
        return b.build_ffn(h, act="silu")

    def build_graph(self, b: GraphBuilder) -> None:
        x = b.build_inp_embd()
        for il in b.layers():
            residual = x
            h = b.build_norm(x, f"blk.{il}.attn_norm.weight")
            h = self._delta_block(b, h) if is_delta_layer(b.hp, il) else self._attn_block(b, h)
            if il == b.hp.n_layer - 1:
                h, residual = b.select_outputs(h, residual)
            x = b.op("add", h, residual)
            x = b.op("add", self.feed_forward(b, b.build_norm(x, f"blk.{il}.post_attention_norm.weight"), il), x)
        b.build_output(x)

    @staticmethod
    def _attn_block(b: GraphBuilder, h: Node) -> Node:
        hp, p = b.hp, f"blk.{b.layer}"
        n_head, head = hp.n_head(b.layer), hp.n_embd_head_k
        q_gate = b.op("reshape", b.mul_mat(f"{p}.attn_q.weight", h), shape=(-1, n_head, 2 * head))
        q = b.op("slice", q_gate, axis=-1, start=0, stop=head)
        gate = b.op("reshape", b.op("slice", q_gate, axis=-1, start=head, stop=2 * head), shape=(-1, n_head * head))
        k = b.op("reshape", b.mul_mat(f"{p}.attn_k.weight", h), shape=(-1, hp.n_head_kv(b.layer), head))
        v = b.op("reshape", b.mul_mat(f"{p}.attn_v.weight", h), shape=(-1, hp.n_head_kv(b.layer), head))
        q = b.build_rope(b.build_norm(q, f"{p}.attn_q_norm.weight"))
        k = b.build_rope(b.build_norm(k, f"{p}.attn_k_norm.weight"))
        out = b.build_attn(q, k, v, out_weight="")
        return b.mul_mat(f"{p}.attn_output.weight", b.op("mul", out, b.op("sigmoid", gate)))

    @staticmethod
    def _delta_block(b: GraphBuilder, h: Node) -> Node:
        d, p, eps = _delta(b.hp), f"blk.{b.layer}", b.hp.f_norm_rms_eps
        qkv = b.op("silu", b.build_short_conv(b.mul_mat(f"{p}.attn_qkv.weight", h), f"{p}.ssm_conv1d.weight"))

        def by_seq(node: Node, n_heads: int, size: int) -> Node:
            return b.op("reshape", node, shape=(b.params.n_seqs, -1, n_heads, size))

        def l2_norm(node: Node) -> Node:
            # x / max(|x|, eps) == rms_norm(x, eps² / D) / sqrt(D) up to the eps term (|x|² ≫ eps²)
            normed = b.op("rms_norm", node, eps=eps * eps / d.head_dim)
            return b.op("scale", normed, s=1.0 / math.sqrt(d.head_dim))

        q = by_seq(l2_norm(b.op("reshape", b.op("slice", qkv, axis=-1, start=0, stop=d.key_dim),
                                shape=(-1, d.n_k_heads, d.head_dim))), d.n_k_heads, d.head_dim)
        k = by_seq(l2_norm(b.op("reshape", b.op("slice", qkv, axis=-1, start=d.key_dim, stop=2 * d.key_dim),
                                shape=(-1, d.n_k_heads, d.head_dim))), d.n_k_heads, d.head_dim)
        v = by_seq(b.op("slice", qkv, axis=-1, start=2 * d.key_dim, stop=d.conv_channels), d.n_v_heads, d.head_dim)
        beta = b.op("sigmoid", b.mul_mat(f"{p}.ssm_beta.weight", h))
        alpha = b.op("add", b.mul_mat(f"{p}.ssm_alpha.weight", h), b.weight(f"{p}.ssm_dt.bias"))
        g = b.op("mul", b.op("softplus", alpha), b.weight(f"{p}.ssm_a"))
        per_seq = (b.params.n_seqs, -1, d.n_v_heads)
        state = b.build_rs("delta")
        packed = b.op("gated_delta", state, q, k, v, b.op("reshape", g, shape=per_seq),
                      b.op("reshape", beta, shape=per_seq))
        n_out = b.params.n_tokens // b.params.n_seqs * d.d_inner
        out = b.op("reshape", b.op("slice", packed, axis=1, start=0, stop=n_out), shape=(-1, d.n_v_heads, d.head_dim))
        b.store_rs("delta", b.op("reshape", b.op("slice", packed, axis=1, start=n_out, stop=None),
                                 shape=state.shape or ()))
        z = b.op("reshape", b.mul_mat(f"{p}.attn_gate.weight", h), shape=(-1, d.n_v_heads, d.head_dim))
        gated = b.op("mul", b.build_norm(out, f"{p}.ssm_norm.weight"), b.op("silu", z))
        return b.mul_mat(f"{p}.ssm_out.weight", b.op("reshape", gated, shape=(-1, d.d_inner)))
