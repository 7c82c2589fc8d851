"""What each random-weight test model is: plain data, shared by the file builder (``arch_files.py``, run by
the tests and the generator under the project's interpreter) and the llama.cpp measuring script
(``measure_llamacpp.py``, run in the throw-away llama-cpp-python environment, which cannot import llmfw).

Only the standard library may be imported here.

Every model has 2-4 layers, a few hundred dims, an 8,192-token vocabulary cut from a real model and a mix of
F32 / F16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 tensors named and shaped like llama.cpp's converter writes them.
``types`` maps a tensor role to a ggml type name, or to a list with one type per layer.
"""
from __future__ import annotations

PROMPTS: dict[str, str] = {
    "short": "The capital of France is",
    "medium": (
        "Rivers carry water from the mountains to the sea. Along the way they cut valleys, move stones and "
        "feed the fields of the farmers who live on their banks. Every spring the snow melts and the water "
        "rises; in late summer the river is slow, warm and low."
    ),
    "long": (
        "The old lighthouse stood at the edge of the cliff for more than two hundred years. Its keeper, a quiet "
        "man named Tomas, climbed the ninety-seven steps every evening to light the lamp, and every morning he "
        "climbed them again to put it out. Ships passed in the night, their captains trusting the steady beam "
        "to warn them of the rocks below. In winter the storms were fierce: waves broke against the stones, "
        "salt crusted the windows, and the wind howled through every crack in the walls. Yet the light never "
        "failed. When the engineers finally came to replace the lamp with an automatic one, Tomas showed them "
        "the logbook he had kept since he was young: 14,612 nights, each one written in the same careful hand."
    ),
    "harbour": (
        "At dawn the harbour woke slowly. Fishermen untied their boats and checked the nets they had mended the "
        "night before, while gulls circled above the market, waiting for the first catch. A baker opened his "
        "shutters and the smell of warm bread drifted down the narrow street toward the water. Children ran "
        "past the fountain on their way to school, their bags bouncing, their voices echoing between the stone "
        "houses. By nine o'clock the boats were far out at sea, small white shapes against the grey horizon, "
        "and the harbour was quiet again except for the slap of the waves against the pier and the distant "
        "bell of the church on the hill. In the afternoon the wind turned, clouds gathered over the islands, "
        "and the harbour master raised the red flag that warned every captain to come home before the storm."
    ),
    "phi3_chat": "<|user|>\nWrite a short poem about the sea.<|end|>\n<|assistant|>\n",
    "gemma_chat": "<start_of_turn>user\nWrite a short poem about the sea.<end_of_turn>\n<start_of_turn>model\n",
}

#: greedy tokens llama.cpp appends to each prompt before the teacher-forced pass
N_CONTINUATION = 24
#: context used for the references (and by the tests)
N_CTX = 512
#: top entries stored per position
N_TOP = 20

_BPE_PROMPTS = ["short", "medium", "long"]

