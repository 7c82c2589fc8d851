"""Parsing a GGUF file's header: the preamble, the metadata, the tensor infos — every count, length and offset
checked against the bytes the file has before anything is allocated for it (see :mod:`.gguf`)."""
from __future__ import annotations

import codecs
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np

from ..errors import GGUFError, QuantError
from .gguf_types import (DEFAULT_ALIGNMENT, GGUF_MAGIC, INT64_MAX, KEY_ALIGNMENT, MAX_ARRAY_NESTING, MAX_DIMS,
                         MAX_NAME_BYTES, SUPPORTED_VERSIONS, GGUFValueType)
from .gguf_types import INT_RANGES as _INT_RANGES, NUMPY_DTYPE as _NUMPY_DTYPE, STRUCT as _STRUCT
from .gguf_types import U64 as _U64, align_up as _align_up
from .quants import TYPE_INFO, GGMLType, ggml_type

try:  # the optional C loop over string arrays (setup.py builds it when a C compiler is there)
    from ._strings import decode_strings as _built_decode_strings

    _c_decode_strings: Callable[[Any, int, int, list[str], int, int], tuple[int, int]] | None = _built_decode_strings
except ImportError:  # pragma: no cover - an install without a C compiler
    _c_decode_strings = None

#: the fewest bytes one array item of a type can take (strings: the length; arrays: type + count)
_MIN_ITEM_BYTES = {**{t: d.itemsize for t, d in _NUMPY_DTYPE.items()}, GGUFValueType.STRING: 8,
                   GGUFValueType.ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies. ``shape`` is in ggml order: ``ne0`` (the contiguous dimension) first."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # absolute byte offset in its file
    nbytes: int
    file_index: int  # index into GGUFFile.paths

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


# ----------------------------------------------------------------------------------------------- reading


#: from this length on a string is decoded in place instead of being copied out of the buffer first
_LARGE_STRING = 1 << 20
#: the longest metadata string read (the largest real ones, embedded tokenizer files and chat templates, are far
#: smaller): a damaged length can otherwise claim most of the file, and Python may hold up to four bytes per
#: character of it
MAX_STRING_BYTES = 16 << 20


def _decode_utf8(buf: Any, start: int, end: int) -> str:
    """UTF-8 text of ``buf[start:end]``. A long one is decoded through a memoryview, so a huge length in a damaged
    header costs one string of at most the file's size, not a copy of the bytes as well."""
    if end - start < _LARGE_STRING:
        return str(buf[start:end].decode("utf-8"))
    with memoryview(buf) as view, view[start:end] as part:  # released at once: a bytearray must stay resizable
        # validated chunk by chunk first: a UnicodeDecodeError keeps a copy of all the bytes it was given
        decoder = codecs.getincrementaldecoder("utf-8")()
        for offset in range(0, len(part), _LARGE_STRING):
            with part[offset:offset + _LARGE_STRING] as chunk:
                try:
                    decoder.decode(chunk, final=offset + _LARGE_STRING >= len(part))
                except UnicodeDecodeError as exc:
                    raise UnicodeDecodeError("utf-8", b"", offset + exc.start, offset + exc.end, exc.reason) \
                        from None
        return codecs.utf_8_decode(part, "strict", True)[0]


class Cursor:
    """Sequential reader over one file's header with bounds checks.

    ``buf`` is the whole mapping (mmap mode) or a growing prefix of the file read on demand (read mode);
    ``available`` is how many bytes of ``buf`` are valid. Every read checks against ``size`` (the file size)
    before touching or allocating anything.
    """

    def __init__(self, path: Path, size: int, buf: Any, fh: BinaryIO | None):
        self.path = path
        self.size = size
        self.buf = buf
        self.available = size if fh is None else len(buf)
        self.fh = fh
        self.pos = 0

    # -- bounds ---------------------------------------------------------------------------------------
    def remaining(self) -> int:
        return self.size - self.pos

    def fail(self, message: str) -> GGUFError:
        return GGUFError(f"{self.path}: {message}")

    def need(self, nbytes: int, what: str) -> None:
        end = self.pos + nbytes
        if end > self.available:
            if end > self.size:
                raise self.fail(f"truncated {what} at offset {self.pos}: needs {nbytes} bytes, "
                                f"the file has {self.size - self.pos} left (file size {self.size})")
            self._fill(end)

    def _fill(self, end: int) -> None:
        """Read mode: extend the buffer to at least ``end`` (doubling, so the header is read in a few calls)."""
        if self.fh is None:  # mmap mode: the whole file is available, so this is never reached
            raise self.fail(f"read past the mapped file at offset {self.available}")
        target = min(self.size, max(end, 2 * self.available, 1 << 20))
        self.fh.seek(self.available)
        chunk = self.fh.read(target - self.available)
        if len(chunk) != target - self.available:
            raise self.fail(f"the file shrank while being read (expected {self.size} bytes)")
        self.buf += chunk
        self.available = target

    def check_count(self, count: int, min_item_bytes: int, what: str) -> None:
        """Reject a count whose items could not fit in the rest of the file, before allocating anything."""
        if count * min_item_bytes > self.remaining():
            raise self.fail(f"{what} claims {count} items of at least {min_item_bytes} bytes each at offset "
                            f"{self.pos}, but only {self.remaining()} bytes remain in the file")

    # -- primitives -----------------------------------------------------------------------------------
    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        unpacker = _STRUCT[vtype]
        self.need(unpacker.size, what)
        (value,) = unpacker.unpack_from(self.buf, self.pos)
        self.pos += unpacker.size
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str) -> str:
        start = self.pos
        length = self.u64(f"length of {what}")
        if length > MAX_STRING_BYTES:
            raise self.fail(f"{what} at offset {start} claims {length} bytes, more than the {MAX_STRING_BYTES} a "
                            "metadata string may hold")
        self.need(length, what)
        end = self.pos + length
        try:
            text = _decode_utf8(self.buf, self.pos, end)
            self.pos = end
            return text
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at offset {start} is not valid UTF-8 ({exc.reason} at byte {exc.start})") \
                from None

    def numeric_array(self, vtype: GGUFValueType, count: int, what: str) -> np.ndarray:
        dtype = _NUMPY_DTYPE[vtype]
        self.need(count * dtype.itemsize, what)
        # copy (once): metadata must not pin the mapping (close() would fail) and must be native-endian & writable
        raw = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return raw.astype(bool) if vtype == GGUFValueType.BOOL else raw.astype(dtype.newbyteorder("="))

    def string_array(self, count: int, what: str) -> list[str]:
        """A string array's items. The C loop (when built) reads every item it can; an item it stops at (one past
        the bytes read so far, a long one, bad UTF-8) is read by the Python loop, which refills, decodes or raises."""
        # sized once (the caller checked count against the bytes left): growing by append would briefly hold the
        # old and the new list, twice the memory a damaged count may claim
        out: list[str] = [""] * count
        if _c_decode_strings is None:
            self._python_strings(out, 0, count, what)
            return out
        index = 0
        while True:
            index, self.pos = _c_decode_strings(self.buf, self.pos, self.available, out, index, _LARGE_STRING - 1)
            if index == count:
                return out
            self._python_strings(out, index, index + 1, what)
            index += 1

    def _python_strings(self, out: list[str], first: int, stop: int, what: str) -> None:
        """Items ``first`` to ``stop`` of a string array into ``out``. The hot loop when the C one is not built
        (262144 strings for Gemma-3): locals only, two integer bounds tests per item; the buffer is only refilled
        (read mode) when a test fails."""
        buf, pos, available = self.buf, self.pos, self.available
        unpack_len = _U64.unpack_from
        index = first
        try:
            for index in range(first, stop):
                end = pos + 8
                if end > available:
                    self.pos = pos
                    self.need(8, f"length of item {index} of {what}")
                    buf, available = self.buf, self.available
                (length,) = unpack_len(buf, pos)
                start, end = end, end + length
                if length > MAX_STRING_BYTES:
                    raise self.fail(f"item {index} of {what} at offset {pos} claims {length} bytes, more than the "
                                    f"{MAX_STRING_BYTES} a metadata string may hold")
                if end > available:
                    self.pos = start
                    self.need(length, f"item {index} of {what}")
                    buf, available = self.buf, self.available
                out[index] = buf[start:end].decode("utf-8") if length < _LARGE_STRING else _decode_utf8(buf, start, end)
                pos = end
        except UnicodeDecodeError as exc:
            raise self.fail(f"item {index} of {what} at offset {start} is not valid UTF-8 "
                            f"({exc.reason} at byte {exc.start})") from None
        self.pos = pos


