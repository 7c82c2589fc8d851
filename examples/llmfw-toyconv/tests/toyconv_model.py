"""A tiny random-weight ``toyconv`` file (written with llmfw's own GGUF writer) and a plain-numpy implementation of
the same network, the oracle the plugin's logits are checked against. Float32 weights: the oracle is exact."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from llmfw.core.gguf import GGUFValueType as VT, GGUFWriter

N_EMBD, N_FF, N_LAYER, WIDTH, EPS = 32, 64, 2, 3, 1e-6
#: a small SentencePiece vocabulary: control tokens, then single letters and a few words
PIECES = ["<unk>", "<s>", "</s>"] + [f"▁{w}" for w in "the a sea of is and to in it was".split()] + \
    list("abcdefghijklmnopqrstuvwxyz") + ["▁"]


def _weights(seed: int) -> dict[str, np.ndarray]:
    """name -> numpy array (rows of ne0 contiguous values, as GGUF stores them)."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    n_vocab = len(PIECES)
    w = {"token_embd.weight": normal(n_vocab, N_EMBD, std=1.0),
         "output_norm.weight": 1 + normal(N_EMBD, std=0.1),
         "output.weight": normal(n_vocab, N_EMBD, std=4 / np.sqrt(N_EMBD))}
    for il in range(N_LAYER):
        p = f"blk.{il}."
        w |= {p + "attn_norm.weight": 1 + normal(N_EMBD, std=0.1),
              p + "conv.weight": normal(N_EMBD, WIDTH, std=1 / np.sqrt(WIDTH)),
              p + "conv_in.weight": normal(3 * N_EMBD, N_EMBD, std=1 / np.sqrt(N_EMBD)),
              p + "conv_out.weight": normal(N_EMBD, N_EMBD, std=1 / np.sqrt(N_EMBD)),
              p + "ffn_norm.weight": 1 + normal(N_EMBD, std=0.1),
              p + "ffn_gate.weight": normal(N_FF, N_EMBD, std=1 / np.sqrt(N_EMBD)),
              p + "ffn_up.weight": normal(N_FF, N_EMBD, std=1 / np.sqrt(N_EMBD)),
              p + "ffn_down.weight": normal(N_EMBD, N_FF, std=1 / np.sqrt(N_FF))}
    return w


def write_toyconv(path: Path, seed: int = 7) -> Path:
    writer = GGUFWriter(path)
    writer.add("general.architecture", "toyconv", VT.STRING)
    for key, value in {"context_length": 1024, "embedding_length": N_EMBD, "block_count": N_LAYER,
                       "feed_forward_length": N_FF, "attention.head_count": 1, "conv_width": WIDTH}.items():
        writer.add(f"toyconv.{key}", value, VT.UINT32)
    writer.add("toyconv.attention.layer_norm_rms_epsilon", EPS, VT.FLOAT32)
    writer.add("tokenizer.ggml.model", "llama", VT.STRING)
    writer.add("tokenizer.ggml.tokens", PIECES, VT.ARRAY, array_type=VT.STRING)
    writer.add("tokenizer.ggml.scores", [0.0] * 3 + [-float(i) for i in range(len(PIECES) - 3)], VT.ARRAY,
               array_type=VT.FLOAT32)
    writer.add("tokenizer.ggml.token_type", [2, 3, 3] + [1] * (len(PIECES) - 3), VT.ARRAY, array_type=VT.INT32)
    for key, value in {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}.items():
        writer.add(f"tokenizer.ggml.{key}", value, VT.UINT32)
    for name, array in _weights(seed).items():
        writer.add_tensor(name, array)
    writer.write()
    return path


def _rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + EPS)).astype(np.float32) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def oracle_logits(tokens: list[int], seed: int = 7) -> np.ndarray:
    """The network of ``llmfw_toyconv`` written out in numpy, one sequence from an empty state: [T, n_vocab]."""
    w = _weights(seed)
    x = w["token_embd.weight"][tokens]
    for il in range(N_LAYER):
        p = f"blk.{il}."
        h = _rms_norm(x, w[p + "attn_norm.weight"]) @ w[p + "conv_in.weight"].T
        gate_in, gate_out, u = np.split(h, 3, axis=-1)
        bx = np.concatenate([np.zeros((WIDTH - 1, N_EMBD), np.float32), gate_in * u])
        kernel = w[p + "conv.weight"]  # [C, K]
        conv = sum(bx[k:k + len(tokens)] * kernel[:, k] for k in range(WIDTH))
        x = x + (gate_out * conv) @ w[p + "conv_out.weight"].T
        h = _rms_norm(x, w[p + "ffn_norm.weight"])
        x = x + (_silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    return _rms_norm(x, w["output_norm.weight"]) @ w["output.weight"].T
