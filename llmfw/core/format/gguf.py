"""GGUF reader (v2 and v3, mmap or plain reads, split files) and writer.

File layout (little endian)::

    magic b"GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count × (key: string, value_type u32, value)
    tensor_count × (name: string, n_dims u32, ne[n_dims] u64, ggml_type u32, offset u64)
    padding up to `general.alignment` (default 32) — the data section starts here
    tensor data; each tensor's offset is relative to the data section start

A string is a u64 byte length followed by UTF-8 bytes; an array is the element type u32, the count u64 and the
items (arrays of arrays are allowed). Versions 2 and 3 share this layout for little-endian files.

Every value the header claims (counts, lengths, offsets, dimensions) is checked against the bytes the file
actually has *before* anything is allocated for it, so a malformed or hostile file fails fast with a
:class:`~llmfw.core.errors.GGUFError` (or :class:`~llmfw.core.errors.QuantError` for an unknown tensor type) that
says what was expected, what was found and where.

Zero-copy and closing: in ``mode="mmap"`` each file is mapped once and :meth:`GGUFFile.tensor_bytes` returns numpy
views into the mapping. A view keeps its mapping alive: :meth:`GGUFFile.close` unmaps every file that no view
still uses and drops its own reference to the others, which the operating system then unmaps when the last view
is garbage collected. Metadata values are always copies, so they never pin a mapping.
"""
from __future__ import annotations

import codecs
import io
import mmap
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Literal

import numpy as np

from ..errors import GGUFError, QuantError
from .quants import TYPE_INFO, GGMLType, ggml_type

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64 including the terminating NUL
MAX_ARRAY_NESTING = 8  # arrays of arrays deeper than this are rejected (bounds recursion)
INT64_MAX = 2**63 - 1
KEY_ALIGNMENT = "general.alignment"
KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS = "split.tensors.count"

_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

Mode = Literal["mmap", "read"]


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


