"""``toyconv``: a toy recurrent language model for llmfw, the smallest architecture on the ``recurrent`` memory
(``docs/memory.md``). Every layer is a gated short convolution — LFM2's convolution block without attention —
so the model's whole memory of a sequence is, per layer, the last K-1 values its convolution saw::

    b, c, u = split3(conv_in(rms_norm(x) * attn_norm))       n_embd each
    x = x + conv_out(c * short_conv(b * u))                  causal depthwise, width K = toyconv.conv_width
    x = x + ffn_down(silu(ffn_gate(h)) * ffn_up(h))          with h = rms_norm(x) * ffn_norm

then ``output(rms_norm(x) * output_norm)`` (tied to ``token_embd`` without ``output.weight``).

What makes it recurrent is two declarations: ``memory = "recurrent"`` (the memory module, registry kind
``"memory"``) and :meth:`ToyConvArchitecture.recurrent_state`, the state each layer carries per sequence. The
graph reads and writes that state through ``GraphBuilder.build_short_conv`` (itself ``build_rs`` / ``store_rs``
around the ``ssm_conv`` and ``conv_window`` ops). Registered through the entry point ``toyconv = "llmfw_toyconv"``
in the group ``llmfw`` (see pyproject.toml).
"""
from __future__ import annotations

from typing import Any

from llmfw.sdk import (Architecture, GraphBuilder, HParams, MetadataView, ModelError, TensorSpec, gated_ffn_tensors,
                       hookimpl, layer_tensor)

__version__ = "0.1.0"


class ToyConvHParams(HParams):
    #: the convolution's width K: each position sees itself and the K-1 before it
    conv_width: int = 0


class ToyConvArchitecture(Architecture):
    name = "toyconv"
    hparams_class = ToyConvHParams
    memory = "recurrent"

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        return {"conv_width": keys.get_int("{arch}.conv_width")}

    def check_hparams(self, hp: HParams) -> None:
        if hp.f_norm_rms_eps <= 0:
            raise ModelError(f"toyconv: attention.layer_norm_rms_epsilon must be > 0, found {hp.f_norm_rms_eps}")
        if not 1 < getattr(hp, "conv_width", 0) <= 16:
            raise ModelError(f"toyconv: conv_width must be in 2..16, found {getattr(hp, 'conv_width', 0)}")

    def recurrent_state(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]] | None:
        return {"conv": (getattr(hp, "conv_width", 2) - 1, hp.n_embd)}

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        n_embd, width = hp.n_embd, getattr(hp, "conv_width", 2)
        return [layer_tensor(il, "attn_norm.weight", (n_embd,), "mul"),
                layer_tensor(il, "conv.weight", (width, n_embd), "mul"),
                layer_tensor(il, "conv_in.weight", (n_embd, 3 * n_embd)),
                layer_tensor(il, "conv_out.weight", (n_embd, n_embd)),
                layer_tensor(il, "ffn_norm.weight", (n_embd,), "mul"), *gated_ffn_tensors(hp, il)]

    def build_graph(self, b: GraphBuilder) -> None:
        n_embd = b.hp.n_embd
        x = b.build_inp_embd()
        for il in b.layers():
            p = f"blk.{il}"
            h = b.mul_mat(f"{p}.conv_in.weight", b.build_norm(x, f"{p}.attn_norm.weight"))
            gate_in, gate_out, u = (b.op("slice", h, axis=-1, start=i * n_embd, stop=(i + 1) * n_embd)
                                    for i in range(3))
            conv = b.build_short_conv(b.op("mul", gate_in, u), f"{p}.conv.weight")
            h = b.mul_mat(f"{p}.conv_out.weight", b.op("mul", gate_out, conv))
            x = b.op("add", x, h)
            x = b.op("add", x, b.build_ffn(b.build_norm(x, f"{p}.ffn_norm.weight"), act="silu"))
        b.build_output(x)


@hookimpl
def register_architectures(register):
    register("toyconv", "llmfw_toyconv:ToyConvArchitecture")
