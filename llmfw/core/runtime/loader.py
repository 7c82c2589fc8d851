"""Model-file loaders: metadata, arch-templated keys, the weights map, and loading the data into backends.

A loader (registry kind ``"loaders"``; the built-in one is ``"gguf"``) opens a model file (split files are
handled by :mod:`llmfw.core.format.gguf`), applies ``kv_overrides`` to its metadata, exposes the metadata through a
:class:`MetadataView` (``keys.get_int("{arch}.block_count")``) and the tensors through :meth:`tensor_record`
/ :meth:`tensor_bytes`. :meth:`ModelFileLoader.load_all_data` hands each planned weight to its backend, one
tensor at a time, reporting progress and honouring cancellation.
"""
from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import LoadCancelled, ModelError
from ..format.mapped_pages import drop_mapped_pages
from ..format.metadata import MetadataView as MetadataView  # its old home: still importable from here

if TYPE_CHECKING:
    from ..exec.backend import Backend

log = logging.getLogger(__name__)

#: receives the fraction loaded (0..1); returning False cancels the load
ProgressCallback = Callable[[float], "bool | None"]


@dataclass(frozen=True)
class TensorRecord:
    """A tensor in the model file: name, ggml shape (``ne``), type and byte size."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    nbytes: int


@dataclass
class WeightLoad:
    """One weight to load: the graph name, the file tensor its data come from (or a generator), the backend."""

    name: str
    source_name: str | None
    ne: tuple[int, ...]
    backend: Backend
    usage: str = "mul_mat"
    generated: np.ndarray | None = None  # float32 data computed from metadata (no file tensor)
    layer: int = -1  # owning layer (INPUT_LAYER / OUTPUT_LAYER markers allowed)

    @property
    def file_tensor(self) -> str:
        """The file tensor the data come from (a generated weight has none)."""
        if self.source_name is None:
            raise ModelError(f"weight {self.name!r} is generated, not read from a file tensor")
        return self.source_name


class ModelFileLoader(ABC):
    """Reads one model (possibly several files). Subclasses register under a format name."""

    format_name: str = ""

    def __init__(self, path: str | os.PathLike[str], *, mode: str = "mmap",
                 kv_overrides: dict[str, Any] | None = None):
        self.path = path
        self.mode = mode
        self.metadata: dict[str, Any] = {}
        self.kv_overrides = dict(kv_overrides or {})

    @property
    def arch_name(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelError(f"{self.path}: missing or invalid 'general.architecture' (found {arch!r})")
        return arch

    @property
    def keys(self) -> MetadataView:
        return MetadataView(self.metadata, self.arch_name)

    def apply_overrides(self) -> None:
        """``kv_overrides`` replace (or add) metadata values, like llama.cpp's ``--override-kv``."""
        for key, value in self.kv_overrides.items():
            if not isinstance(value, (bool, int, float, str)):
                raise ModelError(f"kv override {key!r}: expected bool, int, float or str, got {type(value).__name__}")
            old = self.metadata.get(key)
            if old is not None and isinstance(old, bool) != isinstance(value, bool):
                raise ModelError(f"kv override {key!r}: the file holds {old!r}, the override {value!r} has another type")
            log.info("metadata override: %s = %r (was %r)", key, value, old)
            self.metadata[key] = value

    @abstractmethod
    def tensor_names(self) -> list[str]: ...

    @abstractmethod
    def tensor_record(self, name: str) -> TensorRecord: ...

    @abstractmethod
    def tensor_bytes(self, name: str) -> np.ndarray:
        """Raw bytes (uint8); may be a zero-copy view valid until :meth:`close`."""

    def lasting_tensor_bytes(self, name: str) -> np.ndarray | None:
        """The raw bytes of a tensor as a read-only array that stays valid after :meth:`close` and costs memory
        only for the parts read (a mapping of the file), or None when this loader cannot give one."""
        return None

    @abstractmethod
    def close(self) -> None: ...

    def has_tensor(self, name: str) -> bool:
        return name in set(self.tensor_names())

    def __enter__(self) -> "ModelFileLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- data ------------------------------------------------------------------------------------------
    def load_all_data(self, loads: list[WeightLoad], progress: ProgressCallback | None = None) -> dict[str, Any]:
        """Convert every weight on its backend; returns ``name → handle``.

        Progress is reported as the fraction of bytes done, before the first tensor and after each one; a
        callback returning False raises :class:`LoadCancelled` (the caller releases what was loaded).
        """
        from ..exec.backend import WeightSource

        sizes = [self._load_size(w) for w in loads]
        total = max(sum(sizes), 1)
        done = 0
        _report(progress, 0.0)
        handles: dict[str, Any] = {}
        for load, size in zip(loads, sizes):
            if load.generated is not None:
                from ..format.quants import GGMLType

                raw = np.ascontiguousarray(load.generated, dtype=np.float32).view(np.uint8).reshape(-1)
                source = WeightSource(load.name, load.name, int(GGMLType.F32), load.ne, raw,
                                      frozenset({load.usage}))
            else:
                record = self.tensor_record(load.file_tensor)
                source = WeightSource(load.name, load.file_tensor, record.ggml_type, record.ne,
                                      self.tensor_bytes(load.file_tensor), frozenset({load.usage}),
                                      lasting=partial(self.lasting_tensor_bytes, load.file_tensor))
            handle = load.backend.load_weight(source)
            drop_mapped_pages(source.raw)  # converted (or copied): its file pages need not stay resident
            load.backend.weights[load.name] = handle
            handles[load.name] = handle
            done += size
            _report(progress, done / total)
        return handles

    def _load_size(self, load: WeightLoad) -> int:
        if load.generated is not None:
            return int(load.generated.nbytes)
        return self.tensor_record(load.file_tensor).nbytes


