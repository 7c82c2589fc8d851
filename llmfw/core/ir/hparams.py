"""Hyperparameters common to (almost) every transformer, read the way llama.cpp's ``llama_model::load_hparams``
reads them: arch-templated keys (``{arch}.block_count``...), per-layer values given either as a scalar or as an
array, llama.cpp's defaults where a key is optional.

An architecture with keys of its own subclasses :class:`HParams` (``Architecture.hparams_class``) and returns
the extra fields from ``Architecture.own_hparams``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import MissingMetadataKey, ModelError
from ..validation import validation_error_message

if TYPE_CHECKING:
    from ..format.metadata import MetadataView

RopeScaling = Literal["none", "linear", "yarn", "longrope", "llama3"]
SWAType = Literal["none", "standard", "chunked", "symmetric"]

#: hard upper bounds so a corrupt header cannot drive a huge allocation
MAX_LAYERS = 4096
MAX_EMBD = 1 << 17
MAX_CTX = 1 << 24


class HParams(BaseModel):
    """Model hyperparameters. Per-layer quantities are full lists (one entry per layer); use the accessors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: str
    n_vocab: int = Field(gt=0)
    n_ctx_train: int = Field(gt=0, le=MAX_CTX)
    n_embd: int = Field(gt=0, le=MAX_EMBD)
    n_layer: int = Field(gt=0, le=MAX_LAYERS)
    n_head_arr: list[int]
    n_head_kv_arr: list[int]
    n_ff_arr: list[int]
    n_embd_head_k: int = Field(gt=0)
    n_embd_head_v: int = Field(gt=0)
    n_rot: int = Field(ge=0)
    f_norm_eps: float = 0.0
    f_norm_rms_eps: float = 0.0
    #: attention.scale; 0 means 1/sqrt(n_embd_head_k)
    f_attention_scale: float = 0.0
    f_attn_logit_softcapping: float = 0.0
    f_final_logit_softcapping: float = 0.0

    # RoPE
    rope_freq_base_train: float = 10000.0
    rope_freq_scale_train: float = 1.0
    rope_freq_base_train_swa: float = 10000.0
    rope_freq_scale_train_swa: float = 1.0
    rope_scaling_type: RopeScaling = "none"
    rope_scaling_factor: float = 0.0
    rope_finetuned: bool = False
    n_ctx_orig_yarn: int = 0
    yarn_ext_factor: float = -1.0  # < 0: 1.0 for YaRN files, else 0.0 (llama.cpp's cparams default)
    yarn_attn_factor: float = 1.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor
    # llama3-style frequency-factor scaling (used when no rope_freqs tensor is present)
    rope_llama3_low_freq_factor: float = 1.0
    rope_llama3_high_freq_factor: float = 4.0

    # sliding window attention
    n_swa: int = 0
    swa_type: SWAType = "none"
    swa_layers: list[bool] = Field(default_factory=list)

    causal_attn: bool = True

    @model_validator(mode="after")
    def _check_layers(self) -> "HParams":
        for field_name in ("n_head_arr", "n_head_kv_arr", "n_ff_arr"):
            values = getattr(self, field_name)
            if len(values) != self.n_layer:
                raise ValueError(f"{field_name} has {len(values)} entries, expected n_layer = {self.n_layer}")
            if any(v < 0 for v in values):
                raise ValueError(f"{field_name} has negative entries: {values}")
        for il, (h, hkv) in enumerate(zip(self.n_head_arr, self.n_head_kv_arr)):
            if hkv and h % hkv:
                raise ValueError(f"layer {il}: head_count {h} is not a multiple of head_count_kv {hkv}")
        if self.swa_layers and len(self.swa_layers) != self.n_layer:
            raise ValueError(f"swa_layers has {len(self.swa_layers)} entries, expected n_layer = {self.n_layer}")
        if self.n_rot > self.n_embd_head_k:
            raise ValueError(f"rope.dimension_count {self.n_rot} exceeds the head size {self.n_embd_head_k}")
        return self

    # -- per-layer accessors (llama.cpp names) --------------------------------------------------------------
    def n_head(self, il: int = 0) -> int:
        return self.n_head_arr[il]

    def n_head_kv(self, il: int = 0) -> int:
        return self.n_head_kv_arr[il]

    def n_ff(self, il: int = 0) -> int:
        return self.n_ff_arr[il]

    def head_dim_k(self, il: int = 0) -> int:
        """Layer ``il``'s key head size (llama.cpp's ``n_embd_head_k(il)``; Gemma 4's sliding-window layers have
        their own)."""
        return self.n_embd_head_k

    def head_dim_v(self, il: int = 0) -> int:
        return self.n_embd_head_v

    def n_embd_k_gqa(self, il: int = 0) -> int:
        return self.head_dim_k(il) * self.n_head_kv(il)

    def n_embd_v_gqa(self, il: int = 0) -> int:
        return self.head_dim_v(il) * self.n_head_kv(il)

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    @property
    def kq_scale(self) -> float:
        return self.f_attention_scale if self.f_attention_scale else 1.0 / math.sqrt(self.n_embd_head_k)

    @property
    def yarn_ext_factor_effective(self) -> float:
        if self.yarn_ext_factor >= 0:
            return self.yarn_ext_factor
        return 1.0 if self.rope_scaling_type == "yarn" else 0.0


