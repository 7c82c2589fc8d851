"""The converted-weight cache writes its blob in whole 2 MiB pieces at offsets that are multiples of 2 MiB
(llmfw/core/exec/weight_cache.py's PieceWriter), so a file system with large folios keeps it as huge pages: whatever
the sizes of the arrays handed to it, every write but the last is one whole piece, and the file holds exactly the
bytes handed over, in order."""
from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmfw.core.exec.weight_cache import PieceWriter

pytestmark = pytest.mark.fast


class RecordingFile(io.BytesIO):
    """A file in memory that remembers the size of every write it was handed."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def write(self, data) -> int:  # type: ignore[override]
        self.sizes.append(len(memoryview(data).cast("B")))
        return super().write(data)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=300), max_size=12), piece=st.sampled_from([1, 7, 64, 256]))
def test_every_write_but_the_last_is_a_whole_piece_and_the_bytes_are_kept(sizes, piece):
    rng = np.random.default_rng(len(sizes) * 1000 + piece)
    parts = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    out = RecordingFile()
    writer = PieceWriter(out, piece)
    for part in parts:
        writer.write(part.data)
    writer.finish()
    assert out.getvalue() == b"".join(part.tobytes() for part in parts)
    assert all(size == piece for size in out.sizes[:-1])
    assert out.sizes[-1] <= piece


def test_the_default_piece_is_a_huge_page():
    out = RecordingFile()
    writer = PieceWriter(out)
    writer.write(bytes(5 << 20))
    writer.finish()
    assert out.sizes == [2 << 20, 2 << 20, 1 << 20] and len(out.getvalue()) == 5 << 20
