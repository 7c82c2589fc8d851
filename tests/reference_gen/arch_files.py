"""Build the small random-weight GGUF models of ``arch_specs.SPECS`` with the project's own GGUF writer.

The files are a pure function of the spec (seeded weights, the committed 8k vocabularies), so the tests rebuild
them instead of committing megabytes of weights, and check the sha256 recorded with llama.cpp's reference
numbers: the numbers are only valid for those exact bytes.

Tensor names, shapes and metadata keys follow llama.cpp's converter (``convert_hf_to_gguf.py``) and loader
(``src/models/<arch>.cpp``): llama.cpp refuses a file with a tensor its architecture does not create, so each
family writes exactly its own set. Weight scales are chosen so every block matters: unit-scale embeddings,
projections that keep activations near unit size, a sharper query/key so attention depends on position, and
an output head scaled so logits are peaked (std about 4).
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
if str(_ROOT) not in sys.path:  # the generator scripts run from anywhere
    sys.path.insert(0, str(_ROOT))
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from arch_specs import SPECS, file_name  # noqa: E402

from llmfw.core.format.gguf import GGUFValueType, GGUFWriter  # noqa: E402
from llmfw.core.format.quants import GGMLType, quantize  # noqa: E402

DATA_DIR = _ROOT / "tests" / "data" / "arch"

# ---------------------------------------------------------------------------------------------- metadata

_U32_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.dimension_count", "rope.scaling.original_context_length", "expert_count", "expert_used_count",
    "expert_feed_forward_length", "expert_shared_count", "expert_shared_feed_forward_length",
    "expert_group_count", "expert_group_used_count", "leading_dense_block_count", "expert_gating_func",
    "attention.key_length_mla", "attention.value_length_mla", "attention.q_lora_rank", "attention.kv_lora_rank",
    "shortconv.l_cache",
    "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
    "full_attention_interval", "nextn_predict_layers",
    "attention.key_length_swa", "attention.value_length_swa", "rope.dimension_count_swa",
    "embedding_length_per_layer_input", "attention.shared_kv_layers",
}


def _key_type(suffix: str, value) -> GGUFValueType:
    if isinstance(value, list):  # a per-layer value (LFM2's head_count_kv: 0 on convolution layers)
        return GGUFValueType.ARRAY
    if suffix in _U32_KEYS:
        return GGUFValueType.UINT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    return GGUFValueType.FLOAT32


def _arch_keys(spec: dict) -> dict:
    """``{arch}.*`` keys as the converter writes them for this family."""
    keys = {
        "context_length": spec["context_length"], "embedding_length": spec["n_embd"],
        "block_count": spec["n_layer"] + spec.get("nextn", 0), "feed_forward_length": spec["n_ff"],
        "attention.head_count": spec["n_head"], "attention.head_count_kv": spec["n_head_kv"],
    }
    if "head_dim" in spec:
        keys["attention.key_length"] = keys["attention.value_length"] = spec["head_dim"]
    keys.update({f"ssm.{k}": v for k, v in spec.get("ssm", {}).items()})
    if spec["arch"] in ("llama", "phi3", "gpt-oss"):
        keys["rope.dimension_count"] = _head_dim(spec)
    if "original_context_length" in spec:
        keys["rope.scaling.original_context_length"] = spec["original_context_length"]
    if spec.get("nextn"):
        keys["nextn_predict_layers"] = spec["nextn"]
    if "sliding_window" in spec:
        keys["attention.sliding_window"] = spec["sliding_window"]
    if "n_expert" in spec:
        keys["expert_count"], keys["expert_used_count"] = spec["n_expert"], spec["n_expert_used"]
        if "n_ff_exp" in spec:
            keys["expert_feed_forward_length"] = spec["n_ff_exp"]
    if spec["arch"] == "phi3":
        # Phi3MiniModel writes LongRoPE's attention factor; scale = n_ctx_train / original context
        scale = spec["context_length"] / spec["original_context_length"]
        keys["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(spec["original_context_length"]))
    keys.update(spec["keys"])
    return keys


# ---------------------------------------------------------------------------------------------- vocabularies

_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_BYTE = 1, 2, 3, 6
#: Phi-3's added tokens (ids 32000..32010 in the real model; here right after the pieces), all special
_PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
               "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
_GEMMA_FIRST_BYTE, _GEMMA_FIRST_PIECE = 238, 494


def _read_vocab(name: str) -> dict:
    return json.loads((DATA_DIR / name).read_text(encoding="utf-8"))


def _bpe_vocab(pre: str) -> list[tuple]:
    """SmolLM2's BPE (first 8k tokens) relabelled with the family's pre-tokenizer."""
    vocab = _read_vocab("vocab_bpe_smollm2_8k.json")
    special = vocab["special_ids"]
    return [
        ("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING, None),
        ("tokenizer.ggml.pre", pre, GGUFValueType.STRING, None),
        ("tokenizer.ggml.tokens", vocab["tokens"], GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.token_type", vocab["token_type"], GGUFValueType.ARRAY, GGUFValueType.INT32),
        ("tokenizer.ggml.merges", vocab["merges"], GGUFValueType.ARRAY, GGUFValueType.STRING),
        *[(key, value, GGUFValueType.UINT32, None) for key, value in special.items()],
        ("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL, None),
    ]


def _spm_keys(tokens: list[str], scores: list[float], types: list[int], bos: int, eos: int, unk: int, pad: int,
              extra: list[tuple]) -> list[tuple]:
    return [
        ("tokenizer.ggml.model", "llama", GGUFValueType.STRING, None),
        ("tokenizer.ggml.pre", "default", GGUFValueType.STRING, None),
        ("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.scores", scores, GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
        ("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        ("tokenizer.ggml.bos_token_id", bos, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.eos_token_id", eos, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.unknown_token_id", unk, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.padding_token_id", pad, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.add_bos_token", True, GGUFValueType.BOOL, None),
        ("tokenizer.ggml.add_eos_token", False, GGUFValueType.BOOL, None),
        *extra,
    ]


def _spm_gemma_vocab() -> list[tuple]:
    """Gemma's SPM, first 8k ids unchanged (Gemma-2's converter also writes add_space_prefix = False)."""
    v = _read_vocab("vocab_spm_gemma3_8k.json")
    return _spm_keys(v["tokens"], v["scores"], v["token_type"], bos=2, eos=1, unk=3, pad=0,
                     extra=[("tokenizer.ggml.add_space_prefix", False, GGUFValueType.BOOL, None)])


def _spm_phi3_vocab() -> list[tuple]:
    """A Llama-2 / Phi-3 layout: <unk> <s> </s>, 256 byte tokens, SPM pieces (the normal pieces among
    Gemma's first 8,192 ids, best-scored first), then Phi-3's special tokens."""
    v = _read_vocab("vocab_spm_gemma3_8k.json")
    tokens = ["<unk>", "<s>", "</s>"]
    types = [_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_CONTROL]
    tokens += v["tokens"][_GEMMA_FIRST_BYTE:_GEMMA_FIRST_PIECE]
    types += [_TOKEN_BYTE] * (_GEMMA_FIRST_PIECE - _GEMMA_FIRST_BYTE)
    scores = [0.0] * len(tokens)
    pieces = [i for i in range(_GEMMA_FIRST_PIECE, len(v["tokens"])) if v["token_type"][i] == _TOKEN_NORMAL]
    for i in pieces:
        tokens.append(v["tokens"][i])
        scores.append(v["scores"][i])
        types.append(_TOKEN_NORMAL)
    first_added = len(tokens)
    tokens += _PHI3_ADDED
    scores += [0.0] * len(_PHI3_ADDED)
    types += [_TOKEN_CONTROL] * len(_PHI3_ADDED)
    return _spm_keys(tokens, scores, types, bos=1, eos=first_added, unk=0, pad=first_added, extra=[])


_VOCABS = {"spm_gemma": _spm_gemma_vocab, "spm_phi3": _spm_phi3_vocab}


def _vocab_keys(spec: dict) -> list[tuple]:
    if spec["vocab"] == "bpe":
        return _bpe_vocab(spec["pre"])
    return _VOCABS[spec["vocab"]]()


# ---------------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]   # numpy shape: (n_out, n_in) for matrices, (n,) for vectors
    role: str                # key into spec["types"] for matrices; vectors are always F32
    init: str                # how to draw the values (see _draw)
    layer: int = -1


def _head_dim(spec: dict) -> int:
    return spec.get("head_dim", spec["n_embd"] // spec["n_head"])


def _n_head_kv(spec: dict, il: int) -> int:
    n_head_kv = spec["n_head_kv"]
    return n_head_kv[il] if isinstance(n_head_kv, list) else n_head_kv


def _lfm2_layer_plan(spec: dict, il: int) -> list[TensorPlan]:
    """LFM2: an operator norm, then a short-convolution block (no KV heads) or attention with q/k norms; FFN."""
    n_embd, n_ff, head = spec["n_embd"], spec["n_ff"], _head_dim(spec)
    blk = f"blk.{il}."
    plan = [TensorPlan(blk + "attn_norm.weight", (n_embd,), "norm", "norm", il)]
    if _n_head_kv(spec, il) == 0:
        plan += [TensorPlan(blk + "shortconv.conv.weight", (n_embd, spec["l_cache"]), "shortconv_conv", "conv", il),
                 TensorPlan(blk + "shortconv.in_proj.weight", (3 * n_embd, n_embd), "shortconv_in", "unit", il),
                 TensorPlan(blk + "shortconv.out_proj.weight", (n_embd, n_embd), "shortconv_out", "unit", il)]
    else:
        n_kv = head * _n_head_kv(spec, il)
        plan += [TensorPlan(blk + "attn_q.weight", (n_embd, n_embd), "attn_q", "sharp", il),
                 TensorPlan(blk + "attn_k.weight", (n_kv, n_embd), "attn_k", "sharp", il),
                 TensorPlan(blk + "attn_v.weight", (n_kv, n_embd), "attn_v", "unit", il),
                 TensorPlan(blk + "attn_q_norm.weight", (head,), "norm", "qk_norm", il),
                 TensorPlan(blk + "attn_k_norm.weight", (head,), "norm", "qk_norm", il),
                 TensorPlan(blk + "attn_output.weight", (n_embd, n_embd), "attn_output", "unit", il)]
    plan += [TensorPlan(blk + "ffn_norm.weight", (n_embd,), "norm", "norm", il),
             TensorPlan(blk + "ffn_gate.weight", (n_ff, n_embd), "ffn_gate", "unit", il),
             TensorPlan(blk + "ffn_up.weight", (n_ff, n_embd), "ffn_up", "unit", il),
             TensorPlan(blk + "ffn_down.weight", (n_embd, n_ff), "ffn_down", "down", il)]
    return plan


def _mamba2_layer_plan(spec: dict, il: int) -> list[TensorPlan]:
    """Granite 4.0-H: a Mamba-2 mixer (no KV heads) or attention, then a SwiGLU FFN."""
    blk = f"blk.{il}."
    plan = [TensorPlan(blk + "attn_norm.weight", (spec["n_embd"],), "norm", "norm", il)]
    plan += _mamba2_mixer_plan(spec, il) if _n_head_kv(spec, il) == 0 else _attention_plan(spec, il)
    plan.append(TensorPlan(blk + "ffn_norm.weight", (spec["n_embd"],), "norm", "norm", il))
    return plan + _ffn_plan(spec, il)


def _mamba2_mixer_plan(spec: dict, il: int) -> list[TensorPlan]:
    n_embd, ssm = spec["n_embd"], spec["ssm"]
    d_inner, n_head, d_conv = ssm["inner_size"], ssm["time_step_rank"], ssm["conv_kernel"]
    n_group, d_state = ssm["group_count"], ssm["state_size"]
    channels = d_inner + 2 * n_group * d_state
    blk = f"blk.{il}."
    return [TensorPlan(blk + "ssm_in.weight", (2 * d_inner + 2 * n_group * d_state + n_head, n_embd), "ssm_in",
                       "unit", il),
            TensorPlan(blk + "ssm_conv1d.weight", (channels, d_conv), "ssm_f32", "conv", il),
            TensorPlan(blk + "ssm_conv1d.bias", (channels,), "bias", "small_bias", il),
            TensorPlan(blk + "ssm_dt.bias", (n_head,), "bias", "dt_bias", il),
            TensorPlan(blk + "ssm_a", (n_head, 1), "ssm_f32", "ssm_a", il),
            TensorPlan(blk + "ssm_d", (n_head, 1), "ssm_f32", "norm", il),
            TensorPlan(blk + "ssm_norm.weight", (n_group, d_inner // n_group), "ssm_f32", "norm", il),
            TensorPlan(blk + "ssm_out.weight", (n_embd, d_inner), "ssm_out", "unit", il)]


def _attention_plan(spec: dict, il: int) -> list[TensorPlan]:
    """Plain Q/K/V/output projections (no biases, no norms)."""
    n_embd, head, blk = spec["n_embd"], _head_dim(spec), f"blk.{il}."
    n_q, n_kv = head * spec["n_head"], head * _n_head_kv(spec, il)
    return [TensorPlan(blk + "attn_q.weight", (n_q, n_embd), "attn_q", "sharp", il),
            TensorPlan(blk + "attn_k.weight", (n_kv, n_embd), "attn_k", "sharp", il),
            TensorPlan(blk + "attn_v.weight", (n_kv, n_embd), "attn_v", "unit", il),
            TensorPlan(blk + "attn_output.weight", (n_embd, n_q), "attn_output", "unit", il)]


def _nemotron_h_layer_plan(spec: dict, il: int) -> list[TensorPlan]:
    """Nemotron-H: one block per layer — Mamba-2 (no KV heads, no FFN), attention (no FFN) or an ungated
    ReLU² MLP with an up bias."""
    n_embd, n_ff, blk = spec["n_embd"], spec["n_ff"][il], f"blk.{il}."
    plan = [TensorPlan(blk + "attn_norm.weight", (n_embd,), "norm", "norm", il)]
    if n_ff == 0:
        return plan + (_mamba2_mixer_plan(spec, il) if _n_head_kv(spec, il) == 0 else _attention_plan(spec, il))
    return plan + [TensorPlan(blk + "ffn_up.weight", (n_ff, n_embd), "ffn_up", "unit", il),
                   TensorPlan(blk + "ffn_up.bias", (n_ff,), "bias", "small_bias", il),
                   TensorPlan(blk + "ffn_down.weight", (n_embd, n_ff), "ffn_down", "down", il)]


def _gemma4_layer_plan(spec: dict, il: int) -> list[TensorPlan]:
    """Gemma 4: local layers with their own head size, global ones with rope_freqs; q/k norms, post norms, a GELU
    FFN, a per-layer input block and an output scale. The last ``shared_kv_layers`` layers have no K/V
    projections; the global layers in ``k_eq_v_layers`` no V projection."""
    n_embd, n_ff, keys, blk = spec["n_embd"], spec["n_ff"], spec["keys"], f"blk.{il}."
    local = keys["attention.sliding_window_pattern"][il]
    head = keys["attention.key_length_swa"] if local else spec["head_dim"]
    n_q, n_kv, n_pl = head * spec["n_head"], head * spec["n_head_kv"], keys["embedding_length_per_layer_input"]
    cached = il < spec["n_layer"] - keys["attention.shared_kv_layers"]

    def add(name: str, shape: tuple[int, ...], role: str, init: str) -> TensorPlan:
        return TensorPlan(blk + name, shape, role, init, il)

    plan = [add("attn_norm.weight", (n_embd,), "norm", "norm"), add("attn_q.weight", (n_q, n_embd), "attn_q", "unit")]
    if cached:
        plan.append(add("attn_k.weight", (n_kv, n_embd), "attn_k", "unit"))
        if il not in spec["k_eq_v_layers"]:
            plan.append(add("attn_v.weight", (n_kv, n_embd), "attn_v", "unit"))
    plan += [add("attn_output.weight", (n_embd, n_q), "attn_output", "unit"),
             add("attn_q_norm.weight", (head,), "norm", "gemma4_qk_norm")]
    if cached:
        plan.append(add("attn_k_norm.weight", (head,), "norm", "gemma4_qk_norm"))
    plan += [add("post_attention_norm.weight", (n_embd,), "norm", "post_norm"),
             add("layer_output_scale.weight", (1,), "norm", "norm"),
             add("ffn_norm.weight", (n_embd,), "norm", "norm"),
             add("ffn_gate.weight", (n_ff, n_embd), "ffn_gate", "unit"),
             add("ffn_up.weight", (n_ff, n_embd), "ffn_up", "unit"),
             add("ffn_down.weight", (n_embd, n_ff), "ffn_down", "down"),
             add("post_ffw_norm.weight", (n_embd,), "norm", "post_norm"),
             add("inp_gate.weight", (n_pl, n_embd), "inp_gate", "unit"),
             add("proj.weight", (n_embd, n_pl), "proj", "unit"),
             add("post_norm.weight", (n_embd,), "norm", "post_norm")]
    return plan


def _qwen35_layer_plan(spec: dict, il: int) -> list[TensorPlan]:
    """Qwen3.5: Gated DeltaNet layers, gated full attention every ``full_attention_interval``-th layer."""
    n_embd, ssm = spec["n_embd"], spec["ssm"]
    d_inner, d_conv, n_v = ssm["inner_size"], ssm["conv_kernel"], ssm["time_step_rank"]
    key_dim = ssm["state_size"] * ssm["group_count"]
    blk = f"blk.{il}."

    def add(name: str, shape: tuple[int, ...], role: str, init: str) -> TensorPlan:
        return TensorPlan(blk + name, shape, role, init, il)

    plan = [add("attn_norm.weight", (n_embd,), "norm", "norm")]
    if (il + 1) % spec["keys"]["full_attention_interval"] != 0:
        plan += [add("attn_qkv.weight", (2 * key_dim + d_inner, n_embd), "attn_qkv", "unit"),
                 add("attn_gate.weight", (d_inner, n_embd), "attn_gate", "unit"),
                 add("ssm_conv1d.weight", (2 * key_dim + d_inner, d_conv), "ssm_f32", "conv"),
                 add("ssm_dt.bias", (n_v,), "bias", "dt_bias"),
                 add("ssm_a", (n_v,), "bias", "ssm_a"),
                 add("ssm_beta.weight", (n_v, n_embd), "ssm_small", "unit"),
                 add("ssm_alpha.weight", (n_v, n_embd), "ssm_small", "unit"),
                 add("ssm_norm.weight", (ssm["state_size"],), "norm", "norm"),
                 add("ssm_out.weight", (n_embd, d_inner), "ssm_out", "unit")]
    else:
        head = _head_dim(spec)
        n_q, n_kv = head * spec["n_head"], head * _n_head_kv(spec, il)
        plan += [add("attn_q.weight", (2 * n_q, n_embd), "attn_q", "sharp"),
                 add("attn_k.weight", (n_kv, n_embd), "attn_k", "sharp"),
                 add("attn_v.weight", (n_kv, n_embd), "attn_v", "unit"),
                 add("attn_output.weight", (n_embd, n_q), "attn_output", "unit"),
                 add("attn_q_norm.weight", (head,), "norm", "qk_norm"),
                 add("attn_k_norm.weight", (head,), "norm", "qk_norm")]
    plan.append(add("post_attention_norm.weight", (n_embd,), "norm", "norm"))
    return plan + _ffn_plan(spec, il)


def _ffn_plan(spec: dict, il: int) -> list[TensorPlan]:
    """A hybrid layer's FFN: routed experts (+ shared) when the spec has experts, else a SwiGLU."""
    if "n_expert" in spec:
        return _expert_plan(spec, il)
    n_embd, n_ff, blk = spec["n_embd"], spec["n_ff"], f"blk.{il}."
    return [TensorPlan(blk + "ffn_gate.weight", (n_ff, n_embd), "ffn_gate", "unit", il),
            TensorPlan(blk + "ffn_up.weight", (n_ff, n_embd), "ffn_up", "unit", il),
            TensorPlan(blk + "ffn_down.weight", (n_embd, n_ff), "ffn_down", "down", il)]


def _layer_plan(spec: dict, il: int) -> list[TensorPlan]:
    if spec["arch"] in ("qwen35", "qwen35moe"):
        return _qwen35_layer_plan(spec, il)
    if spec["arch"] == "lfm2":
        return _lfm2_layer_plan(spec, il)
    if spec["arch"] == "granitehybrid":
        return _mamba2_layer_plan(spec, il)
    if spec["arch"] == "nemotron_h":
        return _nemotron_h_layer_plan(spec, il)
    if spec["arch"] == "gemma4":
        return _gemma4_layer_plan(spec, il)
    arch, n_embd, n_ff = spec["arch"], spec["n_embd"], spec["n_ff"]
    head = _head_dim(spec)
    n_q, n_kv = head * spec["n_head"], head * spec["n_head_kv"]
    blk = f"blk.{il}."
    plan: list[TensorPlan] = []

    def add(name: str, shape: tuple[int, ...], role: str, init: str) -> None:
        plan.append(TensorPlan(blk + name, shape, role, init, il))

    if arch == "deepseek2":
        return _mla_plan(spec, il) + (_expert_plan(spec, il) if il >= spec.get("n_dense_lead", 0) else [
            TensorPlan(blk + "ffn_gate.weight", (n_ff, n_embd), "ffn_gate", "unit", il),
            TensorPlan(blk + "ffn_up.weight", (n_ff, n_embd), "ffn_up", "unit", il),
            TensorPlan(blk + "ffn_down.weight", (n_embd, n_ff), "ffn_down", "down", il)])
    if arch != "olmo":  # OLMo's layer norms have no parameters
        add("attn_norm.weight", (n_embd,), "norm", "norm")
    if arch == "phi3":
        add("attn_qkv.weight", (n_q + 2 * n_kv, n_embd), "attn_qkv", f"qkv:{n_q}:{n_kv}")
    else:
        add("attn_q.weight", (n_q, n_embd), "attn_q", "sharp")
        add("attn_k.weight", (n_kv, n_embd), "attn_k", "sharp")
        add("attn_v.weight", (n_kv, n_embd), "attn_v", "unit")
    if arch in ("qwen2", "gpt-oss", "glm4moe"):
        add("attn_q.bias", (n_q,), "bias", "bias")
        add("attn_k.bias", (n_kv,), "bias", "bias")
        add("attn_v.bias", (n_kv,), "bias", "bias")
    if arch in ("qwen3", "qwen3moe", "glm4moe"):
        add("attn_q_norm.weight", (head,), "norm", "qk_norm")
        add("attn_k_norm.weight", (head,), "norm", "qk_norm")
    if arch == "olmoe":  # normalised over the whole width, before the head split
        add("attn_q_norm.weight", (n_q,), "norm", "qk_norm")
        add("attn_k_norm.weight", (n_kv,), "norm", "qk_norm")
    add("attn_output.weight", (n_embd, n_q), "attn_output", "unit")
    if arch == "gemma2":
        add("post_attention_norm.weight", (n_embd,), "norm", "post_norm")
    if arch == "gpt-oss":  # attention has an output bias and a sink per head
        add("attn_output.bias", (n_embd,), "bias", "bias")
        add("attn_sinks.weight", (spec["n_head"],), "bias", "sinks")
    if arch in ("gpt-oss", "glm4moe"):  # their FFN norm is called the post-attention norm
        add("post_attention_norm.weight", (n_embd,), "norm", "norm")
    elif arch != "olmo":
        add("ffn_norm.weight", (n_embd,), "norm", "norm")
    moe_layer = "n_expert" in spec and il >= spec.get("n_dense_lead", 0)
    if moe_layer:
        plan += _expert_plan(spec, il)
    elif arch == "phi3":  # gate and up fused, gate first (ggml_swiglu's order)
        add("ffn_up.weight", (2 * n_ff, n_embd), "ffn_up", "unit")
    else:
        add("ffn_gate.weight", (n_ff, n_embd), "ffn_gate", "unit")
        add("ffn_up.weight", (n_ff, n_embd), "ffn_up", "unit")
    if not moe_layer:
        add("ffn_down.weight", (n_embd, n_ff), "ffn_down", "down")
    if arch == "gemma2":
        add("post_ffw_norm.weight", (n_embd,), "norm", "post_norm")
    return plan


def _mla_plan(spec: dict, il: int) -> list[TensorPlan]:
    """DeepSeek-V2/V3's multi-head latent attention as llama.cpp's converter splits it (absorbed ``attn_k_b`` /
    ``attn_v_b``, numpy [H, n_out, n_in]), plus the layer's two norms."""
    n_embd, n_head, mla = spec["n_embd"], spec["n_head"], spec["mla"]
    q_width = n_head * (mla["nope"] + mla["rope"])
    blk = f"blk.{il}."
    return [TensorPlan(blk + name, shape, role, init, il) for name, shape, role, init in (
        ("attn_norm.weight", (n_embd,), "norm", "norm"),
        ("attn_q_a.weight", (mla["q_lora"], n_embd), "attn_q_a", "unit"),
        ("attn_q_a_norm.weight", (mla["q_lora"],), "norm", "norm"),
        ("attn_q_b.weight", (q_width, mla["q_lora"]), "attn_q_b", "sharp"),
        ("attn_kv_a_mqa.weight", (mla["kv_lora"] + mla["rope"], n_embd), "attn_kv_a_mqa", "sharp"),
        ("attn_kv_a_norm.weight", (mla["kv_lora"],), "norm", "norm"),
        ("attn_k_b.weight", (n_head, mla["kv_lora"], mla["nope"]), "attn_k_b", "sharp"),
        ("attn_v_b.weight", (n_head, mla["v"], mla["kv_lora"]), "attn_v_b", "unit"),
        ("attn_output.weight", (n_embd, n_head * mla["v"]), "attn_output", "unit"),
        ("ffn_norm.weight", (n_embd,), "norm", "norm"))]


def _expert_plan(spec: dict, il: int) -> list[TensorPlan]:
    """A router [E, n_embd] sharp enough that the choice of experts matters (logits of std ~3) and 3-D expert
    matrices (numpy [E, n_out, n_in]); the experts' outputs are larger than a dense FFN's so that their weighting
    (normalised or not) moves the logits."""
    n_embd, n_expert = spec["n_embd"], spec["n_expert"]
    n_ff = spec.get("n_ff_exp", spec["n_ff"])
    blk = f"blk.{il}."
    plan = [TensorPlan(blk + "ffn_gate_inp.weight", (n_expert, n_embd), "ffn_gate_inp", "router", il)]
    if il in spec.get("fused_gate_up_layers", ()):  # gate rows, then up rows, of each expert
        plan.append(TensorPlan(blk + "ffn_gate_up_exps.weight", (n_expert, 2 * n_ff, n_embd), "ffn_gate_up_exps",
                               "unit", il))
    else:
        plan += [TensorPlan(blk + "ffn_gate_exps.weight", (n_expert, n_ff, n_embd), "ffn_gate_exps", "unit", il),
                 TensorPlan(blk + "ffn_up_exps.weight", (n_expert, n_ff, n_embd), "ffn_up_exps", "unit", il)]
    plan.append(TensorPlan(blk + "ffn_down_exps.weight", (n_expert, n_embd, n_ff), "ffn_down_exps", "expert_down",
                           il))
    if spec.get("expert_biases"):  # gpt-oss: the router and every expert matrix have biases
        plan += [TensorPlan(blk + "ffn_gate_inp.bias", (n_expert,), "bias", "router_bias", il),
                 TensorPlan(blk + "ffn_gate_exps.bias", (n_expert, n_ff), "bias", "bias", il),
                 TensorPlan(blk + "ffn_up_exps.bias", (n_expert, n_ff), "bias", "bias", il),
                 TensorPlan(blk + "ffn_down_exps.bias", (n_expert, n_embd), "bias", "bias", il)]
    if spec.get("exp_probs_b"):  # DeepSeek-V3 / GLM-4.5: a per-expert bias on the selection scores only
        plan.append(TensorPlan(blk + "exp_probs_b.bias", (n_expert,), "bias", "probs_bias", il))
    if spec.get("n_shared"):
        n_shexp = spec.get("n_ff_shexp", n_ff * spec["n_shared"])
        plan += [TensorPlan(blk + "ffn_gate_shexp.weight", (n_shexp, n_embd), "ffn_gate_shexp", "unit", il),
                 TensorPlan(blk + "ffn_up_shexp.weight", (n_shexp, n_embd), "ffn_up_shexp", "unit", il),
                 TensorPlan(blk + "ffn_down_shexp.weight", (n_embd, n_shexp), "ffn_down_shexp", "down", il)]
    if spec.get("shared_gate"):  # Qwen3.5-MoE: the shared expert's output times sigmoid(h · gate)
        plan.append(TensorPlan(blk + "ffn_gate_inp_shexp.weight", (n_embd,), "norm", "shexp_gate", il))
    return plan


def _nextn_plan(spec: dict) -> list[TensorPlan]:
    """The multi-token-prediction blocks of ``spec["nextn"]`` (GLM-4.5 / DeepSeek-V3 files: after the trunk, a
    layer like the last one plus its ``nextn.*`` tensors; llama.cpp skips them unless asked for MTP)."""
    plan: list[TensorPlan] = []
    last = spec["n_layer"] - 1
    n_embd = spec["n_embd"]
    for il in range(spec["n_layer"], spec["n_layer"] + spec.get("nextn", 0)):
        plan += [replace(item, name=item.name.replace(f"blk.{last}.", f"blk.{il}.", 1))
                 for item in _layer_plan(spec, last)]
        plan += [TensorPlan(f"blk.{il}.nextn.eh_proj.weight", (n_embd, 2 * n_embd), "attn_output", "unit", last)]
        plan += [TensorPlan(f"blk.{il}.nextn.{norm}.weight", (n_embd,), "norm", "norm", last)
                 for norm in ("enorm", "hnorm", "shared_head_norm")]
    return plan


def tensor_plan(spec: dict, n_vocab: int) -> list[TensorPlan]:
    n_embd = spec["n_embd"]
    half_rot = _head_dim(spec) // 2
    tied = spec["arch"] in ("gemma2", "gemma4")
    plan = [TensorPlan("token_embd.weight", (n_vocab, n_embd), "token_embd", "embd_tied" if tied else "embd")]
    if spec["arch"] == "gemma4":  # per-layer inputs: an embedding row and a projection per token, all layers
        width = spec["keys"]["embedding_length_per_layer_input"] * spec["n_layer"]
        plan += [TensorPlan("per_layer_token_embd.weight", (n_vocab, width), "per_layer_token_embd", "embd"),
                 TensorPlan("per_layer_model_proj.weight", (width, n_embd), "per_layer_model_proj", "unit"),
                 TensorPlan("per_layer_proj_norm.weight", (spec["keys"]["embedding_length_per_layer_input"],),
                            "norm", "norm"),
                 TensorPlan("rope_freqs.weight", (spec["head_dim"] // 2,), "rope", "rope_long")]
    if "llama3_rope" in spec:
        plan.append(TensorPlan("rope_freqs.weight", (half_rot,), "rope", "llama3_rope"))
    if spec["arch"] == "phi3":
        plan.append(TensorPlan("rope_factors_long.weight", (half_rot,), "rope", "rope_long"))
        plan.append(TensorPlan("rope_factors_short.weight", (half_rot,), "rope", "rope_short"))
    for il in range(spec["n_layer"]):
        plan += _layer_plan(spec, il)
    plan += _nextn_plan(spec)
    if spec["arch"] == "lfm2":  # llama.cpp's LLM_TENSOR_OUTPUT_NORM_LFM2
        plan.append(TensorPlan("token_embd_norm.weight", (n_embd,), "norm", "norm"))
    elif spec["arch"] != "olmo":
        plan.append(TensorPlan("output_norm.weight", (n_embd,), "norm", "norm"))
    if not tied:  # Gemma-2 always ties the head to token_embd (the Gemma 4 file here too)
        plan.append(TensorPlan("output.weight", (n_vocab, n_embd), "output", "head"))
    return plan


def _llama3_rope_factors(spec: dict) -> np.ndarray:
    """Llama-3.1's per-dimension divisors, computed exactly like LlamaModel.generate_extra_tensors: float32
    arithmetic on each element (numpy 2's scalar promotion keeps ``2 * math.pi / freq`` in float32)."""
    rope = spec["llama3_rope"]
    dim, base = _head_dim(spec), spec["keys"]["rope.freq_base"]
    # base ** x in float64, rounded once to float32: numpy's vectorised float32 power differs in the last bit
    # between AVX2 and AVX-512 builds, and these bytes must be the same on every CPU (the sha256 check)
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    freqs = np.float32(1.0) / np.array([float(base) ** float(x) for x in exponents], dtype=np.float32)
    old_ctx = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / rope["low_freq_factor"], old_ctx / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            low, high = rope["low_freq_factor"], rope["high_freq_factor"]
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _draw(spec: dict, item: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    normal = lambda shape, std: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)  # noqa: E731
    shape, n_in = item.shape, item.shape[-1]
    ramp = np.linspace(0.0, 1.0, shape[0], dtype=np.float32)
    kind, _, params = item.init.partition(":")
    if kind == "embd":
        return normal(shape, 1.0)
    if kind == "embd_tied":  # input (x sqrt(n_embd)) and head at once: head logits std about 4.5
        return normal(shape, 0.28)
    if kind == "head":
        return normal(shape, 4.0 / math.sqrt(n_in))
    if kind == "sharp":  # query/key: attention scores of std ~3, so attention depends on position
        return normal(shape, 1.75 / math.sqrt(n_in))
    if kind == "unit":
        return normal(shape, 1.0 / math.sqrt(n_in))
    if kind == "down":
        return normal(shape, 1.5 / math.sqrt(n_in))
    if kind == "expert_down":
        return normal(shape, 3.0 / math.sqrt(n_in))
    if kind == "router":  # router logits of std ~3: a clear best expert, a runner-up that still counts
        return normal(shape, 3.0 / math.sqrt(n_in))
    if kind == "shexp_gate":  # gate logits of std ~2: the sigmoid spreads over (0.1, 0.9), every token's differs
        return normal(shape, 2.0 / math.sqrt(n_in))
    if kind == "router_bias":  # as large as the logits: without it other experts win
        return normal(shape, 3.0)
    if kind == "probs_bias":  # sigmoid probabilities are in (0, 1): a bias of this size reorders many of them
        return normal(shape, 0.5)
    if kind == "sinks":  # about the size of a token's best attention logit: a sink takes a good part of it
        return 3.0 + normal(shape, 1.0)
    if kind == "qkv":  # Phi-3: LongRoPE's attn_factor (1.22 on q and k) sharpens the scores 1.5x, so q/k start
        n_q, n_kv = (int(p) for p in params.split(":"))  # a little smaller than "sharp"
        scale = np.concatenate([np.full(n_q + n_kv, 1.4), np.full(n_kv, 1.0)]).astype(np.float32)
        return normal(shape, 1.0 / math.sqrt(n_in)) * scale[:, None]
    if kind == "norm":
        return 1.0 + normal(shape, 0.1)
    if kind == "small_bias":
        return normal(shape, 0.1)
    if kind == "dt_bias":  # softplus(dt + bias) around 0.05 (Mamba's dt range 0.001..0.1)
        return -3.0 + normal(shape, 0.5)
    if kind == "ssm_a":  # A = -exp(A_log): decays from -1 to -16 across the heads
        return -(1.0 + 15.0 * ramp).reshape(shape)
    if kind == "conv":  # a short convolution's taps: its K products sum to about unit size
        return normal(shape, 1.0 / math.sqrt(shape[1]))
    if kind == "gemma4_qk_norm":  # Gemma 4 attends with scale 1: q·k over 64-128 dims of this size has std ~3
        return 0.55 + normal(shape, 0.05)
    if kind == "qk_norm":
        return 2.0 + normal(shape, 0.2)
    if kind == "post_norm":  # Gemma's post norms set the size of each block's contribution to the residual
        return 6.0 + normal(shape, 0.5)
    if kind == "bias":
        return normal(shape, 0.5)
    if kind == "rope_long":
        return 1.0 + 7.0 * ramp ** 2
    if kind == "rope_short":
        return 1.0 + 0.5 * ramp
    if kind == "llama3_rope":
        return _llama3_rope_factors(spec)
    raise ValueError(f"unknown init {item.init!r}")


def _tensor_type(spec: dict, item: TensorPlan) -> GGMLType:
    if len(item.shape) == 1 or item.role == "bias":
        return GGMLType.F32
    chosen = spec["types"][item.role]
    if isinstance(chosen, list):
        chosen = chosen[item.layer]
    return GGMLType[chosen]


#: K-quant types the project cannot encode: written as random blocks of the drawn values' size (llama.cpp and
#: llmfw both decode whatever blocks the file holds)
_RANDOM_BLOCK_TYPES = {GGMLType.Q4_K, GGMLType.Q6_K}


def _random_k_blocks(values: np.ndarray, ggml_type: GGMLType, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K / Q6_K blocks of random codes whose values have about the std of ``values``, centred on zero.

    Q4_K (144 bytes: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles): value = d·sc·q - dmin·m with
    q uniform in 0..15, m ≈ 7.5·sc·d/dmin. Q6_K (210 bytes: 128 low bits, 64 high bits, 16 int8 scales, d):
    value = d·scale·(q - 32), q uniform in 0..63."""
    n_blocks = values.size // 256
    std = float(values.std())
    raw = rng.integers(0, 256, size=(n_blocks, 144 if ggml_type == GGMLType.Q4_K else 210), dtype=np.uint8)
    if ggml_type == GGMLType.Q4_K:
        d = std / 240.0
        sc = rng.integers(40, 64, size=(n_blocks, 8))
        m = np.rint(sc * 7.5 / 8.0).astype(np.int64)  # dmin = 8 d
        raw[:, 0:2] = np.full((n_blocks, 1), d, dtype=np.float16).view(np.uint8)
        raw[:, 2:4] = np.full((n_blocks, 1), 8 * d, dtype=np.float16).view(np.uint8)
        raw[:, 4:8] = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6)).astype(np.uint8)
        raw[:, 8:12] = (m[:, :4] | ((m[:, 4:] >> 4) << 6)).astype(np.uint8)
        raw[:, 12:16] = ((sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)).astype(np.uint8)
    else:
        raw[:, 192:208] = rng.integers(16, 49, size=(n_blocks, 16)).astype(np.int8).view(np.uint8)
        raw[:, 208:210] = np.full((n_blocks, 1), std / 592.0, dtype=np.float16).view(np.uint8)
    return raw


def _add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, ggml_type: GGMLType,
                rng: np.random.Generator | None = None) -> None:
    if ggml_type == GGMLType.MXFP4:  # the gguf package's MXFP4 encoder (the project has none)
        import gguf

        raw = gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
        writer.add_tensor(name, raw.reshape(-1), ggml_type, shape=tuple(reversed(values.shape)))
    elif ggml_type in _RANDOM_BLOCK_TYPES:
        assert rng is not None
        writer.add_tensor(name, _random_k_blocks(values, ggml_type, rng), ggml_type,
                          shape=tuple(reversed(values.shape)))
    elif ggml_type == GGMLType.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif ggml_type == GGMLType.F16:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(values, ggml_type), ggml_type, shape=tuple(reversed(values.shape)))


# ---------------------------------------------------------------------------------------------- files


def build_model_file(name: str, directory: str | Path) -> Path:
    """Write ``SPECS[name]`` as ``directory/<name>.gguf`` and return its path."""
    return write_spec_file(SPECS[name], name, Path(directory) / file_name(name))


def write_spec_file(spec: dict, name: str, path: Path) -> Path:
    """Write the model ``spec`` describes (``arch_specs.SPECS``' format) as ``path``; the tests' own tiny
    models (tests/support/models.py) come from here too, so there is one builder of random-weight files."""
    writer = GGUFWriter(path)
    arch = spec["arch"]
    writer.add("general.architecture", arch, GGUFValueType.STRING)
    writer.add("general.name", f"llmfw random {name}", GGUFValueType.STRING)
    for suffix, value in _arch_keys(spec).items():
        array_type = None
        if isinstance(value, list):  # per-layer values: bools (Gemma 4's window pattern) or integers
            array_type = GGUFValueType.BOOL if value and isinstance(value[0], bool) else GGUFValueType.INT32
        writer.add(f"{arch}.{suffix}", value, _key_type(suffix, value), array_type=array_type)
    vocab_keys = _vocab_keys(spec)
    for key, value, vtype, array_type in vocab_keys:
        writer.add(key, value, vtype, array_type=array_type)
    n_vocab = len(next(value for key, value, _, _ in vocab_keys if key == "tokenizer.ggml.tokens"))
    for index, item in enumerate(tensor_plan(spec, n_vocab)):
        rng = np.random.default_rng([spec["seed"], index])  # one stream per tensor: stable under plan edits
        _add_tensor(writer, item.name, _draw(spec, item, rng), _tensor_type(spec, item), rng)
    writer.write()
    return path


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    for model_name in (sys.argv[2:] or SPECS):
        built = build_model_file(model_name, out)
        print(f"{built}  {built.stat().st_size:>10}  {sha256_of(built)}")