def _report(progress: ProgressCallback | None, fraction: float) -> None:
    if progress is None:
        return
    if progress(min(max(fraction, 0.0), 1.0)) is False:
        raise LoadCancelled(f"model loading cancelled by the progress callback at {fraction:.0%}")


class GGUFLoader(ModelFileLoader):
    """Loader for GGUF files (single or split ``name-0000N-of-0000M.gguf``)."""

    format_name = "gguf"

    def __init__(self, path: str | os.PathLike[str], *, mode: str = "mmap",
                 kv_overrides: dict[str, Any] | None = None):
        super().__init__(path, mode=mode, kv_overrides=kv_overrides)
        from ..format.gguf import open_gguf

        if mode not in ("mmap", "read"):
            raise ModelError(f"load_mode must be 'mmap' or 'read', got {mode!r}")
        self.file = open_gguf(path, mode="mmap" if mode == "mmap" else "read")
        try:
            self.metadata = dict(self.file.metadata)
            self.apply_overrides()
        except BaseException:
            self.file.close()
            raise

    def tensor_names(self) -> list[str]:
        return list(self.file.tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self.file.tensors

    def tensor_record(self, name: str) -> TensorRecord:
        try:
            info = self.file.tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: no tensor {name!r}") from None
        return TensorRecord(info.name, tuple(int(d) for d in info.shape), int(info.ggml_type), int(info.nbytes))

    def tensor_bytes(self, name: str) -> np.ndarray:
        return self.file.tensor_bytes(name)

    def lasting_tensor_bytes(self, name: str) -> np.ndarray | None:
        return self.file.lasting_tensor_bytes(name)

    def close(self) -> None:
        self.file.close()


def open_loader(path: str | os.PathLike[str], *, mode: str = "mmap",
                kv_overrides: dict[str, Any] | None = None, format_name: str = "gguf") -> ModelFileLoader:
    """The registered loader for ``format_name`` opened on ``path``."""
    from ..plugins import registry

    cls = registry("loaders").get_class(format_name, ModelFileLoader)
    return cls(path, mode=mode, kv_overrides=kv_overrides)
