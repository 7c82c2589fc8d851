"""GGUF reader (v2 and v3, mmap or plain reads, split files); the writer is :mod:`.gguf_writer`.

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

import io
import mmap
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np

from ..errors import GGUFError, QuantError
# the format's names, importable from here as before the header parser and the writer moved out
from .gguf_types import (DEFAULT_ALIGNMENT as DEFAULT_ALIGNMENT, GGUF_MAGIC as GGUF_MAGIC, INT64_MAX as INT64_MAX,
                         KEY_ALIGNMENT as KEY_ALIGNMENT, KEY_SPLIT_COUNT as KEY_SPLIT_COUNT,
                         KEY_SPLIT_NO as KEY_SPLIT_NO, KEY_SPLIT_TENSORS as KEY_SPLIT_TENSORS,
                         MAX_ARRAY_NESTING as MAX_ARRAY_NESTING, MAX_DIMS as MAX_DIMS,
                         MAX_NAME_BYTES as MAX_NAME_BYTES, SUPPORTED_VERSIONS as SUPPORTED_VERSIONS,
                         GGUFValueType as GGUFValueType, split_file_name as split_file_name)
from .gguf_types import INT_RANGES as _INT_RANGES
from .gguf_header import MAX_STRING_BYTES as MAX_STRING_BYTES, TensorInfo as TensorInfo
from .gguf_header import Cursor as _Cursor, FileHeader as _FileHeader, parse_header as _parse_header
from .gguf_writer import GGUFWriter as GGUFWriter, encode_value as encode_value  # the writer, importable here
from .quants import GGMLType


_SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

Mode = Literal["mmap", "read"]


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
