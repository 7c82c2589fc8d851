"""A converted-weight cache: a backend's forms of a model file's weights, kept next to the model cache.

Converting a file's quantized blocks into a backend's own layout can be most of its load time. The result depends
only on the file's bytes, on what the graph does with each tensor and on the converting code, so a backend writes
it once to ``<root>/<sha256>-<llmfw version>-f<format>/`` (``index.json`` + one ``weights.bin``) and later loads
map that blob read-only: no conversion, no conversion buffers, and the pages are the page cache's (clean, shared by
every process that loads the model).

An entry that cannot be trusted — unreadable or foreign index, a blob of the wrong size, an array outside it, a
weight whose stored description does not check out — is deleted and rebuilt from the model file; a weight whose
tensor type, shape or use differs from what was stored (another architecture version, say) is converted afresh and
the entry rewritten. Bit flips inside the blob are not detected: hashing it on every load would cost as much as a
good part of the conversion it saves.

A backend subclasses :class:`ConvertedCache` with how its weight type becomes arrays and back (``arrays_of``,
``meta_of``, ``weight_of``) and drives a load through :class:`CachedLoad`.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, TypeVar

import numpy as np

from llmfw.core.exec.backend import BackendOptions, WeightSource, release_freed_memory
from llmfw.core.format.mapped_pages import drop_mapped_pages, prefer_huge_pages

log = logging.getLogger(__name__)

W = TypeVar("W")

#: entries kept per cache folder; the oldest (by last use) go first
MAX_ENTRIES = 4
#: files smaller than this convert about as fast as their cache entry is read: not cached
MIN_FILE_BYTES = 8 << 20
_ALIGN = 64
#: arrays smaller than this stay in memory while a load spools (a mapping each would cost more than they do)
_SPOOL_MIN_BYTES = 1 << 16
_INDEX, _BLOB = "index.json", "weights.bin"
#: the blob is written in whole pieces of this size, each at an offset that is a multiple of it: a file system with
#: large folios then keeps it in the page cache as huge pages, which the mapping of a later load maps as such
#: (mapped_pages.prefer_huge_pages); written an array at a time, the pieces are 4 KiB pages
_WRITE_PIECE = 2 << 20


class PieceWriter:
    """A file written in whole pieces of ``piece`` bytes (the last one shorter): the bytes handed to :meth:`write`
    go out a piece at a time, those that do not fill one gathered in a buffer of that size until it is full."""

    def __init__(self, fh: Any, piece: int = _WRITE_PIECE):
        self.fh = fh
        self.buffer = bytearray(piece)
        self.filled = 0

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        piece = len(self.buffer)
        while len(view):
            if not self.filled and len(view) >= piece:  # a whole piece of the caller's bytes: written without a copy
                self.fh.write(view[:piece])
                view = view[piece:]
                continue
            take = min(len(view), len(self.buffer) - self.filled)
            self.buffer[self.filled:self.filled + take] = view[:take]
            self.filled += take
            view = view[take:]
            if self.filled == len(self.buffer):
                self.fh.write(self.buffer)
                self.filled = 0

    def finish(self) -> None:
        """The last, partial piece written."""
        self.fh.write(memoryview(self.buffer)[:self.filled])
        self.filled = 0


class CacheOptions(BackendOptions):
    """The options of a backend with a converted-weight cache."""

    #: keep converted weights next to the model cache and map them on later loads
    cache: bool = True
    #: the converted-weight cache's folder (default ``$LLMFW_<BACKEND>_CACHE_DIR``, else ``<models_dir>/.<backend>``)
    cache_dir: str | None = None

    def cache_root(self, backend: str) -> Path | None:
        """Where the cache lives (None: switched off): the option, else the folder the backend's
        ``LLMFW_<BACKEND>_CACHE_DIR`` names (for loads through the Python API as well as the CLI's), else the
        default next to the models."""
        if not self.cache:
            return None
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return cache_dirs_from(os.environ, cache_dir_variable(backend), backend)[0]


def default_cache_root(backend: str) -> Path:
    """``<models_dir>/.<backend>``: next to the model cache."""
    from llmfw.core.format.catalog import models_dir

    return models_dir() / f".{backend}"


def cache_dir_variable(backend: str) -> str:
    """The environment variable that moves a backend's converted-weight cache: ``LLMFW_<BACKEND>_CACHE_DIR``."""
    return f"LLMFW_{backend.upper()}_CACHE_DIR"


def cache_dirs_from(environ: Mapping[str, str], variable: str, backend: str) -> list[Path]:
    """A backend's ``cache_dirs``: its default root, or the one the environment variable ``variable`` names."""
    moved = environ.get(variable)
    return [Path(moved).expanduser() if moved else default_cache_root(backend)]


def source_key(source: WeightSource) -> list[Any]:
    """What a weight's converted form depends on besides the file's bytes (JSON-shaped, to compare with the index)."""
    return [int(source.ggml_type), [int(d) for d in source.ne], sorted(source.usage)]


@dataclass
class CachedWeight(Generic[W]):
    key: list[Any]
    weight: W


@dataclass
class MappedBlob:
    """An entry's ``weights.bin`` as this process mapped it. The restored arrays are views of ``array``; a library
    may map the same bytes itself, by path, as long as the path still names the very file mapped here — an entry
    rewritten by another process is a new file (see :meth:`still_at_path`)."""

    path: Path
    array: np.ndarray
    #: (st_dev, st_ino) of the file mapped
    identity: tuple[int, int]

    @classmethod
    def open(cls, path: Path, expected_bytes: int) -> "MappedBlob | None":
        """The file mapped read-only (None when empty); ValueError when its size is not ``expected_bytes``."""
        with path.open("rb") as fh:
            stat = os.fstat(fh.fileno())
            if stat.st_size != expected_bytes:
                raise ValueError(f"{path.name} has {stat.st_size} bytes, the index says {expected_bytes}")
            if not expected_bytes:
                return None
            array = np.memmap(fh, dtype=np.uint8, mode="r")  # the mapping outlives the file object
        prefer_huge_pages(array)  # before any page is touched: a cold page cache is then read in huge pages
        return cls(path, array, (stat.st_dev, stat.st_ino))

    def offset_of(self, array: np.ndarray) -> int | None:
        """The file offset of a C-contiguous array whose bytes lie inside this mapping, else None."""
        if not array.flags.c_contiguous or not array.nbytes:
            return None
        start = int(array.ctypes.data) - int(self.array.ctypes.data)
        return start if 0 <= start and start + array.nbytes <= self.array.nbytes else None

    def still_at_path(self) -> bool:
        """Whether :attr:`path` still names the file mapped here. Once the entry is replaced, the mapped file is
        never at that path again (the mapping keeps its inode alive), so a True after a session was built means
        the session read this very file."""
        try:
            stat = self.path.stat()
        except OSError:
            return False
        return (stat.st_dev, stat.st_ino) == self.identity


class ConvertedCache(ABC, Generic[W]):
    """One model file's entry under ``root``; ``restore`` maps it, ``store`` writes it (atomically). A subclass
    says how its weights become arrays (:meth:`arrays_of`, :meth:`meta_of`) and back (:meth:`weight_of`)."""

    #: who logs (the backend's name)
    label = "backend"
    #: the element types the backend's arrays use; anything else in an index is corruption
    dtypes: frozenset[str] = frozenset()

    def __init__(self, root: Path, sha256: str, version: str):
        self.root = root
        self.entry = root / f"{sha256}-{version}-f{self.format()}"
        self.sha256, self.version = sha256, version
        #: the entry's weights.bin as last restored (None before, or when it holds no bytes)
        self.blob: MappedBlob | None = None

    @classmethod
    @abstractmethod
    def format(cls) -> int:
        """The converter's format: bumped whenever the converted forms change, so that older entries are rebuilt."""

    @staticmethod
    @abstractmethod
    def arrays_of(weight: W) -> dict[str, np.ndarray]:
        """The arrays of a converted weight, by field name."""

    @staticmethod
    @abstractmethod
    def meta_of(weight: W) -> dict[str, Any]:
        """Everything else the weight needs to be rebuilt (JSON-shaped)."""

    @staticmethod
    @abstractmethod
    def weight_of(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> W:
        """The weight rebuilt from :meth:`meta_of` and views of its arrays; ValueError (or KeyError/TypeError) when
        they do not describe a valid weight."""

    @classmethod
    def for_file(cls, root: Path, model_file: Path) -> "ConvertedCache[W] | None":
        """The cache entry of ``model_file``, or None when it is too small to be worth one or cannot be hashed."""
        from llmfw import __version__
        from llmfw.core.format.catalog import file_sha256

        try:
            if model_file.stat().st_size < MIN_FILE_BYTES:
                return None
            return cls(root, file_sha256(model_file), __version__)
        except OSError as exc:
            log.info("%s: no converted-weight cache for %s (%s)", cls.label, model_file, exc)
            return None

    # -- reading ---------------------------------------------------------------------------------------------
    def restore(self) -> dict[str, CachedWeight[W]]:
        """The stored weights, mapped read-only; empty (and the entry deleted) when it is missing or corrupt."""
        self.blob = None
        if not self.entry.is_dir():
            return {}
        try:
            weights = self._read()
        except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("%s: converted-weight cache %s is corrupt (%s); rebuilding it", self.label, self.entry, exc)
            shutil.rmtree(self.entry, ignore_errors=True)
            self.blob = None
            return {}
        os.utime(self.entry)  # last use, for eviction
        log.info("%s: %d converted weights mapped from %s", self.label, len(weights), self.entry)
        return weights

    def _read(self) -> dict[str, CachedWeight[W]]:
        index = json.loads((self.entry / _INDEX).read_text(encoding="utf-8"))
        if index.get("format") != self.format() or index.get("sha256") != self.sha256:
            raise ValueError("index of another file or format")
        self.blob = MappedBlob.open(self.entry / _BLOB, int(index["blob_bytes"]))
        blob = self.blob.array if self.blob is not None else np.zeros(0, np.uint8)
        return {name: CachedWeight(entry["key"], self.weight_of(entry["meta"], {
                    field: self._view(blob, *spec) for field, spec in entry["arrays"].items()}))
                for name, entry in index["weights"].items()}

    def _view(self, blob: np.ndarray, offset: int, dtype: str, shape: list[int]) -> np.ndarray:
        """``blob[offset:]`` seen as an array; ValueError when it does not lie inside the blob."""
        if dtype not in self.dtypes:
            raise ValueError(f"array of element type {dtype!r}")
        dt = np.dtype(dtype)
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"array of shape {shape}")
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset % dt.itemsize or offset + count * dt.itemsize > blob.size:
            raise ValueError(f"array at {offset} ({dtype} {shape}) lies outside the {blob.size}-byte blob")
        return np.asarray(blob[offset:offset + count * dt.itemsize]).view(dt).reshape(shape)

    # -- writing ---------------------------------------------------------------------------------------------
    def store(self, weights: Mapping[str, CachedWeight[W]]) -> None:
        """Write the entry (a temporary folder renamed into place, so a reader never sees half of one)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        except OSError as exc:
            log.info("%s: converted weights not cached (%s)", self.label, exc)
            return
        try:
            self._write(staging, weights)
            shutil.rmtree(self.entry, ignore_errors=True)
            os.replace(staging, self.entry)
            log.info("%s: converted weights cached in %s", self.label, self.entry)
        except OSError as exc:
            log.info("%s: converted weights not cached (%s)", self.label, exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._evict()

    def _write(self, folder: Path, weights: Mapping[str, CachedWeight[W]]) -> None:
        """Every array once: a part of a fused weight, whose arrays are rows of the fused ones, is stored as
        offsets into them (so restoring keeps the parts as views, as fusing made them)."""
        fields = {name: self.arrays_of(cached.weight) for name, cached in weights.items()}
        stored: dict[int, tuple[int, np.ndarray]] = {}  # id(array) → (offset, array) of arrays written whole
        offset = 0
        every = {id(array): array for arrays in fields.values() for array in arrays.values()}
        with (folder / _BLOB).open("wb") as blob:
            pieces = PieceWriter(blob)
            for array in every.values():
                if _stored_ancestor(array, every) is None:  # fused arrays first, their parts' rows refer to them
                    contiguous = np.ascontiguousarray(array)
                    pad = -offset % _ALIGN
                    pieces.write(b"\0" * pad)
                    offset += pad
                    pieces.write(contiguous.reshape(-1).view(np.uint8).data)
                    drop_mapped_pages(contiguous)  # a spooled or mapped array: its pages were read only to copy
                    stored[id(array)] = (offset, contiguous)
                    offset += contiguous.nbytes
            pieces.finish()
            blob.flush()
            os.fsync(blob.fileno())  # the rename below must not publish an entry whose bytes are still in flight
        entries = {name: {"key": weights[name].key, "meta": self.meta_of(weights[name].weight),
                          "arrays": {field: _place(array, stored) for field, array in arrays.items()}}
                   for name, arrays in fields.items()}
        index = {"format": self.format(), "sha256": self.sha256, "version": self.version, "blob_bytes": offset,
                 "weights": entries}
        (folder / _INDEX).write_text(json.dumps(index), encoding="utf-8")

    def _evict(self) -> None:
        """Drop this file's entries of other llmfw versions or formats, then keep the MAX_ENTRIES used last."""
        try:
            entries = sorted((p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                             key=lambda p: p.stat().st_mtime, reverse=True)
        except OSError:
            return
        outdated = [p for p in entries if p.name.startswith(f"{self.sha256}-") and p != self.entry]
        current = [p for p in entries if p not in outdated]
        for stale in outdated + current[MAX_ENTRIES:]:
            shutil.rmtree(stale, ignore_errors=True)


class Spool:
    """Converted arrays written to a scratch file as they are made and mapped back read-only, so that a load
    that converts holds one weight's conversion in anonymous memory at a time, not the whole model's; the cache
    entry is then written from here. The file has no name (``O_TMPFILE`` where the system has it): it goes with
    the last mapping of it, whether the load finishes or fails."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.file = tempfile.TemporaryFile(dir=root)
        self.offset = 0
        self.mappings: list[mmap.mmap] = []

    @classmethod
    def open(cls, root: Path) -> "Spool | None":
        try:
            return cls(root)
        except OSError as exc:
            log.info("converted weights held in memory while loading (no scratch file in %s: %s)", root, exc)
            return None

    def spill(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``arrays`` written out and seen as read-only views of one mapping of the file (small ones as they
        are: one mapping per weight, not per array, keeps a model of many experts under the system's count of
        mappings); OSError when the file cannot take them."""
        release_freed_memory()  # the conversion buffers of the weights spilled before, freed by now
        large = {field: np.ascontiguousarray(a) for field, a in arrays.items() if a.nbytes >= _SPOOL_MIN_BYTES}
        if not large:
            return dict(arrays)
        start = -(-self.offset // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY  # a mapping's offset
        at: dict[str, int] = {}
        end = start
        for field, array in large.items():
            end += -end % _ALIGN
            self.file.seek(end)
            self.file.write(array.reshape(-1).view(np.uint8).data)
            at[field], end = end - start, end + array.nbytes
        self.file.flush()
        self.offset = end
        mapping = mmap.mmap(self.file.fileno(), end - start, offset=start, access=mmap.ACCESS_READ)
        self.mappings.append(mapping)
        # each view's base is the mapping itself, so slices of it (a fused weight's parts) stay views of the view
        return {field: np.ndarray(large[field].shape, large[field].dtype, buffer=mapping, offset=at[field])
                if field in large else array for field, array in arrays.items()}

    def drop_pages(self) -> None:
        """Every spilled array's pages out of RSS (read back from the page cache when touched again)."""
        for mapping in self.mappings:
            drop_mapped_pages(np.frombuffer(mapping, dtype=np.uint8))

    def close(self) -> None:
        """The file closed: the mappings of it stay valid for as long as arrays view them."""
        self.mappings.clear()
        self.file.close()


class CachedLoad(Generic[W]):
    """One model file's weights loaded through its cache entry: restored where the entry has them, converted
    (and the entry rewritten at the end) where it does not. A converted weight is spilled to a :class:`Spool`
    at once, so the load's memory stays near one weight's conversion above what a cached load maps."""

    def __init__(self, cache: ConvertedCache[W] | None):
        self.cache = cache
        self.restored = cache.restore() if cache is not None else {}
        self.keys: dict[str, list[Any]] = {}
        self.converted = 0
        self.spool: Spool | None = None

    def load(self, source: WeightSource, convert: Callable[[WeightSource], W]) -> W:
        key = self.keys[source.name] = source_key(source)
        cached = self.restored.pop(source.name, None)
        if cached is not None and cached.key == key:
            return cached.weight
        self.converted += 1
        return self._spilled(convert(source))

    def fused(self, name: str, parts: tuple[str, ...], fuse: Callable[[], W]) -> W:
        """A fused weight (core/ir/passes.py) of ``parts``: restored when stored for these very parts, else built."""
        key = self.keys[name] = ["fused", [self.keys.get(part) for part in parts]]
        cached = self.restored.pop(name, None)
        if cached is not None and cached.key == key:
            return cached.weight
        self.converted += 1
        fused = self._spilled(fuse())
        if self.spool is not None:
            self.spool.drop_pages()  # the parts' pages, read to stack them
        return fused

    def _spilled(self, weight: W) -> W:
        """``weight`` with its arrays spilled to the spool (as it is without a cache entry to write, or when the
        spool fails: then the load holds its conversions in memory, as it would without one)."""
        if self.cache is None:
            return weight
        if self.spool is None:
            self.spool = Spool.open(self.cache.root)
            if self.spool is None:
                return weight
        try:
            return self.cache.weight_of(self.cache.meta_of(weight), self.spool.spill(self.cache.arrays_of(weight)))
        except OSError as exc:
            log.info("%s: converted weights held in memory while loading (%s)", self.cache.label, exc)
            return weight

    @property
    def blob(self) -> MappedBlob | None:
        """The mapped entry the loaded weights are views of (None without an entry)."""
        return None if self.cache is None else self.cache.blob

    def finish(self, weights: Mapping[str, W]) -> dict[str, W]:
        """Rewrite the entry when any weight had to be converted, and return the weights mapped back from it: they
        replace the converted arrays, so a first load ends with what a cached load has (file pages, no conversion
        buffers). Empty when nothing was written or the entry cannot be read back.

        The stored weights this load did not ask for stay in the entry: another load of the same file may ask for
        only some of them (an onnx load keeps its token embedding on native), and dropping the rest made the next
        full load repack the whole model."""
        if self.cache is None or not self.converted:
            return {}
        not_asked = {name: cached for name, cached in self.restored.items() if name not in self.keys}
        self.cache.store({**not_asked, **{name: CachedWeight(key, weights[name]) for name, key in self.keys.items()
                                          if name in weights}})
        if self.spool is not None:
            self.spool.close()
        return {name: cached.weight for name, cached in self.cache.restore().items()
                if name in weights and cached.key == self.keys.get(name)}


def _stored_ancestor(array: np.ndarray, arrays: Mapping[int, Any]) -> np.ndarray | None:
    """The array among ``arrays`` (keyed by id) that ``array`` is a contiguous view of (a fused weight's rows)."""
    if not array.flags.c_contiguous:
        return None
    base = array.base
    while isinstance(base, np.ndarray):
        if id(base) in arrays and base.flags.c_contiguous:
            return base
        base = base.base
    return None


def _place(array: np.ndarray, stored: Mapping[int, tuple[int, np.ndarray]]) -> list[Any]:
    """``[offset, dtype, shape]`` of an array in the blob: its own bytes, or its bytes inside a stored array."""
    if id(array) in stored:
        offset = stored[id(array)][0]
    else:
        ancestor = _stored_ancestor(array, stored)
        assert ancestor is not None
        offset = stored[id(ancestor)][0] + (int(array.ctypes.data) - int(ancestor.ctypes.data))
    return [offset, array.dtype.str, list(array.shape)]