def _per_layer(keys: "MetadataView", key: str, n_layer: int, default: int | None) -> list[int]:
    """A per-layer integer: a scalar broadcast to every layer or an array of n_layer values."""
    value = keys.get(key, default=None)
    if value is None:
        if default is None:
            raise MissingMetadataKey(f"missing required key {keys.expand(key)!r}")
        return [default] * n_layer
    if isinstance(value, (list, tuple)) or hasattr(value, "shape"):
        values = [int(v) for v in list(value)]
        if len(values) != n_layer:
            raise ModelError(f"{keys.expand(key)!r} has {len(values)} entries, expected block_count = {n_layer}")
        return values
    return [keys.as_int(key, value)] * n_layer


def read_common_hparams(keys: "MetadataView") -> dict[str, Any]:
    """The common hyperparameters as a dict of :class:`HParams` fields (architectures may amend it)."""
    hp: dict[str, Any] = {"arch": keys.arch}
    hp["n_ctx_train"] = keys.get_int("{arch}.context_length")
    hp["n_embd"] = keys.get_int("{arch}.embedding_length")
    n_layer = keys.get_int("{arch}.block_count")
    if not 0 < n_layer <= MAX_LAYERS:
        raise ModelError(f"{keys.expand('{arch}.block_count')} = {n_layer} is out of range (1..{MAX_LAYERS})")
    hp["n_layer"] = n_layer
    hp["n_head_arr"] = _per_layer(keys, "{arch}.attention.head_count", n_layer, None)
    hp["n_head_kv_arr"] = _per_layer(keys, "{arch}.attention.head_count_kv", n_layer, -1)
    hp["n_head_kv_arr"] = [h if hkv < 0 else hkv for h, hkv in zip(hp["n_head_arr"], hp["n_head_kv_arr"])]
    hp["n_ff_arr"] = _per_layer(keys, "{arch}.feed_forward_length", n_layer, 0)

    n_head0 = hp["n_head_arr"][0]
    default_head = hp["n_embd"] // n_head0 if n_head0 else 0
    hp["n_embd_head_k"] = keys.get_int("{arch}.attention.key_length", default_head)
    hp["n_embd_head_v"] = keys.get_int("{arch}.attention.value_length", default_head)
    hp["n_rot"] = keys.get_int("{arch}.rope.dimension_count", hp["n_embd_head_k"])
    hp["f_norm_eps"] = keys.get_float("{arch}.attention.layer_norm_epsilon", 0.0)
    hp["f_norm_rms_eps"] = keys.get_float("{arch}.attention.layer_norm_rms_epsilon", 0.0)
    hp["f_attention_scale"] = keys.get_float("{arch}.attention.scale", 0.0)
    hp["f_attn_logit_softcapping"] = keys.get_float("{arch}.attn_logit_softcapping", 0.0)
    hp["f_final_logit_softcapping"] = keys.get_float("{arch}.final_logit_softcapping", 0.0)
    hp["n_vocab"] = _read_n_vocab(keys)
    hp.update(read_rope_hparams(keys, hp["n_ctx_train"]))
    hp["n_swa"] = keys.get_int("{arch}.attention.sliding_window", 0)
    hp["causal_attn"] = keys.get_bool("{arch}.attention.causal", True)
    return hp


