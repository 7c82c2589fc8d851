"""The ``mistral3`` architecture (Mistral 3 / Ministral 3 text models), as llama.cpp's ``llama_model_mistral3``.

The llama layer stack (NORM rope, SwiGLU, optional rope frequency factors and biases) with two additions:

* **attention temperature** (``attention.temperature_scale`` = β, Llama-4 style): queries are multiplied, after
  RoPE, by ``1 + β · log(floor(pos / n_ctx_orig) + 1)`` where ``n_ctx_orig`` is
  ``rope.scaling.original_context_length`` — positions inside the original context are untouched;
* **YaRN log multiplier** (``rope.scaling.yarn_log_multiplier`` = m): with YaRN active, llama.cpp sets the rope
  magnitude to ``get_mscale(f, 1) / get_mscale(f, m)`` (then cancels ggml's own ``1 + 0.1 ln f``), i.e. an
  attention factor of ``1 / (1 + 0.1 · m · ln f)`` for a scaling factor f > 1.

The vision tower of Mistral-3 files lives in a separate projector file; this is the text path. The MoE variant
(``expert_count`` > 0) is refused.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from llmfw.core.arch.architecture import RopeParams
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import GraphBuilder, Node
from llmfw.core.ir.hparams import HParams
from llmfw.core.format.metadata import MetadataView
from llmfw.plugins.architectures.llama import LlamaArchitecture


class Mistral3HParams(HParams):
    #: β of the attention temperature (0: off)
    f_attn_temp_scale: float = 0.0
    #: the YaRN log multiplier m (0: off)
    rope_yarn_log_mul: float = 0.0


def attention_temperature(pos: np.ndarray, beta: float, floor_scale: int) -> np.ndarray:
    """Llama-4's query scale per position: ``1 + β · log(floor(pos / floor_scale) + 1)``, float32 [T, 1, 1]."""
    scale = np.log(np.floor(pos.astype(np.float64) / floor_scale) + 1.0) * beta + 1.0
    return scale.astype(np.float32).reshape(-1, 1, 1)


class Mistral3Architecture(LlamaArchitecture):
    name = "mistral3"
    hparams_class = Mistral3HParams

    def own_hparams(self, keys: MetadataView, common: dict[str, Any]) -> dict[str, Any]:
        extra = super().own_hparams(keys, common)
        extra["f_attn_temp_scale"] = keys.get_float("{arch}.attention.temperature_scale", 0.0)
        extra["rope_yarn_log_mul"] = keys.get_float("{arch}.rope.scaling.yarn_log_multiplier", 0.0)
        return extra

    def check_hparams(self, hp: HParams) -> None:
        super().check_hparams(hp)
        if getattr(hp, "f_attn_temp_scale", 0.0) and hp.n_ctx_orig_yarn <= 0:
            raise ModelError("mistral3: attention.temperature_scale needs rope.scaling.original_context_length > 0")

    def rope_params(self, hp: HParams, il: int) -> RopeParams:
        params = super().rope_params(hp, il)
        log_mul = getattr(hp, "rope_yarn_log_mul", 0.0)
        factor = 1.0 / params.freq_scale
        if log_mul and params.ext_factor != 0 and factor > 1.0:
            return replace(params, attn_factor=hp.rope_attn_factor / (0.1 * log_mul * math.log(factor) + 1.0))
        return params

    def ubatch_inputs(self, hp: HParams, pos: np.ndarray) -> dict[str, np.ndarray]:
        beta = getattr(hp, "f_attn_temp_scale", 0.0)
        return {"attn_temp": attention_temperature(pos, beta, hp.n_ctx_orig_yarn)} if beta else {}

    def position_qk(self, b: GraphBuilder, q: Node, k: Node) -> tuple[Node, Node]:
        q, k = super().position_qk(b, q, k)
        if getattr(b.hp, "f_attn_temp_scale", 0.0):
            q = b.op("mul", q, b.input("attn_temp"))  # after RoPE, as llama.cpp scales Qcur
        return q, k
