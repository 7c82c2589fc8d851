"""A tiny llama with a SentencePiece vocabulary (byte fallback) that needs no download, and click's CliRunner over
the llmfw command: what the in-process CLI tests share."""
from __future__ import annotations

import numpy as np
from click.testing import CliRunner

from llmfw.cli import cli
from llmfw.core.gguf import GGUFValueType, GGUFWriter

#: the tiny vocabulary's word pieces after the control tokens and the 256 byte tokens
PIECES = ["▁hello", "▁world", "hello", "world", "▁", "▁▁"]


def write_tiny_model(path, *, chat_template: str | None = None, n_ff: int = 64, quantized_ffn: bool = False,
                     architecture: str = "llama", ffn_type: str = "Q8_0"):
    """A 2-layer llama with a byte-fallback SPM vocabulary (``<0x0A>`` is a newline piece): fast to write and to
    load, enough for every command. ``quantized_ffn``: the FFN matrices in ``ffn_type`` (a backend converts them)."""
    from llmfw.core.quants import GGMLType, quantize

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(PIECES))]
    n_vocab, n_embd, n_head, n_head_kv, n_layer = len(tokens), 32, 4, 2, 2
    head = n_embd // n_head
    rng = np.random.default_rng(0)
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    metadata = [("general.architecture", architecture, None), (f"{architecture}.context_length", 256, u32),
                (f"{architecture}.embedding_length", n_embd, u32), (f"{architecture}.block_count", n_layer, u32),
                (f"{architecture}.feed_forward_length", n_ff, u32),
                (f"{architecture}.attention.head_count", n_head, u32),
                (f"{architecture}.attention.head_count_kv", n_head_kv, u32),
                (f"{architecture}.attention.layer_norm_rms_epsilon", 1e-5, f32),
                ("tokenizer.ggml.model", "llama", None), ("tokenizer.ggml.tokens", tokens, None),
                ("tokenizer.ggml.scores", np.array(scores, dtype=np.float32), None),
                ("tokenizer.ggml.token_type", np.array(types, dtype=np.int32), None),
                ("tokenizer.ggml.bos_token_id", 1, u32), ("tokenizer.ggml.eos_token_id", 2, u32),
                ("tokenizer.ggml.unknown_token_id", 0, u32)]
    if chat_template is not None:
        metadata.append(("tokenizer.chat_template", chat_template, None))
    with GGUFWriter(path) as w:
        for key, value, value_type in metadata:
            w.add(key, value, value_type)
        shapes = {"token_embd.weight": (n_vocab, n_embd), "output_norm.weight": (n_embd,)}
        for il in range(n_layer):
            shapes.update({f"blk.{il}.attn_norm.weight": (n_embd,), f"blk.{il}.attn_q.weight": (n_head * head, n_embd),
                           f"blk.{il}.attn_k.weight": (n_head_kv * head, n_embd),
                           f"blk.{il}.attn_v.weight": (n_head_kv * head, n_embd),
                           f"blk.{il}.attn_output.weight": (n_embd, n_head * head),
                           f"blk.{il}.ffn_norm.weight": (n_embd,),
                           f"blk.{il}.ffn_gate.weight": (n_ff, n_embd), f"blk.{il}.ffn_up.weight": (n_ff, n_embd),
                           f"blk.{il}.ffn_down.weight": (n_embd, n_ff)})
        for name, shape in shapes.items():
            values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            if quantized_ffn and ".ffn_" in name and len(shape) == 2:
                w.add_tensor(name, quantize(values, GGMLType[ffn_type]), GGMLType[ffn_type], shape=shape[::-1])
            else:
                w.add_tensor(name, values)
    return path


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input)