SPECS: dict[str, dict] = {
    "qwen2": {
        "arch": "qwen2", "vocab": "bpe", "pre": "qwen2", "seed": 1002,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 640, "context_length": 4096,
        "keys": {"rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-6},
        "types": {"token_embd": "Q8_0", "output": "F16", "attn_q": ["Q4_0", "Q5_0", "Q8_0"],
                  "attn_k": ["Q5_0", "Q8_0", "Q4_1"], "attn_v": ["Q8_0", "Q4_0", "Q5_0"], "attn_output": "Q4_1",
                  "ffn_gate": "Q4_0", "ffn_up": "Q5_0", "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    "qwen3": {
        "arch": "qwen3", "vocab": "bpe", "pre": "qwen2", "seed": 1003,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 96, "n_ff": 512,
        "context_length": 4096,
        "keys": {"rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-6},
        "types": {"token_embd": "Q4_0", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": ["Q8_0", "Q5_0", "Q4_0"],
                  "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_0",
                  "ffn_down": ["Q8_0", "F16", "Q5_0"]},
        "prompts": _BPE_PROMPTS,
    },
    "phi3": {
        # Phi-3 style: fused QKV and gate/up, LongRoPE factors (long when n_ctx > original context), a sliding
        # window in the file that llama.cpp deliberately ignores for phi3 (its loader turns SWA off).
        "arch": "phi3", "vocab": "spm_phi3", "seed": 1004,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "context_length": 4096,
        "original_context_length": 256, "sliding_window": 32,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5},
        "types": {"token_embd": "F16", "output": "Q8_0", "attn_qkv": ["Q8_0", "Q5_0", "Q4_0"],
                  "attn_output": "Q4_0", "ffn_up": "Q5_0", "ffn_down": "Q4_1"},
        "prompts": ["phi3_chat", "medium", "long"],
        # the same model once more with n_ctx <= original context: the short factors apply (llama.cpp pads
        # n_ctx to a multiple of 256, so 256 is the smallest context that can pick them)
        "extra_runs": [{"n_ctx": 256, "prompts": ["phi3_chat", "medium"]}],
    },
    "gemma2": {
        "arch": "gemma2", "vocab": "spm_gemma", "seed": 1005,
        "n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 96, "n_ff": 512,
        "context_length": 8192, "sliding_window": 32,
        "keys": {"attention.layer_norm_rms_epsilon": 1e-6, "attn_logit_softcapping": 20.0,
                 "final_logit_softcapping": 20.0},
        "types": {"token_embd": "Q8_0", "attn_q": ["Q4_0", "Q5_0", "Q8_0", "Q4_1"], "attn_k": "Q5_0",
                  "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1",
                  "ffn_down": "Q5_0"},
        # "long" + "harbour" (~330 tokens) outgrows the sliding-window cache of a small ubatch (256 cells)
        "prompts": ["gemma_chat", "medium", "long", "long+harbour"],
    },
    "olmo": {
        "arch": "olmo", "vocab": "bpe", "pre": "olmo", "seed": 1006,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 4, "n_ff": 512, "context_length": 4096,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_epsilon": 1e-5, "attention.clamp_kqv": 3.0},
        "types": {"token_embd": "F16", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q4_1",
                  "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    # llama with each rope scaling type llama.cpp reads from a file (issue 4)
    "llama-rope-linear": {
        "arch": "llama", "vocab": "bpe", "pre": "smollm", "seed": 1011,
        "n_layer": 2, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "context_length": 8192,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5,
                 "rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
        "types": {"token_embd": "Q8_0", "output": "F16", "attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q5_0",
                  "attn_output": "Q4_1", "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    "llama-rope-yarn": {
        "arch": "llama", "vocab": "bpe", "pre": "smollm", "seed": 1012,
        "n_layer": 2, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "context_length": 256,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5,
                 "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                 "rope.scaling.original_context_length": 64, "rope.scaling.attn_factor": 0.8},
        "types": {"token_embd": "Q8_0", "output": "F16", "attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q5_0",
                  "attn_output": "Q4_1", "ffn_gate": "Q5_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    "llama-rope-llama3": {
        # Llama-3.1 style: no scaling type key, per-dimension factors in rope_freqs.weight
        "arch": "llama", "vocab": "bpe", "pre": "smollm", "seed": 1013,
        "n_layer": 2, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "context_length": 8192,
        "llama3_rope": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64},
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5},
        "types": {"token_embd": "Q8_0", "output": "F16", "attn_q": "Q5_0", "attn_k": "Q4_1", "attn_v": "Q8_0",
                  "attn_output": "Q4_0", "ffn_gate": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q5_0"},
        "prompts": _BPE_PROMPTS,
    },
    # mixture-of-experts families (issue 33), 8-16 experts. Which experts a token gets flips at a near-tie when
    # the hidden state moves by the rounding of llama.cpp's quantized activations (Q8 blocks, ~0.4%), and a flip
    # swaps a whole expert's output: every tensor a router's input depends on is F16/F32 (llama.cpp rounds those
    # activations to f16 only), the router itself F32. The quantized blocks — K-quants (Q4_K, Q6_K) and
    # legacy ones — are where a rounding difference cannot change a routing decision: the embedding (looked
    # up exactly), the last layer's experts (after its router) and the output head.
    "qwen3moe": {
        "arch": "qwen3moe", "vocab": "bpe", "pre": "qwen2", "seed": 1033,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 768,
        "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 256, "context_length": 4096,
        "keys": {"rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-6},
        "types": {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "F16", "attn_k": "F16", "attn_v": "F16",
                  "attn_output": "F16", "ffn_gate_inp": "F32", "ffn_gate_exps": ["F16", "F16", "Q4_K"],
                  "ffn_up_exps": ["F16", "F16", "Q8_0"], "ffn_down_exps": ["F16", "F16", "Q6_K"]},
        "prompts": _BPE_PROMPTS,
    },
    "olmoe": {
        "arch": "olmoe", "vocab": "bpe", "pre": "olmo", "seed": 1034,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 4, "n_ff": 256,
        "n_expert": 16, "n_expert_used": 4, "context_length": 4096,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5},
        "types": {"token_embd": "Q8_0", "output": "Q4_K", "attn_q": "F16", "attn_k": "F16", "attn_v": "F16",
                  "attn_output": "F16", "ffn_gate_inp": "F32", "ffn_gate_exps": ["F16", "F16", "Q4_0"],
                  "ffn_up_exps": ["F16", "F16", "Q4_K"], "ffn_down_exps": ["F16", "F16", "Q5_0"]},
        "prompts": _BPE_PROMPTS,
    },
    "llama-moe": {
        # Mixtral-style llama: 8 experts, 2 used, the chosen weights renormalised
        "arch": "llama", "vocab": "bpe", "pre": "smollm", "seed": 1035,
        "n_layer": 2, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 256,
        "n_expert": 8, "n_expert_used": 2, "context_length": 4096,
        "keys": {"rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-5},
        "types": {"token_embd": "Q4_K", "output": "Q8_0", "attn_q": "F16", "attn_k": "F16", "attn_v": "F16",
                  "attn_output": "F16", "ffn_gate_inp": "F32", "ffn_gate_exps": ["F16", "Q4_1"],
                  "ffn_up_exps": ["F16", "Q4_K"], "ffn_down_exps": ["F16", "Q6_K"]},
        "prompts": _BPE_PROMPTS,
    },
    "gpt-oss": {
        # attention sinks, a 32-token window on even layers, YaRN, biases everywhere, softmax after top-k,
        # clamped SwiGLU; MXFP4 experts in the last layer
        "arch": "gpt-oss", "vocab": "bpe", "pre": "gpt-4o", "seed": 1036,
        "n_layer": 3, "n_embd": 256, "n_head": 8, "n_head_kv": 2, "head_dim": 32, "n_ff": 256,
        "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 256, "context_length": 4096, "sliding_window": 32,
        "original_context_length": 64, "expert_biases": True,
        "keys": {"rope.freq_base": 150000.0, "attention.layer_norm_rms_epsilon": 1e-5,
                 "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0},
        "types": {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "F16", "attn_k": "F16", "attn_v": "F16",
                  "attn_output": "F16", "ffn_gate_inp": "F32", "ffn_gate_exps": ["F16", "F16", "MXFP4"],
                  "ffn_up_exps": ["F16", "F16", "MXFP4"], "ffn_down_exps": ["F16", "F16", "MXFP4"]},
        "prompts": _BPE_PROMPTS,
    },
    "glm4moe": {
        # a dense first layer, then 16 experts in 4 groups (the best 2 groups' experts eligible), sigmoid
        # gating with a selection bias, top-4 renormalised and scaled by 2.5, one shared expert, per-head Q/K
        # norms, Q/K/V biases, rope on half of each head
        "arch": "glm4moe", "vocab": "bpe", "pre": "glm4", "seed": 1037,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 512,
        "n_expert": 16, "n_expert_used": 4, "n_ff_exp": 256, "n_dense_lead": 1, "n_shared": 1, "exp_probs_b": True,
        "context_length": 4096,
        "keys": {"rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-5, "rope.dimension_count": 32,
                 "leading_dense_block_count": 1, "expert_shared_count": 1, "expert_weights_scale": 2.5,
                 "expert_weights_norm": True, "expert_gating_func": 2, "expert_group_count": 4,
                 "expert_group_used_count": 2},
        "types": {"token_embd": "Q6_K", "output": "Q4_K", "attn_q": "F16", "attn_k": "F16", "attn_v": "F16",
                  "attn_output": "F16", "ffn_gate": "F16", "ffn_up": "F16", "ffn_down": "F16",
                  "ffn_gate_inp": "F32", "ffn_gate_exps": [None, "F16", "Q4_K"], "ffn_up_exps": [None, "F16", "Q5_0"],
                  "ffn_down_exps": [None, "F16", "Q6_K"], "ffn_gate_shexp": [None, "F16", "Q8_0"],
                  "ffn_up_shexp": [None, "F16", "Q4_K"], "ffn_down_shexp": [None, "F16", "Q4_1"]},
        "prompts": _BPE_PROMPTS,
    },
    "deepseek2": {
        # DeepSeek-V3 style: multi-head latent attention (q_lora 128, kv_lora 128, rope 32 + nope 64 per head,
        # values 64), a dense first layer, 16 experts in 4 groups (2 used), sigmoid gating with a selection bias,
        # top-4 renormalised and scaled by 2.5, a shared expert, the last layer's gate/up experts fused
        "arch": "deepseek2", "vocab": "bpe", "pre": "deepseek-v3", "seed": 1038,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 1, "n_ff": 512,
        "mla": {"q_lora": 128, "kv_lora": 128, "rope": 32, "nope": 64, "v": 64},
        "n_expert": 16, "n_expert_used": 4, "n_ff_exp": 256, "n_dense_lead": 1, "n_shared": 1, "exp_probs_b": True,
        "fused_gate_up_layers": [2], "context_length": 4096,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": 32,
                 "attention.key_length": 160, "attention.value_length": 128, "attention.key_length_mla": 96,
                 "attention.value_length_mla": 64, "attention.q_lora_rank": 128, "attention.kv_lora_rank": 128,
                 "leading_dense_block_count": 1, "expert_shared_count": 1, "expert_weights_scale": 2.5,
                 "expert_weights_norm": True, "expert_gating_func": 2, "expert_group_count": 4,
                 "expert_group_used_count": 2},
        "types": {"token_embd": "Q8_0", "output": "Q6_K", "attn_q_a": "F16", "attn_q_b": "F16",
                  "attn_kv_a_mqa": "F16", "attn_k_b": "F16", "attn_v_b": "F16", "attn_output": "F16",
                  "ffn_gate": "F16", "ffn_up": "F16", "ffn_down": "F16", "ffn_gate_inp": "F32",
                  "ffn_gate_exps": [None, "F16", None], "ffn_up_exps": [None, "F16", None],
                  "ffn_gate_up_exps": [None, None, "Q4_K"], "ffn_down_exps": [None, "F16", "Q6_K"],
                  "ffn_gate_shexp": [None, "F16", "Q8_0"], "ffn_up_shexp": [None, "F16", "Q4_0"],
                  "ffn_down_shexp": [None, "F16", "Q5_0"]},
        "prompts": _BPE_PROMPTS,
    },
    # issue 34's dense newcomers
    "smollm3": {
        # every fourth layer without RoPE (layer 3 of 4)
        "arch": "smollm3", "vocab": "bpe", "pre": "smollm", "seed": 1021,
        "n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "context_length": 4096,
        "keys": {"rope.freq_base": 50000.0, "attention.layer_norm_rms_epsilon": 1e-6},
        "types": {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": ["Q4_0", "Q5_0", "Q8_0", "Q4_1"],
                  "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0", "ffn_up": "Q5_0",
                  "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    "granite": {
        # all four multipliers set away from 1 (and from their defaults)
        "arch": "granite", "vocab": "bpe", "pre": "smollm", "seed": 1022,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "context_length": 4096,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "logit_scale": 0.7,
                 "residual_scale": 0.6, "embedding_scale": 2.5, "attention.scale": 0.2},
        "types": {"token_embd": "Q8_0", "output": "F16", "attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q4_0",
                  "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_0", "ffn_down": "Q5_0"},
        "prompts": _BPE_PROMPTS,
    },
    "mistral3": {
        # YaRN with the log multiplier, and the attention temperature growing every 64 positions
        "arch": "mistral3", "vocab": "bpe", "pre": "smollm", "seed": 1023,
        "n_layer": 3, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "n_ff": 512, "context_length": 4096,
        "keys": {"rope.freq_base": 100000.0, "attention.layer_norm_rms_epsilon": 1e-5,
                 "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                 "rope.scaling.original_context_length": 64, "rope.scaling.yarn_log_multiplier": 1.0,
                 "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
                 "attention.temperature_scale": 0.5},
        "types": {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q4_1",
                  "attn_output": "Q4_0", "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q4_0"},
        "prompts": _BPE_PROMPTS,
    },
    # issue 34's hybrids: recurrent layers beside attention
    "lfm2": {
        # convolution layers 0, 1, 3 (no KV heads), attention layers 2 and 4; kernel width 3
        "arch": "lfm2", "vocab": "bpe", "pre": "smollm", "seed": 1031,
        "n_layer": 5, "n_embd": 256, "n_head": 4, "n_head_kv": [0, 0, 2, 0, 2], "n_ff": 512,
        "context_length": 4096, "l_cache": 3,
        "keys": {"rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-5, "shortconv.l_cache": 3},
        "types": {"token_embd": "Q8_0", "output": "Q8_0", "shortconv_conv": "F32", "shortconv_in": "F16",
                  "shortconv_out": ["Q8_0", "Q5_0", None, "Q8_0", None], "attn_q": "Q8_0", "attn_k": "Q5_0",
                  "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    "granitehybrid": {
        # dense Granite 4.0-H: Mamba-2 layers 0, 1, 3 (8 heads of 64, 2 groups, state 32, conv width 4) and
        # attention on layer 2, Granite's multipliers
        "arch": "granitehybrid", "vocab": "bpe", "pre": "smollm", "seed": 1032,
        "n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": [0, 0, 2, 0], "n_ff": 512, "context_length": 4096,
        "ssm": {"conv_kernel": 4, "inner_size": 512, "state_size": 32, "time_step_rank": 8, "group_count": 2},
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "logit_scale": 0.8,
                 "residual_scale": 0.7, "embedding_scale": 2.0, "attention.scale": 0.15},
        "types": {"token_embd": "Q8_0", "output": "Q8_0", "ssm_in": "Q8_0", "ssm_f32": "F32",
                  "ssm_out": ["Q8_0", "Q5_0", None, "Q8_0"], "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q5_0",
                  "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    "qwen35": {
        # Gated DeltaNet layers 0-2 (4 value heads, 2 key heads of 32, conv width 4), gated attention on layer 3
        # with partial rotary (32 of 64 dims) in interleaved M-RoPE sections [6, 5, 5, 0]
        "arch": "qwen35", "vocab": "bpe", "pre": "qwen2", "seed": 1033,
        "n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 512,
        "context_length": 4096,
        "ssm": {"conv_kernel": 4, "inner_size": 128, "state_size": 32, "time_step_rank": 4, "group_count": 2},
        "keys": {"rope.freq_base": 10000000.0, "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": 32,
                 "rope.dimension_sections": [6, 5, 5, 0], "full_attention_interval": 4},
        "types": {"token_embd": "Q8_0", "output": "Q8_0", "attn_qkv": "Q8_0", "attn_gate": "Q8_0",
                  "ssm_f32": "F32", "ssm_small": "F16", "ssm_out": ["Q8_0", "Q5_0", "Q8_0", None], "attn_q": "Q8_0",
                  "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q5_0",
                  "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    # the hybrids' MoE variants: as the MoE files above, every tensor a router's input depends on is F16/F32 (the
    # recurrent layers' projections included), the quantized ones are the embedding, the last layer's experts
    # and the head
    "qwen35moe": {
        # qwen35's layout (Gated DeltaNet layers 0-2, gated attention on layer 3) with 8 experts of 128, top-2
        # renormalised, and a 256-wide shared expert behind a sigmoid gate in every layer
        "arch": "qwen35moe", "vocab": "bpe", "pre": "qwen2", "seed": 1041,
        "n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff": 512,
        "n_expert": 8, "n_expert_used": 2, "n_ff_exp": 128, "n_shared": 1, "n_ff_shexp": 256, "shared_gate": True,
        "context_length": 4096,
        "ssm": {"conv_kernel": 4, "inner_size": 128, "state_size": 32, "time_step_rank": 4, "group_count": 2},
        "keys": {"rope.freq_base": 10000000.0, "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": 32,
                 "rope.dimension_sections": [6, 5, 5, 0], "full_attention_interval": 4,
                 "expert_shared_feed_forward_length": 256},
        "types": {"token_embd": "Q8_0", "output": "Q6_K", "attn_qkv": "F16", "attn_gate": "F16",
                  "ssm_f32": "F32", "ssm_small": "F16", "ssm_out": "F16", "attn_q": "F16", "attn_k": "F16",
                  "attn_v": "F16", "attn_output": "F16", "ffn_gate_inp": "F32",
                  "ffn_gate_exps": ["F16", "F16", "F16", "Q4_K"], "ffn_up_exps": ["F16", "F16", "F16", "Q8_0"],
                  "ffn_down_exps": ["F16", "F16", "F16", "Q5_0"], "ffn_gate_shexp": ["F16", "F16", "F16", "Q8_0"],
                  "ffn_up_shexp": ["F16", "F16", "F16", "Q4_K"], "ffn_down_shexp": ["F16", "F16", "F16", "Q5_0"]},
        "prompts": _BPE_PROMPTS,
    },
    "granitehybrid-moe": {
        # Granite 4.0-H's MoE: the granitehybrid layout with 8 experts of feed_forward_length 256, top-2
        # renormalised, and a 512-wide shared expert (expert_shared_feed_forward_length) in every layer
        "arch": "granitehybrid", "vocab": "bpe", "pre": "smollm", "seed": 1042,
        "n_layer": 4, "n_embd": 256, "n_head": 4, "n_head_kv": [0, 0, 2, 0], "n_ff": 256, "context_length": 4096,
        "n_expert": 8, "n_expert_used": 2, "n_shared": 1, "n_ff_shexp": 512,
        "ssm": {"conv_kernel": 4, "inner_size": 512, "state_size": 32, "time_step_rank": 8, "group_count": 2},
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5, "logit_scale": 0.8,
                 "residual_scale": 0.7, "embedding_scale": 2.0, "attention.scale": 0.15,
                 "expert_shared_feed_forward_length": 512},
        "types": {"token_embd": "Q4_K", "output": "Q8_0", "ssm_in": "F16", "ssm_f32": "F32", "ssm_out": "F16",
                  "attn_q": "F16", "attn_k": "F16", "attn_v": "F16", "attn_output": "F16", "ffn_gate_inp": "F32",
                  "ffn_gate_exps": ["F16", "F16", "F16", "Q4_K"], "ffn_up_exps": ["F16", "F16", "F16", "Q5_0"],
                  "ffn_down_exps": ["F16", "F16", "F16", "Q6_K"], "ffn_gate_shexp": ["F16", "F16", "F16", "Q4_0"],
                  "ffn_up_shexp": ["F16", "F16", "F16", "Q8_0"], "ffn_down_shexp": ["F16", "F16", "F16", "Q4_K"]},
        "prompts": _BPE_PROMPTS,
    },
    "nemotron_h": {
        # Nemotron-H: Mamba-2 layers 0 and 3 (8 heads of 64, 2 groups, state 32, conv width 4), attention without
        # RoPE on layer 2, ungated ReLU² MLPs (with an up bias) on layers 1 and 4; one block per layer
        "arch": "nemotron_h", "vocab": "bpe", "pre": "smollm", "seed": 1043,
        "n_layer": 5, "n_embd": 256, "n_head": 4, "n_head_kv": [0, 0, 2, 0, 0], "n_ff": [0, 512, 0, 0, 512],
        "context_length": 4096,
        "ssm": {"conv_kernel": 4, "inner_size": 512, "state_size": 32, "time_step_rank": 8, "group_count": 2},
        "keys": {"attention.layer_norm_epsilon": 1e-5},
        "types": {"token_embd": "Q8_0", "output": "Q8_0", "ssm_in": "Q8_0", "ssm_f32": "F32",
                  "ssm_out": ["Q8_0", None, None, "Q5_0", None], "attn_q": "Q8_0", "attn_k": "Q8_0",
                  "attn_v": "Q5_0", "attn_output": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0"},
        "prompts": _BPE_PROMPTS,
    },
    "gemma4": {
        # Gemma 4: local (32-token window, head 64, rope 64, base 1e4) and global (head 128, rope_freqs, base 1e6)
        # layers alternating, the last two sharing the KV caches of layers 2 and 3, layer 1 without attn_v, per-layer
        # inputs of 64, output scales, final soft-capping; Gemma's SPM vocab
        "arch": "gemma4", "vocab": "spm_gemma", "seed": 1044,
        "n_layer": 6, "n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 128, "n_ff": 512,
        "context_length": 8192, "sliding_window": 32, "k_eq_v_layers": [1],
        "keys": {"attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1000000.0, "rope.freq_base_swa": 10000.0,
                 "rope.dimension_count": 128, "rope.dimension_count_swa": 64, "attention.key_length_swa": 64,
                 "attention.value_length_swa": 64, "embedding_length_per_layer_input": 64,
                 "attention.shared_kv_layers": 2, "final_logit_softcapping": 30.0,
                 "attention.sliding_window_pattern": [True, False, True, False, True, False]},
        # mostly F16: llama.cpp rounds the activations of a quantized matmul to 8 bits and six layers of Gemma's
        # large post-norms amplify that (all F16: mean_lp_err 0.01; Q8_0 in most matmuls: 0.09-0.15; Q4/Q5 blocks
        # everywhere: 0.15-0.21, near the bar with a correct engine). The embedding tables are looked up, not
        # multiplied (the tied head is the one Q8_0 matmul left beside two Q8_0 layer tensors)
        "types": {"token_embd": "Q8_0", "per_layer_token_embd": "Q5_0", "per_layer_model_proj": "F16",
                  "attn_q": ["Q8_0", "F16", "F16", "F16", "F16", "F16"], "attn_k": "F16", "attn_v": "F16",
                  "attn_output": "F16", "ffn_gate": "F16", "ffn_up": "F16",
                  "ffn_down": ["F16", "F16", "F16", "F16", "F16", "Q8_0"], "inp_gate": "F16", "proj": "F16"},
        "prompts": ["gemma_chat", "medium", "long", "long+harbour"],
    },
}

#: the mixture-of-experts models, by the family the tests name them
SPECS["deepseek2-yarn"] = {
    # DeepSeek V2/V3's YaRN: factor 4 from a 64-token original context (the prompts cross it), mscale_all_dim 0.707
    # written as the converter does (yarn_log_multiplier = 0.1 * 0.707); the attention scale and the rope
    # magnitude follow llama.cpp's deepseek2 rules. Like DeepSeek-V3 files, one multi-token-prediction block after
    # the trunk (nextn_predict_layers 1: block_count 4), which llama.cpp skips and so must llmfw
    **{k: v for k, v in SPECS["deepseek2"].items() if k != "keys"}, "seed": 1041, "nextn": 1,
    "keys": {**SPECS["deepseek2"]["keys"], "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
             "rope.scaling.original_context_length": 64, "rope.scaling.yarn_log_multiplier": 0.0707,
             "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0},
}

SPECS["glm4moe-mtp"] = {
    # glm4moe with GLM-4.5's multi-token-prediction block after the trunk (nextn_predict_layers 1, block_count 4)
    **SPECS["glm4moe"], "seed": 1042, "nextn": 1,
}

MOE_MODELS = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "llama (Mixtral)": "llama-moe", "gpt-oss": "gpt-oss",
              "glm4moe": "glm4moe", "deepseek2": "deepseek2", "deepseek2 (YaRN)": "deepseek2-yarn",
              "glm4moe (MTP block)": "glm4moe-mtp", "qwen35moe": "qwen35moe", "granitehybrid (MoE)": "granitehybrid-moe"}


def prompt_text(key: str) -> str:
    """The text of a prompt key; ``"a+b"`` is prompt a, a space, then prompt b."""
    return " ".join(PROMPTS[part] for part in key.split("+"))


def file_name(name: str) -> str:
    return f"{name}.gguf"


def reference_name(name: str) -> str:
    return f"{name}.json"
