"""Mamba-2 mixer layers, shared by the hybrid families that use them (``granitehybrid``; later Nemotron-H,
Falcon-H1...): hyperparameters, tensors, recurrent state and the graph block, as llama.cpp's
``llm_build_mamba_base::build_mamba2_layer``::

    z, xBC, dt = split(ssm_in(h))                      sizes d_inner, d_inner + 2·G·N, H
    xBC = silu(short_conv(xBC) + ssm_conv1d.bias)      causal depthwise conv of width ssm.conv_kernel, carried window
    x, B, C = split(xBC)                               x [H, P] (P = d_inner / H), B and C [G, N]
    y = ssm_scan(state, x, dt + ssm_dt.bias, ssm_a, B, C) + x · ssm_d
    y = rms_norm_per_group(silu(z) · y) · ssm_norm     G groups of d_inner / G
    out = ssm_out(y)

State per sequence: ``"conv"`` [K-1, d_inner + 2·G·N] and ``"ssm"`` [H, P, N].
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from llmfw.core.arch.architecture import TensorSpec
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.format.metadata import MetadataView


class Mamba2Dims(BaseModel):
    """The ``{arch}.ssm.*`` keys."""

    d_conv: int
    d_inner: int
    d_state: int
    n_head: int
    n_group: int

    @property
    def head_dim(self) -> int:
        return self.d_inner // self.n_head

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution (x, B and C)."""
        return self.d_inner + 2 * self.n_group * self.d_state

    @property
    def d_in_proj(self) -> int:
        return 2 * self.d_inner + 2 * self.n_group * self.d_state + self.n_head


def read_mamba2_dims(keys: MetadataView) -> dict[str, Any]:
    """The ssm keys as an ``ssm`` hyperparameter field (every one required, as llama.cpp reads them)."""
    dims = Mamba2Dims(d_conv=keys.get_int("{arch}.ssm.conv_kernel"), d_inner=keys.get_int("{arch}.ssm.inner_size"),
                      d_state=keys.get_int("{arch}.ssm.state_size"), n_head=keys.get_int("{arch}.ssm.time_step_rank"),
                      n_group=keys.get_int("{arch}.ssm.group_count"))
    if not (1 < dims.d_conv <= 64 and dims.d_state > 0 and dims.n_head > 0 and dims.n_group > 0
            and dims.d_inner % dims.n_head == 0 and dims.d_inner % dims.n_group == 0
            and dims.n_head % dims.n_group == 0):
        raise ModelError(f"{keys.arch}: inconsistent ssm keys {dims.model_dump()} (conv_kernel 2..64, inner_size "
                         "a multiple of time_step_rank and group_count, heads a multiple of groups)")
    return {"ssm": dims}


def mamba2_dims(hp: Any) -> Mamba2Dims:
    """The ``ssm`` field a family's hyperparameters hold (read by :func:`read_mamba2_dims`)."""
    dims = getattr(hp, "ssm", None)
    if not isinstance(dims, Mamba2Dims):
        raise ModelError(f"{hp.arch}: the Mamba-2 ssm.* hyperparameters are missing")
    return dims


def mamba2_state(dims: Mamba2Dims) -> dict[str, tuple[int, ...]]:
    return {"conv": (dims.d_conv - 1, dims.conv_channels), "ssm": (dims.n_head, dims.head_dim, dims.d_state)}