#: little-endian numpy dtype of every fixed-size value type
_NUMPY_DTYPE: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("u1"),
    GGUFValueType.INT8: np.dtype("i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
_STRUCT: dict[GGUFValueType, struct.Struct] = {
    t: struct.Struct("<" + {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "f4": "f",
                            "u8": "Q", "i8": "q", "f8": "d"}[d.str[1:]])
    for t, d in _NUMPY_DTYPE.items()
}
_U32 = _STRUCT[GGUFValueType.UINT32]
_U64 = _STRUCT[GGUFValueType.UINT64]
#: the fewest bytes one array item of a type can take (strings: the length; arrays: type + count)
_MIN_ITEM_BYTES = {**{t: d.itemsize for t, d in _NUMPY_DTYPE.items()}, GGUFValueType.STRING: 8,
                   GGUFValueType.ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset

_INT_RANGES = {
    GGUFValueType.UINT8: (0, 2**8 - 1), GGUFValueType.INT8: (-(2**7), 2**7 - 1),
    GGUFValueType.UINT16: (0, 2**16 - 1), GGUFValueType.INT16: (-(2**15), 2**15 - 1),
    GGUFValueType.UINT32: (0, 2**32 - 1), GGUFValueType.INT32: (-(2**31), 2**31 - 1),
    GGUFValueType.UINT64: (0, 2**64 - 1), GGUFValueType.INT64: (-(2**63), 2**63 - 1),
}


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


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


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


class _Cursor:
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
        """The hot loop for vocabularies (262144 strings for Gemma-3): locals only, two integer bounds tests per
        item; the buffer is only refilled (read mode) when a test fails."""
        buf, pos, available = self.buf, self.pos, self.available
        unpack_len = _U64.unpack_from
        # sized once (the caller checked count against the bytes left): growing by append would briefly hold
        # the old and the new list, twice the memory a damaged count may claim
        out: list[str] = [""] * count
        index = 0
        try:
            for index in range(count):
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
        return out


def _read_value_type(cur: _Cursor, what: str) -> GGUFValueType:
    offset = cur.pos
    raw = cur.u32(f"value type of {what}")
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise cur.fail(f"{what} has unknown value type {raw} at offset {offset} "
                       f"(expected 0..{max(GGUFValueType)})") from None


def _read_array(cur: _Cursor, what: str, depth: int) -> tuple[Any, GGUFValueType]:
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


def _read_value(cur: _Cursor, vtype: GGUFValueType, what: str) -> tuple[Any, GGUFValueType | None]:
    """A value of ``vtype``: returns (python value, array element type or None)."""
    if vtype == GGUFValueType.STRING:
        return cur.string(what), None
    if vtype == GGUFValueType.ARRAY:
        return _read_array(cur, what, 1)
    value = cur.scalar(vtype, what)
    return (bool(value) if vtype == GGUFValueType.BOOL else value), None


@dataclass
class _FileHeader:
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


def _read_preamble(cur: _Cursor) -> tuple[int, int, int]:
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


def _read_metadata(cur: _Cursor, n_kv: int, header: _FileHeader) -> None:
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


def _alignment_of(cur: _Cursor, metadata: dict[str, Any], types: dict[str, GGUFValueType]) -> int:
    if KEY_ALIGNMENT not in metadata:
        return DEFAULT_ALIGNMENT
    value = metadata[KEY_ALIGNMENT]
    if types[KEY_ALIGNMENT] not in _INT_RANGES or value <= 0 or value & (value - 1):
        raise cur.fail(f"{KEY_ALIGNMENT} must be a power of two > 0, found {value!r} "
                       f"({types[KEY_ALIGNMENT].name})")
    return int(value)


def _read_tensor_info(cur: _Cursor, index: int, seen: set[str]) -> tuple[str, tuple[int, ...], GGMLType, int]:
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


def _tensor_nbytes(cur: _Cursor, name: str, shape: tuple[int, ...], tensor_type: GGMLType) -> int:
    info = TYPE_INFO[tensor_type]
    row = shape[0] if shape else 1
    if row % info.block_size:
        raise cur.fail(f"tensor {name!r} of type {tensor_type.name} has rows of {row} elements, not a multiple of "
                       f"its block size {info.block_size}")
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    return n_elements // info.block_size * info.type_size


def _read_tensor_infos(cur: _Cursor, n_tensors: int, header: _FileHeader, file_index: int,
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


def _check_no_overlap(cur: _Cursor, tensors: list[TensorInfo]) -> None:
    by_offset = sorted(tensors, key=lambda t: t.offset)
    for before, after in zip(by_offset, by_offset[1:]):
        if after.offset < before.offset + before.nbytes:
            raise cur.fail(f"tensors {before.name!r} [{before.offset}, {before.offset + before.nbytes}) and "
                           f"{after.name!r} [{after.offset}, {after.offset + after.nbytes}) overlap")


def _parse_header(cur: _Cursor, file_index: int, seen_names: set[str], allow_cut_data: bool = False) -> _FileHeader:
    version, n_tensors, n_kv = _read_preamble(cur)
    header = _FileHeader(cur.path, cur.size, version, DEFAULT_ALIGNMENT, 0)
    _read_metadata(cur, n_kv, header)
    header.alignment = _alignment_of(cur, header.metadata, header.metadata_types)
    _read_tensor_infos(cur, n_tensors, header, file_index, seen_names, allow_cut_data)
    return header


# ----------------------------------------------------------------------------------------------- files


def _check_regular_file(path: Path) -> int:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise GGUFError(f"{path}: no such file") from None
    except OSError as exc:
        raise GGUFError(f"{path}: cannot access: {exc.strerror or exc}") from None
    if path.is_dir():
        raise GGUFError(f"{path}: is a directory, expected a GGUF file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a regular file, expected a GGUF file")
    if st.st_size == 0:
        raise GGUFError(f"{path}: empty file, expected a GGUF file")
    return st.st_size


def split_paths(path: str | os.PathLike[str]) -> list[Path] | None:
    """All parts of a split model named ``prefix-0000N-of-0000M.gguf``, or None if the name is not a split's."""
    path = Path(path)
    match = _SPLIT_NAME.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    if count < 1 or not 1 <= int(match["no"]) <= count:
        raise GGUFError(f"{path}: split file name says part {int(match['no'])} of {count}")
    return [path.with_name(split_file_name(match["prefix"], i, count)) for i in range(count)]


def split_file_name(prefix: str, index: int, count: int) -> str:
    """llama.cpp's split naming: ``prefix-00001-of-00003.gguf`` for ``index`` 0 of 3."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def _pread_into(handle: io.BufferedReader, view: memoryview, offset: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(handle.fileno(), [view], offset)
    handle.seek(offset)  # platforms without preadv: a plain seek + read (not thread-safe)
    return handle.readinto(view) or 0


def _map_read_only(path: Path) -> mmap.mmap:
    """The whole file mapped read-only (the mapping outlives the file object)."""
    with path.open("rb") as fh:
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)


class _OpenFile:
    """One open file: its mapping (mmap mode) or handle (read mode)."""

    def __init__(self, path: Path, mode: Mode):
        self.path = path
        self.size = _check_regular_file(path)
        self.mapping: mmap.mmap | None = None
        self.handle: io.BufferedReader | None = None
        try:
            if mode == "mmap":
                self.mapping = _map_read_only(path)
            else:
                self.handle = path.open("rb")
        except OSError as exc:
            raise GGUFError(f"{path}: cannot open: {exc.strerror or exc}") from None

    def cursor(self) -> _Cursor:
        if self.mapping is not None:
            return _Cursor(self.path, self.size, self.mapping, None)
        return _Cursor(self.path, self.size, bytearray(), self.handle)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        if self.mapping is not None:
            return np.frombuffer(self.mapping, dtype=np.uint8, count=nbytes, offset=offset)
        handle = self.handle
        if handle is None:
            raise GGUFError(f"{self.path}: the file is closed")
        out = np.empty(nbytes, dtype=np.uint8)
        view, done = memoryview(out.data), 0
        while done < nbytes:  # pread has no shared file position, so concurrent readers do not interfere
            got = _pread_into(handle, view[done:], offset + done)
            if got <= 0:
                raise GGUFError(f"{self.path}: short read of {nbytes} bytes at offset {offset} (file changed?)")
            done += got
        return out

    def close(self) -> None:
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:
                pass  # numpy views still use it; it is unmapped when the last of them is collected
            self.mapping = None
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class GGUFFile:
    """One GGUF model, possibly split over several files; a context manager.

    ``metadata`` holds scalars as python int/float/bool/str, numeric arrays as numpy arrays of their dtype,
    string arrays as ``list[str]`` and nested arrays as lists. ``metadata_types`` gives each key's value type,
    ``metadata_array_types`` the element type of each ARRAY key. For a split model, metadata come from the
    first file (the other files only carry ``split.*`` keys). ``tensors`` keeps file order.

    ``allow_cut_data=True`` opens a file whose header (metadata and tensor infos) is whole but whose tensor data
    is cut short, as an interrupted download leaves it: ``cut_tensors`` names the tensors past the end, and
    reading one raises :class:`GGUFError`. A file cut inside its header is an error either way.
    """

    def __init__(self, path: str | os.PathLike[str], mode: Mode = "mmap", *, allow_cut_data: bool = False):
        if mode not in ("mmap", "read"):
            raise GGUFError(f"mode must be 'mmap' or 'read', got {mode!r}")
        self.path = Path(path)
        self.mode: Mode = mode
        self._allow_cut_data = allow_cut_data
        self._files: list[_OpenFile] = []
        #: file index → the mapping :meth:`lasting_tensor_bytes` views (never closed here: its views own it)
        self._lasting: dict[int, mmap.mmap] = {}
        try:
            self._open(self.path)
        except BaseException:
            self.close()
            raise

    # -- opening --------------------------------------------------------------------------------------
    def _open(self, path: Path) -> None:
        first = self._open_file(path)
        seen: set[str] = set()
        headers = [_parse_header(first.cursor(), 0, seen, self._allow_cut_data)]
        split_count = _split_count(headers[0])
        if split_count > 1:
            self._files.clear()
            first.close()
            headers = self._open_splits(path, split_count)
        self.paths = [f.path for f in self._files]
        main = headers[0]
        self.version = main.version
        self.alignment = main.alignment
        self.data_offsets = [h.data_offset for h in headers]
        self.metadata: dict[str, Any] = main.metadata
        self.metadata_types: dict[str, GGUFValueType] = main.metadata_types
        self.metadata_array_types: dict[str, GGUFValueType] = main.metadata_array_types
        self.tensors: dict[str, TensorInfo] = {t.name: t for h in headers for t in h.tensors}
        self.cut_tensors: list[str] = [name for h in headers for name in h.cut]

    def _open_file(self, path: Path) -> _OpenFile:
        opened = _OpenFile(path, self.mode)
        self._files.append(opened)
        return opened

    def _open_splits(self, path: Path, split_count: int) -> list[_FileHeader]:
        paths = split_paths(path)
        if paths is None or len(paths) != split_count:
            raise GGUFError(f"{path}: {KEY_SPLIT_COUNT} is {split_count}, but the file name is not "
                            f"'<prefix>-0000N-of-{split_count:05d}.gguf'")
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise GGUFError(f"{path}: split model of {split_count} files is missing {', '.join(missing)}")
        seen: set[str] = set()
        headers = [_parse_header(self._open_file(p).cursor(), i, seen, self._allow_cut_data)
                   for i, p in enumerate(paths)]
        _check_split_consistency(headers, split_count)
        return headers

    # -- data -----------------------------------------------------------------------------------------
    @property
    def data_offset(self) -> int:
        """Start of the data section of the first file."""
        return self.data_offsets[0]

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r} ({len(self.tensors)} tensors)") from None

    def _readable(self, name: str) -> TensorInfo:
        info = self.tensor_info(name)
        if self.cut_tensors and name in self.cut_tensors:
            raise GGUFError(f"{self.path}: the data of tensor {name!r} lies past the end of the file (file cut short)")
        return info

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as uint8: a view of the mapping (mmap mode) or a fresh array (read mode)."""
        info = self._readable(name)
        if not self._files:
            raise GGUFError(f"{self.path}: file is closed")
        return self._files[info.file_index].read(info.offset, info.nbytes)

    def lasting_tensor_bytes(self, name: str) -> np.ndarray | None:
        """The raw bytes of a tensor as a read-only view that outlives :meth:`close`: it maps the file anew (once
        per file), so only the pages read through it become resident — a table kept for row lookups costs the
        rows looked up, not the whole tensor. None in read mode (the caller copies :meth:`tensor_bytes`)."""
        info = self._readable(name)
        if self.mode != "mmap" or not self._files:
            return None
        mapping = self._lasting.get(info.file_index)
        if mapping is None:
            opened = self._files[info.file_index]
            try:
                mapping = _map_read_only(opened.path)
            except (OSError, ValueError):
                return None
            if len(mapping) != opened.size:  # the file changed since it was parsed
                return None
            self._lasting[info.file_index] = mapping
        return np.frombuffer(mapping, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def tensor_array(self, name: str) -> np.ndarray:
        """An unquantized tensor (F32, F16, F64, I8..I64) as a numpy array of ``numpy_shape`` (a view in mmap
        mode). BF16 and quantized types need :mod:`llmfw.core.format.quants`."""
        info = self.tensor_info(name)
        dtype = _PLAIN_TENSOR_DTYPES.get(info.ggml_type)
        if dtype is None:
            raise QuantError(f"tensor {name!r} is {info.ggml_type.name}; dequantize it with llmfw.core.format.quants")
        return self.tensor_bytes(name).view(dtype).reshape(info.numpy_shape)

    # -- summary helpers ------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def tensor_data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def n_parameters(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    # -- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release every mapping / handle. Views from :meth:`tensor_bytes` still alive keep their mapping
        until they are garbage collected; after close nothing in this object refers to the files."""
        for opened in self._files:
            opened.close()
        self._files = []
        self._lasting = {}  # each lasting mapping is unmapped when the last view of it is collected

    @property
    def closed(self) -> bool:
        return not self._files

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, v{getattr(self, 'version', '?')}, "
                f"{len(getattr(self, 'metadata', {}))} keys, {len(getattr(self, 'tensors', {}))} tensors)")


_PLAIN_TENSOR_DTYPES: dict[GGMLType, np.dtype[Any]] = {
    GGMLType.F32: np.dtype("<f4"), GGMLType.F16: np.dtype("<f2"), GGMLType.F64: np.dtype("<f8"),
    GGMLType.I8: np.dtype("i1"), GGMLType.I16: np.dtype("<i2"), GGMLType.I32: np.dtype("<i4"),
    GGMLType.I64: np.dtype("<i8"),
}


def _int_key(header: _FileHeader, key: str) -> int | None:
    """An integer-valued key, None when absent; GGUFError when present with a non-integer value."""
    value = header.metadata.get(key)
    if value is None:
        return None
    if header.metadata_types[key] not in _INT_RANGES:
        raise GGUFError(f"{header.path}: {key} must be an integer, found {header.metadata_types[key].name} "
                        f"value {value!r:.80}")
    return int(value)


def _split_count(header: _FileHeader) -> int:
    count = _int_key(header, KEY_SPLIT_COUNT)
    if count is None:
        return 1
    if count < 1:
        raise GGUFError(f"{header.path}: {KEY_SPLIT_COUNT} must be >= 1, found {count}")
    return count


def _check_split_consistency(headers: list[_FileHeader], split_count: int) -> None:
    for index, header in enumerate(headers):
        count, number = _int_key(header, KEY_SPLIT_COUNT), _int_key(header, KEY_SPLIT_NO)
        if count != split_count or number != index:
            raise GGUFError(f"{header.path}: expected {KEY_SPLIT_NO}={index} and {KEY_SPLIT_COUNT}={split_count}, "
                            f"found {KEY_SPLIT_NO}={number} and {KEY_SPLIT_COUNT}={count}")
    expected = _int_key(headers[0], KEY_SPLIT_TENSORS)
    found = sum(len(h.tensors) for h in headers)
    if expected is not None and expected != found:
        raise GGUFError(f"{headers[0].path}: {KEY_SPLIT_TENSORS} is {expected}, but the {split_count} files hold "
                        f"{found} tensors")


def open_gguf(path: str | os.PathLike[str], mode: Mode = "mmap", *, allow_cut_data: bool = False) -> GGUFFile:
    """Open a GGUF model (the first file of a split model opens all of them); ``allow_cut_data``: see
    :class:`GGUFFile`."""
    return GGUFFile(path, mode, allow_cut_data=allow_cut_data)


def most_common_type(tensors: Iterable[TensorInfo]) -> GGMLType | None:
    """The type holding the most elements among 2-D tensors (the weight matrices): the model's 'file type'."""
    by_elements: Counter[GGMLType] = Counter()
    for tensor in tensors:
        if len(tensor.shape) == 2:
            by_elements[tensor.ggml_type] += tensor.n_elements
    return by_elements.most_common(1)[0][0] if by_elements else None


# ----------------------------------------------------------------------------------------------- writing


def _encode_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def _infer_scalar_type(value: Any) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, np.generic):
        for vtype, dtype in _NUMPY_DTYPE.items():
            if vtype != GGUFValueType.BOOL and value.dtype == dtype.newbyteorder("="):
                return vtype
    if isinstance(value, (int, np.integer)):
        lo, hi = _INT_RANGES[GGUFValueType.INT32]
        if lo <= value <= hi:
            return GGUFValueType.INT32
        return GGUFValueType.INT64 if value <= INT64_MAX else GGUFValueType.UINT64
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return GGUFValueType.ARRAY
    raise GGUFError(f"cannot store a value of python type {type(value).__name__} in GGUF")


def _infer_array_type(items: Any) -> GGUFValueType:
    if isinstance(items, np.ndarray):
        if items.dtype == np.bool_:
            return GGUFValueType.BOOL
        for vtype, dtype in _NUMPY_DTYPE.items():
            if vtype != GGUFValueType.BOOL and items.dtype == dtype.newbyteorder("="):
                return vtype
        if items.dtype.kind in "US":
            return GGUFValueType.STRING
        raise GGUFError(f"cannot store a numpy array of dtype {items.dtype} in GGUF")
    kinds = {_infer_scalar_type(item) for item in items}
    if not kinds:
        return GGUFValueType.INT32  # an empty array needs some element type
    if len(kinds) == 1:
        return kinds.pop()
    if kinds <= {GGUFValueType.INT32, GGUFValueType.INT64}:
        return GGUFValueType.INT64
    if kinds <= {GGUFValueType.INT32, GGUFValueType.INT64, GGUFValueType.FLOAT32}:
        return GGUFValueType.FLOAT32
    raise GGUFError(f"array mixes element types {sorted(k.name for k in kinds)}")


def _encode_scalar(value: Any, vtype: GGUFValueType) -> bytes:
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, str):
            raise GGUFError(f"STRING value must be str, got {type(value).__name__}")
        return _encode_string(value)
    if vtype in _INT_RANGES:
        lo, hi = _INT_RANGES[vtype]
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
            raise GGUFError(f"{vtype.name} value must be an integer in [{lo}, {hi}], got {value!r}")
        return _STRUCT[vtype].pack(int(value))
    if vtype == GGUFValueType.BOOL:
        return _STRUCT[vtype].pack(1 if value else 0)
    return _STRUCT[vtype].pack(float(value))


def _encode_array(items: Any, elem_type: GGUFValueType | None) -> bytes:
    elem_type = _infer_array_type(items) if elem_type is None else GGUFValueType(elem_type)
    head = _U32.pack(elem_type) + _U64.pack(len(items))
    if elem_type == GGUFValueType.STRING:
        return head + b"".join(_encode_string(str(item)) for item in items)
    if elem_type == GGUFValueType.ARRAY:
        return head + b"".join(_encode_array(item, None) for item in items)
    if isinstance(items, np.ndarray) and elem_type in _INT_RANGES and items.size:
        lo, hi = _INT_RANGES[elem_type]
        if items.min() < lo or items.max() > hi:
            raise GGUFError(f"{elem_type.name} array items must lie in [{lo}, {hi}], found "
                            f"[{items.min()}, {items.max()}]")
    if isinstance(items, np.ndarray) or elem_type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return head + np.asarray(items).astype(_NUMPY_DTYPE[elem_type]).tobytes()
    return head + b"".join(_encode_scalar(item, elem_type) for item in items)


def encode_value(value: Any, vtype: GGUFValueType | None = None, *,
                 array_type: GGUFValueType | None = None) -> tuple[GGUFValueType, bytes]:
    """The value type and the encoded bytes (without the type tag) of a metadata value."""
    vtype = _infer_scalar_type(value) if vtype is None else GGUFValueType(vtype)
    if vtype == GGUFValueType.ARRAY:
        if not isinstance(value, (list, tuple, np.ndarray)):
            raise GGUFError(f"ARRAY value must be a list, tuple or numpy array, got {type(value).__name__}")
        return vtype, _encode_array(value, array_type)
    return vtype, _encode_scalar(value, vtype)


@dataclass
class _PendingTensor:
    name: str
    shape: tuple[int, ...]
    type_id: int
    data: bytes | None  # None: a raw tensor info (tests of malformed files) with an explicit offset
    offset: int | None = None


class GGUFWriter:
    """Writes a GGUF file: for tests (small models, vocab-only files, malformed files) and tools.

    ``writer.add("llama.block_count", 2, GGUFValueType.UINT32)``; ``writer.add_tensor("w", np_array)``;
    ``writer.write()`` (or use it as a context manager, which writes on a clean exit). With ``n_splits > 1`` the
    tensors are spread in order over ``prefix-0000N-of-0000M.gguf`` files (``path`` names the model; its
    ``.gguf`` suffix is replaced), the first holding all metadata plus the ``split.*`` keys; ``written_paths``
    lists what was written. ``strict=False`` allows duplicate keys and tensor names, for malformed-file tests.
    """

    def __init__(self, path: str | os.PathLike[str], *, version: int = 3, alignment: int = DEFAULT_ALIGNMENT,
                 n_splits: int = 1, strict: bool = True):
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"alignment must be a power of two > 0, got {alignment}")
        if n_splits < 1:
            raise GGUFError(f"n_splits must be >= 1, got {n_splits}")
        self.path = Path(path)
        self.version = version
        self.alignment = alignment
        self.n_splits = n_splits
        self.strict = strict
        self._kv: list[tuple[str, GGUFValueType, bytes]] = []
        self._tensors: list[_PendingTensor] = []
        self.written_paths: list[Path] = []
        if alignment != DEFAULT_ALIGNMENT:
            self.add(KEY_ALIGNMENT, alignment, GGUFValueType.UINT32)

    def add(self, key: str, value: Any, vtype: GGUFValueType | None = None, *,
            array_type: GGUFValueType | None = None) -> None:
        """Add one key; the type is inferred (bool, int32/int64, float32, str, arrays) unless given."""
        if self.strict and any(k == key for k, _, _ in self._kv):
            raise GGUFError(f"duplicate key {key!r}")
        vtype, payload = encode_value(value, vtype, array_type=array_type)
        self._kv.append((key, vtype, payload))

    def add_raw_kv(self, key: str, type_id: int, payload: bytes) -> None:
        """A key with any type id and pre-encoded value bytes (to build malformed files)."""
        self._kv.append((key, type_id, payload))  # type: ignore[arg-type]

    def add_tensor(self, name: str, data: np.ndarray, ggml_type: GGMLType | None = None,
                   shape: tuple[int, ...] | None = None) -> None:
        """float32/float16 arrays become F32/F16 of ne = reversed numpy shape; for any other type pass the raw
        bytes (uint8) with ``ggml_type`` and the ggml ``shape``."""
        if self.strict and any(t.name == name for t in self._tensors):
            raise GGUFError(f"duplicate tensor name {name!r}")
        data = np.ascontiguousarray(data)
        if ggml_type is None:
            ggml_type = {np.dtype(np.float32): GGMLType.F32, np.dtype(np.float16): GGMLType.F16}.get(data.dtype)
            if ggml_type is None:
                raise GGUFError(f"tensor {name!r}: cannot infer a ggml type from dtype {data.dtype}; "
                                "pass ggml_type and shape")
        ne = tuple(int(d) for d in (shape if shape is not None else reversed(data.shape)))
        info = TYPE_INFO[GGMLType(ggml_type)]
        n_elements = int(np.prod(ne, dtype=object)) if ne else 1
        expected = n_elements // info.block_size * info.type_size
        if self.strict and (data.nbytes != expected or (ne and ne[0] % info.block_size)):
            raise GGUFError(f"tensor {name!r}: {GGMLType(ggml_type).name} of shape {list(ne)} takes {expected} "
                            f"bytes, the data has {data.nbytes}")
        self._tensors.append(_PendingTensor(name, ne, int(ggml_type), data.tobytes()))

    def add_raw_tensor_info(self, name: str, shape: tuple[int, ...], type_id: int, offset: int) -> None:
        """A tensor info with no data of its own and an explicit data-section offset (malformed-file tests)."""
        self._tensors.append(_PendingTensor(name, tuple(shape), type_id, None, offset))

    # -- output ---------------------------------------------------------------------------------------
    def write(self) -> None:
        if self.n_splits == 1:
            self._write_file(self.path, self._kv, self._tensors)
            self.written_paths = [self.path]
            return
        prefix = self.path.name[:-5] if self.path.name.endswith(".gguf") else self.path.name
        chunks = np.array_split(np.arange(len(self._tensors)), self.n_splits)
        self.written_paths = []
        for index, chunk in enumerate(chunks):
            split_kv = [(KEY_SPLIT_NO, GGUFValueType.UINT16, _STRUCT[GGUFValueType.UINT16].pack(index)),
                        (KEY_SPLIT_COUNT, GGUFValueType.UINT16, _STRUCT[GGUFValueType.UINT16].pack(self.n_splits)),
                        (KEY_SPLIT_TENSORS, GGUFValueType.INT32, _STRUCT[GGUFValueType.INT32].pack(len(self._tensors)))]
            kv = (self._kv if index == 0 else [kv for kv in self._kv if kv[0] == KEY_ALIGNMENT]) + split_kv
            path = self.path.with_name(split_file_name(prefix, index, self.n_splits))
            self._write_file(path, kv, [self._tensors[i] for i in chunk])
            self.written_paths.append(path)

    def _write_file(self, path: Path, kv: list[tuple[str, GGUFValueType, bytes]],
                    tensors: list[_PendingTensor]) -> None:
        header = bytearray(GGUF_MAGIC)
        header += _U32.pack(self.version) + _U64.pack(len(tensors)) + _U64.pack(len(kv))
        for key, vtype, payload in kv:
            header += _encode_string(key) + _U32.pack(vtype) + payload
        offsets, cursor = [], 0
        for tensor in tensors:
            if tensor.data is None:
                offsets.append(tensor.offset)
            else:
                offsets.append(cursor)
                cursor = _align_up(cursor + len(tensor.data), self.alignment)
        for tensor, offset in zip(tensors, offsets):
            header += _encode_string(tensor.name) + _U32.pack(len(tensor.shape))
            header += b"".join(_U64.pack(d) for d in tensor.shape) + _U32.pack(tensor.type_id) + _U64.pack(offset)
        header += bytes(_align_up(len(header), self.alignment) - len(header))
        with path.open("wb") as out:
            out.write(header)
            for tensor in tensors:
                if tensor.data is not None:
                    out.write(tensor.data)
                    out.write(bytes(_align_up(len(tensor.data), self.alignment) - len(tensor.data)))

    def __enter__(self) -> "GGUFWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.write()