def _read_value_type(cur: Cursor, what: str) -> GGUFValueType:
    offset = cur.pos
    raw = cur.u32(f"value type of {what}")
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"{what} has unknown value type {raw} at offset {offset} "
                       f"(expected 0..{max(GGUFValueType)})") from None


def _read_array(cur: Cursor, what: str, depth: int) -> tuple[Any, GGUFValueType]:
    """One array (after its ARRAY tag): returns the value and its element type."""
    if depth > MAX_ARRAY_NESTING:
        raise cur.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING} levels at offset {cur.pos}")
    elem_type = _read_value_type(cur, f"elements of {what}")
    count = cur.u64(f"element count of {what}")
    cur.check_count(count, _MIN_ITEM_BYTES[elem_type], f"{what} ({elem_type.name} array)")
    if elem_type == GGUFValueType.STRING:
        return cur.string_array(count, what), elem_type
    if elem_type == GGUFValueType.ARRAY:
        return [_read_array(cur, f"{what}[{i}]", depth + 1)[0] for i in range(count)], elem_type
    return cur.numeric_array(elem_type, count, what), elem_type


def _read_value(cur: Cursor, vtype: GGUFValueType, what: str) -> tuple[Any, GGUFValueType | None]:
    """A value of ``vtype``: returns (python value, array element type or None)."""
    if vtype == GGUFValueType.STRING:
        return cur.string(what), None
    if vtype == GGUFValueType.ARRAY:
        return _read_array(cur, what, 1)
    value = cur.scalar(vtype, what)
    return (bool(value) if vtype == GGUFValueType.BOOL else value), None


