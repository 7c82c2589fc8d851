"""Tiny random-weight models built on the fly: no download, a few hundred kilobytes, loaded in milliseconds.

They come from the one builder of random-weight files, ``reference_gen/arch_files.py`` (the same writer the
llama.cpp-referenced architecture models use), with SmolLM2's committed 8k-token BPE vocabulary; edits (a
dropped tensor, a tensor of the wrong shape) go through ``reference_gen/variant_files.py``."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from reference_gen.arch_files import write_spec_file
from reference_gen.variant_files import write_variant

#: the vocabulary of every tiny llama (``reference_gen/arch_files.py``'s SmolLM2 8k cut)
TINY_N_VOCAB = 8192
TINY_N_EMBD = 32


def tiny_llama_spec(arch: str = "llama", seed: int = 31) -> dict:
    """A 2-layer llama (GQA 4/2 heads, all F32, a 128-token training context) in ``arch_specs``' format."""
    matrices = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                "ffn_down")
    return {
        "arch": arch, "vocab": "bpe", "pre": "smollm", "seed": seed,
        "n_layer": 2, "n_embd": TINY_N_EMBD, "n_head": 4, "n_head_kv": 2, "n_ff": 64, "context_length": 128,
        "keys": {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5},
        "types": dict.fromkeys(matrices, "F32"),
    }


def write_tiny_llama(path: Path, *, arch: str = "llama", q_shape: tuple[int, int] | None = None,
                     drop: tuple[str, ...] = (), tied: bool = True, seed: int = 31) -> Path:
    """A 2-layer random llama as ``path``: the head tied to ``token_embd`` unless ``tied`` is False, the
    tensors in ``drop`` left out, every layer's ``attn_q`` of numpy shape ``q_shape`` when given, its weights
    drawn with ``seed``."""
    path = Path(path)
    base = write_spec_file(tiny_llama_spec(arch, seed), "tiny-llama", path.with_name(path.stem + "-base.gguf"))
    replace = {}
    if q_shape is not None:
        rng = np.random.default_rng(0)
        replace = {f"blk.{il}.attn_q.weight": rng.standard_normal(q_shape).astype(np.float32) * 0.1
                   for il in range(2)}
    write_variant(base, path, drop=(*drop, "output.weight") if tied else drop, replace=replace)
    base.unlink()
    return path