def _read_n_vocab(keys: "MetadataView") -> int:
    """``{arch}.vocab_size``, else the length of ``tokenizer.ggml.tokens`` (llama.cpp does the same)."""
    n_vocab = keys.get_int("{arch}.vocab_size", 0)
    if n_vocab:
        return n_vocab
    tokens = keys.get("tokenizer.ggml.tokens", default=None)
    if tokens is None:
        raise ModelError("cannot tell the vocabulary size: neither {arch}.vocab_size nor tokenizer.ggml.tokens "
                         "is present".replace("{arch}", keys.arch))
    return len(tokens)


def read_rope_hparams(keys: "MetadataView", n_ctx_train: int) -> dict[str, Any]:
    """RoPE keys, with llama.cpp's rules for scale_linear vs rope.scaling.factor."""
    hp: dict[str, Any] = {}
    base = keys.get_float("{arch}.rope.freq_base", 10000.0)
    hp["rope_freq_base_train"] = base
    hp["rope_freq_base_train_swa"] = keys.get_float("{arch}.rope.freq_base_swa", base)
    scaling = str(keys.get("{arch}.rope.scaling.type", default="none") or "none").lower()
    if scaling not in ("none", "linear", "yarn", "longrope", "llama3"):
        raise ModelError(f"{keys.expand('{arch}.rope.scaling.type')} = {scaling!r}; "
                         "expected none, linear, yarn, longrope or llama3")
    hp["rope_scaling_type"] = scaling
    # llama.cpp: rope.scaling.factor wins, else rope.scale_linear; the frequency scale is its inverse
    factor = keys.get_float("{arch}.rope.scaling.factor", 0.0)
    if not factor:
        factor = keys.get_float("{arch}.rope.scale_linear", 0.0)
    hp["rope_scaling_factor"] = factor
    hp["rope_freq_scale_train"] = 1.0 if factor == 0.0 else 1.0 / factor
    hp["rope_freq_scale_train_swa"] = hp["rope_freq_scale_train"]
    hp["rope_finetuned"] = keys.get_bool("{arch}.rope.scaling.finetuned", False)
    hp["n_ctx_orig_yarn"] = keys.get_int("{arch}.rope.scaling.original_context_length", n_ctx_train)
    hp["rope_attn_factor"] = keys.get_float("{arch}.rope.scaling.attn_factor", 1.0)
    hp["yarn_ext_factor"] = keys.get_float("{arch}.rope.scaling.yarn_ext_factor", -1.0)
    hp["yarn_attn_factor"] = keys.get_float("{arch}.rope.scaling.yarn_attn_factor", 1.0)
    hp["yarn_beta_fast"] = keys.get_float("{arch}.rope.scaling.yarn_beta_fast", 32.0)
    hp["yarn_beta_slow"] = keys.get_float("{arch}.rope.scaling.yarn_beta_slow", 1.0)
    hp["rope_llama3_low_freq_factor"] = keys.get_float("{arch}.rope.scaling.low_freq_factor", 1.0)
    hp["rope_llama3_high_freq_factor"] = keys.get_float("{arch}.rope.scaling.high_freq_factor", 4.0)
    return hp


def make_hparams(cls: type[HParams], values: dict[str, Any]) -> HParams:
    """Validate into ``cls``, turning pydantic's error into a ModelError that names the bad field."""
    from pydantic import ValidationError

    try:
        return cls(**values)
    except ValidationError as exc:
        problems = validation_error_message(exc)
        raise ModelError(f"invalid hyperparameters for arch {values.get('arch')!r}: {problems}") from None