@dataclass
class FileHeader:
    """Everything parsed from one file of a (possibly split) model."""

    path: Path
    size: int
    version: int
    alignment: int
    data_offset: int
    metadata: dict[str, Any] = field(default_factory=dict)
    metadata_types: dict[str, GGUFValueType] = field(default_factory=dict)
    metadata_array_types: dict[str, GGUFValueType] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    #: tensors whose data lies past the end of the file (kept only when the caller allows cut data)
    cut: list[str] = field(default_factory=list)


def _read_preamble(cur: Cursor) -> tuple[int, int, int]:
    if cur.size < 4:
        raise cur.fail(f"not a GGUF file: {cur.size} bytes, too short for the magic b'GGUF'")
    cur.need(4, "magic")
    magic = bytes(cur.buf[0:4])
    if magic != GGUF_MAGIC:
        raise cur.fail(f"not a GGUF file: magic {magic!r}, expected {GGUF_MAGIC!r}")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version and version & 0xFFFF == 0 else ""
        raise cur.fail(f"unsupported version {version}{hint}; supported: "
                       f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("key-value count")
    # the smallest possible entries must fit in the rest of the file, else the counts are lies
    needed = n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES
    if needed > cur.remaining():
        raise cur.fail(f"header claims {n_kv} key-value pairs and {n_tensors} tensors (at least {needed} bytes), "
                       f"but only {cur.remaining()} bytes follow the header")
    return version, n_tensors, n_kv


def _read_metadata(cur: Cursor, n_kv: int, header: FileHeader) -> None:
    for index in range(n_kv):
        key_offset = cur.pos
        key = cur.string(f"key {index}")
        if key in header.metadata:
            raise cur.fail(f"duplicate key {key!r} (key {index}, at offset {key_offset})")
        vtype = _read_value_type(cur, f"key {key!r}")
        value, array_type = _read_value(cur, vtype, f"value of {key!r}")
        header.metadata[key] = value
        header.metadata_types[key] = vtype
        if array_type is not None:
            header.metadata_array_types[key] = array_type


def _alignment_of(cur: Cursor, metadata: dict[str, Any], types: dict[str, GGUFValueType]) -> int:
    if KEY_ALIGNMENT not in metadata:
        return DEFAULT_ALIGNMENT
    value = metadata[KEY_ALIGNMENT]
    if types[KEY_ALIGNMENT] not in _INT_RANGES or value <= 0 or value & (value - 1):
        raise cur.fail(f"{KEY_ALIGNMENT} must be a power of two > 0, found {value!r} "
                       f"({types[KEY_ALIGNMENT].name})")
    return int(value)


def _read_tensor_info(cur: Cursor, index: int, seen: set[str]) -> tuple[str, tuple[int, ...], GGMLType, int]:
    """One tensor info: (name, ne, type, offset relative to the data section)."""
    name_offset = cur.pos
    name = cur.string(f"name of tensor {index}")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise cur.fail(f"tensor {index} name {name[:80]!r} is longer than {MAX_NAME_BYTES} bytes")
    if name in seen:
        raise cur.fail(f"duplicate tensor name {name!r} (tensor {index}, at offset {name_offset})")
    n_dims = cur.u32(f"n_dims of tensor {name!r}")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {n_dims} dimensions, at most {MAX_DIMS} are allowed")
    cur.need(8 * n_dims, f"shape of tensor {name!r}")
    shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
    cur.pos += 8 * n_dims
    n_elements = 1
    for axis, dim in enumerate(shape):
        if not 0 < dim <= INT64_MAX:
            raise cur.fail(f"tensor {name!r} dimension {axis} is {dim}, expected 1..{INT64_MAX}")
        n_elements *= dim
    if n_elements > INT64_MAX:
        raise cur.fail(f"tensor {name!r} with shape {list(shape)} has {n_elements} elements, more than int64 holds")
    type_offset = cur.pos
    raw_type = cur.u32(f"type of tensor {name!r}")
    try:
        tensor_type = ggml_type(raw_type)
    except QuantError:
        raise QuantError(f"{cur.path}: tensor {name!r} has unknown ggml type id {raw_type} "
                         f"at offset {type_offset}") from None
    offset = cur.u64(f"data offset of tensor {name!r}")
    return name, shape, tensor_type, offset


def _tensor_nbytes(cur: Cursor, name: str, shape: tuple[int, ...], tensor_type: GGMLType) -> int:
    info = TYPE_INFO[tensor_type]
    row = shape[0] if shape else 1
    if row % info.block_size:
        raise cur.fail(f"tensor {name!r} of type {tensor_type.name} has rows of {row} elements, not a multiple of "
                       f"its block size {info.block_size}")
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    return n_elements // info.block_size * info.type_size


def _read_tensor_infos(cur: Cursor, n_tensors: int, header: FileHeader, file_index: int,
                       seen: set[str], allow_cut_data: bool = False) -> None:
    raw: list[tuple[str, tuple[int, ...], GGMLType, int, int]] = []
    for index in range(n_tensors):
        name, shape, tensor_type, offset = _read_tensor_info(cur, index, seen)
        seen.add(name)
        raw.append((name, shape, tensor_type, offset, _tensor_nbytes(cur, name, shape, tensor_type)))
    header.data_offset = _align_up(cur.pos, header.alignment)
    data_size = cur.size - header.data_offset
    for name, shape, tensor_type, offset, nbytes in raw:
        if offset % header.alignment:
            raise cur.fail(f"tensor {name!r} data offset {offset} is not a multiple of the alignment "
                           f"{header.alignment}")
        if offset + nbytes > data_size and allow_cut_data:
            header.cut.append(name)
        elif offset + nbytes > data_size:
            raise cur.fail(f"tensor {name!r} ({nbytes} bytes at data offset {offset}, absolute "
                           f"{header.data_offset + offset}) lies outside the file: the data section has "
                           f"{max(data_size, 0)} bytes (file truncated?)")
        header.tensors.append(TensorInfo(name, shape, tensor_type, header.data_offset + offset, nbytes, file_index))
    _check_no_overlap(cur, header.tensors)


def _check_no_overlap(cur: Cursor, tensors: list[TensorInfo]) -> None:
    by_offset = sorted(tensors, key=lambda t: t.offset)
    for before, after in zip(by_offset, by_offset[1:]):
        if after.offset < before.offset + before.nbytes:
            raise cur.fail(f"tensors {before.name!r} [{before.offset}, {before.offset + before.nbytes}) and "
                           f"{after.name!r} [{after.offset}, {after.offset + after.nbytes}) overlap")


def parse_header(cur: Cursor, file_index: int, seen_names: set[str], allow_cut_data: bool = False) -> FileHeader:
    version, n_tensors, n_kv = _read_preamble(cur)
    header = FileHeader(cur.path, cur.size, version, DEFAULT_ALIGNMENT, 0)
    _read_metadata(cur, n_kv, header)
    header.alignment = _alignment_of(cur, header.metadata, header.metadata_types)
    _read_tensor_infos(cur, n_tensors, header, file_index, seen_names, allow_cut_data)
    return header
