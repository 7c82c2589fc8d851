"""GGUF string arrays (vocabularies, merges) have two readers: the C loop of llmfw/core/format/_strings.c, which reads
every item it can, and the Python loop, which reads the rest (refills, long strings, errors). Whatever the bytes,
reading with the C loop's help gives exactly what the Python loop alone gives: the same strings, the same end offset,
the same error."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from llmfw.core.errors import GGUFError
from llmfw.core.format import gguf_header
from llmfw.core.format.gguf_header import _LARGE_STRING, Cursor

HAS_COMPILER = bool(shutil.which("cc") or shutil.which("gcc"))


def item(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def read(path: Path, data: bytes, prefix: int | None, count: int, python_only: bool) -> tuple[str, object]:
    """The array at offset 0 of ``data`` (in ``path``): its strings and end offset, or the error's message. With
    ``prefix``, the cursor starts as in read mode with only that many bytes of the file in its buffer."""
    with open(path, "rb") as fh:
        cursor = Cursor(path, len(data), data if prefix is None else data[:prefix], None if prefix is None else fh)
        out = [""] * count
        try:
            if python_only:
                cursor._python_strings(out, 0, count, "tokens")
            else:
                out = cursor.string_array(count, "tokens")
        except GGUFError as exc:
            return "error", str(exc)
        return "read", (out, cursor.pos)


ITEMS = st.one_of(st.text(max_size=12).map(str.encode), st.binary(max_size=6),
                  st.sampled_from([b"\xff", b"\xc3(", b"\xe2\x82", "Ġthe".encode(), "▁".encode(), b""]))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine: only the Python loop is built")
def test_the_c_loop_is_built_where_there_is_a_compiler() -> None:
    assert gguf_header._c_decode_strings is not None, "setup.py's _strings extension is missing: run `pip install -e .`"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(ITEMS, max_size=40), extra=st.integers(0, 3), cut=st.integers(0, 10**6),
       prefix=st.one_of(st.none(), st.integers(0, 10**6)), huge=st.booleans())
def test_with_or_without_the_c_loop_the_same_strings_or_the_same_error(tmp_path: Path, items: list[bytes],
                                                                       extra: int, cut: int, prefix: int | None,
                                                                       huge: bool) -> None:
    raw = b"".join(map(item, items))
    if huge:  # a length no metadata string may have, after the items
        raw += struct.pack("<Q", 1 << 62)
    data = raw[:cut % (len(raw) + 1)] if cut % 3 == 0 else raw  # a third of the arrays cut short
    count = len(items) + (extra if huge or cut % 3 == 0 else 0)
    path = tmp_path / "strings.bin"
    path.write_bytes(data)
    start = None if prefix is None else prefix % (len(data) + 1)
    assert read(path, data, start, count, python_only=False) == read(path, data, start, count, python_only=True)


def test_a_long_string_among_short_ones_is_read_by_the_python_loop_in_its_place(tmp_path: Path) -> None:
    long = ("ж" * (_LARGE_STRING // 2 + 5)).encode()
    items = [b"a", long, "ü".encode(), b"", long[:_LARGE_STRING - 2] + b"z"]  # the longest the C loop takes
    data = b"".join(map(item, items))
    path = tmp_path / "strings.bin"
    path.write_bytes(data)
    for prefix in (None, 0, 20):
        kind, (strings, end) = read(path, data, prefix, len(items), python_only=False)  # type: ignore[misc]
        assert kind == "read" and strings == [text.decode() for text in items] and end == len(data)


@pytest.mark.skipif(gguf_header._c_decode_strings is None, reason="the C loop is not built")
def test_the_c_loop_reads_no_byte_past_the_bytes_it_is_told_are_valid() -> None:
    decode = gguf_header._c_decode_strings
    data = item(b"abc") + item(b"defg")
    out = ["", ""]
    assert decode(data, 0, len(data) - 1, out, 0, 100) == (1, 11)  # the second item's last byte is not valid yet
    assert out == ["abc", ""]
    assert decode(data, 11, 10**9, out, 1, 100) == (2, len(data))  # a claim past the buffer's end is cut to it
    assert out == ["abc", "defg"]
    assert decode(data, 0, len(data), ["", ""], 0, 2) == (0, 0)  # longer than the limit: left to Python
    with pytest.raises(ValueError, match="negative"):
        decode(data, -1, len(data), out, 0, 100)
