"""Property test: mutated GGUF headers produce only llmfw errors (never another exception, a hang or a huge
allocation). Inputs are a small written model and the first 64 KiB of the real SmolLM2 file."""
from __future__ import annotations

import struct
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmfw.core.errors import LLMFWError
from llmfw.core.gguf import open_gguf

from support.gguf_files import write_small_model

#: the most one open may allocate for a mutated input of at most 64 KiB (tracemalloc peak)
ALLOCATION_LIMIT = 8 << 20
REAL_PREFIX_BYTES = 64 << 10
TOKENS_KEY = "tokenizer.ggml.tokens"

with tempfile.TemporaryDirectory(prefix="llmfw-gguf-fuzz-") as _folder:  # the bytes are needed at collection
    _SMALL = write_small_model(Path(_folder) / "small.gguf").read_bytes()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Where the mutated files are written (pytest's temporary folders are cleaned up, a module-level mkdtemp
    was not)."""
    return tmp_path_factory.mktemp("gguf-fuzz")


@pytest.fixture(scope="module")
def real_prefix(smollm2_path: Path) -> bytes:
    """The first 64 KiB of SmolLM2's real header made into a valid file: its first key-value pairs, the token
    array cut to the strings that fit, no tensors (so mutations reach the vocab loop, not just the cut)."""
    with smollm2_path.open("rb") as fh:
        data = bytearray(fh.read(REAL_PREFIX_BYTES))
    with open_gguf(smollm2_path) as g:
        n_kv = list(g.metadata).index(TOKENS_KEY) + 1
    count_at = data.index(TOKENS_KEY.encode()) + len(TOKENS_KEY) + 4 + 4  # after the ARRAY and STRING tags
    pos, n_tokens = count_at + 8, 0
    while pos + 8 <= len(data) and pos + 8 + struct.unpack_from("<Q", data, pos)[0] <= len(data):
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        n_tokens += 1
    struct.pack_into("<QQ", data, 8, 0, n_kv)
    struct.pack_into("<Q", data, count_at, n_tokens)
    return bytes(data[:pos])


# values that stress counts, lengths, types and offsets when written over any field
_INTERESTING = [0, 1, 2, 3, 5, 9, 13, 31, 32, 33, 255, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
                2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutations(draw, focus: int) -> list[tuple[float, bytes]]:
    """A few (relative position, new bytes) edits; positions lean towards the first ``focus`` bytes."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.one_of(st.integers(0, focus - 1), st.integers(0, 2**31)))
        kind = draw(st.sampled_from(["bytes", "u32", "u64"]))
        if kind == "bytes":
            new = draw(st.binary(min_size=1, max_size=8))
        else:
            value = draw(st.sampled_from(_INTERESTING))
            new = struct.pack("<I", value & 0xFFFFFFFF) if kind == "u32" else struct.pack("<Q", value)
        edits.append((where, new))
    return edits


def _apply(data: bytes, edits: list[tuple[int, bytes]], cut: int | None) -> bytes:
    buf = bytearray(data)
    for where, new in edits:
        where %= len(buf)
        buf[where:where + len(new)] = new[: len(buf) - where]
    return bytes(buf[:cut] if cut else buf)


def _open_and_touch(work: Path, data: bytes, mode: str) -> None:
    """Open the mutated bytes; only llmfw errors may escape; allocations stay bounded."""
    path = work / f"mutated-{mode}.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            with open_gguf(path, mode) as g:
                for name in g.tensors:  # every tensor that validated must be readable
                    assert g.tensor_bytes(name).size == g.tensors[name].nbytes
        except LLMFWError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < ALLOCATION_LIMIT, f"{peak} bytes allocated for a {len(data)}-byte input"


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_SETTINGS
@given(edits=mutations(focus=len(_SMALL)), cut=st.one_of(st.none(), st.integers(1, len(_SMALL))),
       mode=st.sampled_from(["mmap", "read"]))
def test_mutated_small_model(work: Path, edits, cut, mode) -> None:
    _open_and_touch(work, _apply(_SMALL, edits, cut), mode)


@_SETTINGS
@given(edits=mutations(focus=2048), mode=st.sampled_from(["mmap", "read"]))
def test_mutated_real_header(work: Path, real_prefix: bytes, edits, mode) -> None:
    _open_and_touch(work, _apply(real_prefix, edits, None), mode)


def test_unmutated_inputs_open(work: Path, real_prefix: bytes) -> None:
    """Sanity: both inputs are valid before mutation, so the mutations are what the reader must survive."""
    small = work / "small.gguf"
    small.write_bytes(_SMALL)
    with open_gguf(small) as g:
        assert len(g.tensors) == 3 and np.isfinite(g.tensor_array("token_embd.weight")).all()
    path = work / "prefix.gguf"
    path.write_bytes(real_prefix)
    with open_gguf(path) as g:
        assert g.architecture == "llama" and g.tensors == {}
        assert 1000 < len(g.metadata[TOKENS_KEY]) < 49152
