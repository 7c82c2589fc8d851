"""Variants of the random-weight model files: the same model with tensors llama.cpp marks ``TENSOR_NOT_REQUIRED``
left out, or written another way llama.cpp also accepts (a fused ``attn_qkv`` for separate Q/K/V).

A variant is written from a built file (``arch_files.build_model_file``, whose bytes the tests check) with
llmfw's GGUF reader and writer: every key copied with its type, every tensor copied byte for byte unless the
edit drops or replaces it. The builders' own bytes never change, so llama.cpp's references stay valid.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from llmfw.core.format.gguf import GGUFWriter, open_gguf
from llmfw.core.format.quants import dequantize


def write_variant(source: Path, target: Path, *, drop: Iterable[str] = (),
                  replace: Mapping[str, np.ndarray] | None = None,
                  raw_copies: Mapping[str, str] | None = None) -> Path:
    """``source`` rewritten as ``target``: tensors in ``drop`` left out, those in ``replace`` written as the given
    float32 arrays (numpy shape; a name not in the source is added), ``raw_copies`` {new name: source tensor}
    added as byte copies of another tensor."""
    dropped, replaced, copies = set(drop), dict(replace or {}), dict(raw_copies or {})
    with open_gguf(source) as gguf:
        writer = GGUFWriter(target)
        for key, value in gguf.metadata.items():
            if key != "general.alignment":
                writer.add(key, value, gguf.metadata_types[key], array_type=gguf.metadata_array_types.get(key))
        for name, info in gguf.tensors.items():
            if name in dropped:
                continue
            if name in replaced:
                writer.add_tensor(name, np.ascontiguousarray(replaced.pop(name), dtype=np.float32))
                continue
            writer.add_tensor(name, np.array(gguf.tensor_bytes(name)), info.ggml_type, shape=info.shape)
        for name, values in replaced.items():
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        for name, original in copies.items():
            info = gguf.tensor_info(original)
            writer.add_tensor(name, np.array(gguf.tensor_bytes(original)), info.ggml_type, shape=info.shape)
        writer.write()
    return target


def float_tensor(path: Path, name: str) -> np.ndarray:
    """A tensor of ``path`` decoded to float32 (numpy shape)."""
    with open_gguf(path) as gguf:
        info = gguf.tensor_info(name)
        return dequantize(np.array(gguf.tensor_bytes(name)), info.ggml_type, info.shape)


def tensor_names(path: Path) -> list[str]:
    with open_gguf(path) as gguf:
        return list(gguf.tensors)


def fused_qkv_edits(path: Path, n_layer: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """For every layer: (separate Q/K/V decoded to float32, the same rows fused as ``attn_qkv``, names to drop),
    so a file with separate float32 projections and one with fused ones hold the same numbers."""
    separate: dict[str, np.ndarray] = {}
    fused: dict[str, np.ndarray] = {}
    names: list[str] = []
    for il in range(n_layer):
        parts = [f"blk.{il}.attn_{part}.weight" for part in "qkv"]
        arrays = [float_tensor(path, name) for name in parts]
        separate.update(zip(parts, arrays))
        fused[f"blk.{il}.attn_qkv.weight"] = np.concatenate(arrays, axis=0)
        names += parts
    return separate, fused, names
