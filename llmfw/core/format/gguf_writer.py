"""Writing GGUF files (tests, converters, split files): the layout :mod:`.gguf` reads."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError
from .gguf_types import (DEFAULT_ALIGNMENT, GGUF_MAGIC, INT64_MAX, KEY_ALIGNMENT, KEY_SPLIT_COUNT, KEY_SPLIT_NO,
                         KEY_SPLIT_TENSORS, GGUFValueType, split_file_name)
from .gguf_types import INT_RANGES as _INT_RANGES, NUMPY_DTYPE as _NUMPY_DTYPE, STRUCT as _STRUCT, U32 as _U32
from .gguf_types import U64 as _U64, align_up as _align_up
from .quants import TYPE_INFO, GGMLType


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