def mamba2_tensors(dims: Mamba2Dims, n_embd: int, il: int) -> list[TensorSpec]:
    p = f"blk.{il}"
    return [
        TensorSpec(f"{p}.ssm_in.weight", (n_embd, dims.d_in_proj), il),
        TensorSpec(f"{p}.ssm_conv1d.weight", (dims.d_conv, dims.conv_channels), il, usage="mul"),
        TensorSpec(f"{p}.ssm_conv1d.bias", (dims.conv_channels,), il, optional=True, usage="add"),
        TensorSpec(f"{p}.ssm_dt.bias", (dims.n_head,), il, usage="add"),
        TensorSpec(f"{p}.ssm_a", (1, dims.n_head), il, usage="mul"),
        TensorSpec(f"{p}.ssm_d", (1, dims.n_head), il, usage="mul"),
        TensorSpec(f"{p}.ssm_norm.weight", (dims.d_inner // dims.n_group, dims.n_group), il, usage="mul"),
        TensorSpec(f"{p}.ssm_out.weight", (dims.d_inner, n_embd), il),
    ]


def build_mamba2(b: GraphBuilder, h: Node, dims: Mamba2Dims) -> Node:
    """The Mamba-2 mixer of the current layer on ``h`` [T, n_embd] → [T, n_embd]."""
    p, eps = f"blk.{b.layer}", b.hp.f_norm_rms_eps
    d_inner, n_head, n_group, d_state = dims.d_inner, dims.n_head, dims.n_group, dims.d_state
    zxbcdt = b.mul_mat(f"{p}.ssm_in.weight", h)
    z = b.op("slice", zxbcdt, axis=-1, start=0, stop=d_inner)
    xbc = b.op("slice", zxbcdt, axis=-1, start=d_inner, stop=d_inner + dims.conv_channels)
    dt = b.op("slice", zxbcdt, axis=-1, start=d_inner + dims.conv_channels, stop=dims.d_in_proj)
    xbc = b.build_short_conv(xbc, f"{p}.ssm_conv1d.weight")
    if b.has_weight(f"{p}.ssm_conv1d.bias"):
        xbc = b.op("add", xbc, b.weight(f"{p}.ssm_conv1d.bias"))
    xbc = b.op("silu", xbc)

    def by_seq(node: Node, *shape: int) -> Node:
        return b.op("reshape", node, shape=(b.params.n_seqs, -1, *shape))

    x = by_seq(b.op("slice", xbc, axis=-1, start=0, stop=d_inner), n_head, dims.head_dim)
    bb = by_seq(b.op("slice", xbc, axis=-1, start=d_inner, stop=d_inner + n_group * d_state), n_group, d_state)
    cc = by_seq(b.op("slice", xbc, axis=-1, start=d_inner + n_group * d_state, stop=dims.conv_channels),
                n_group, d_state)
    dt = by_seq(b.op("add", dt, b.weight(f"{p}.ssm_dt.bias")), n_head)
    state = b.build_rs("ssm")
    # A as a computed [H] vector: the scan then takes no weight, so a backend without a scan kernel can leave it
    # to the host backend (an op that reads a weight must run where the weight lives)
    decay = b.op("reshape", b.weight(f"{p}.ssm_a"), shape=(n_head,))
    packed = b.op("ssm_scan", state, x, dt, decay, bb, cc)
    n_y = b.params.n_tokens // b.params.n_seqs * d_inner
    y = b.op("reshape", b.op("slice", packed, axis=1, start=0, stop=n_y), shape=(-1, n_head, dims.head_dim))
    b.store_rs("ssm", b.op("reshape", b.op("slice", packed, axis=1, start=n_y, stop=None),
                           shape=state.shape or ()))
    x_flat = b.op("reshape", x, shape=(-1, n_head, dims.head_dim))
    y = b.op("add", y, b.op("mul", x_flat, b.weight(f"{p}.ssm_d")))  # D [H, 1] broadcasts over the head dim
    y = b.op("mul", b.op("silu", z), b.op("reshape", y, shape=(-1, d_inner)))
    y = b.op("rms_norm", b.op("reshape", y, shape=(-1, n_group, d_inner // n_group)), eps=eps)
    y = b.op("mul", y, b.weight(f"{p}.ssm_norm.weight"))
    return b.mul_mat(f"{p}.ssm_out.weight", b.op("reshape", y, shape=(-1, d_inner)))
