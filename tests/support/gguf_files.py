"""Small GGUF files for the reader's tests (not models: every kind of key and three tensor types)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from llmfw.core.format.gguf import GGUFValueType as VT, GGUFWriter
from llmfw.core.format.quants import GGMLType


def write_small_model(path: Path, *, version: int = 3, **writer_options) -> Path:
    """A small but complete file: every kind of key and three tensors of different types."""
    rng = np.random.default_rng(0)
    with GGUFWriter(path, version=version, **writer_options) as w:
        w.add("general.architecture", "llama")
        w.add("llama.block_count", 2, VT.UINT32)
        w.add("llama.rope.freq_base", 10000.0)
        w.add("tokenizer.ggml.add_bos_token", True)
        w.add("tokenizer.ggml.tokens", ["<s>", "</s>", "héllo", "", "▁wörld"])
        w.add("tokenizer.ggml.scores", np.array([0.0, -1.0, -2.5, 3.0, 4.0], dtype=np.float32))
        w.add("tokenizer.ggml.token_type", np.array([3, 3, 1, 1, 1], dtype=np.int32))
        w.add("nested", [[1, 2], [3]])
        w.add_tensor("token_embd.weight", rng.standard_normal((5, 8)).astype(np.float32))
        w.add_tensor("norm.weight", rng.standard_normal(8).astype(np.float16))
        w.add_tensor("blk.0.q8", rng.integers(0, 256, 2 * 34, dtype=np.uint8), GGMLType.Q8_0, (32, 2))
    return path
