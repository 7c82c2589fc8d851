"""Backends: where weights live and graph ops run.

A :class:`Backend` is a plugin (registry kind ``"backends"``) that

1. converts every model weight ONCE at load time into its best native form (:meth:`Backend.load_weight`;
   numpy: dequantized float32, torch: int8 / bf16 / whatever is fastest on its device);
2. allocates the per-context KV cache storage of the layers it owns (:meth:`Backend.alloc_kv`);
3. compiles a *split* — a run of graph nodes the scheduler assigned to it — into a callable
   (:meth:`Backend.compile`), which the context reuses for as long as it reuses the graph;
4. moves activations in and out (:meth:`Backend.from_numpy` / :meth:`Backend.to_numpy`,
   :meth:`Backend.import_value` for a copy from another backend at a split cut).

Backend *instances* are created per backend spec: ``"numpy"``, ``"torch"`` (= ``"torch:cpu"``),
``"torch:cuda"``, ``"torch:cuda:1"``... The registry name is the part before the first ``:``; the rest is the
device, handed to the constructor. :func:`parse_backend_spec` / :func:`create_backend` do that.

Op semantics are those documented at the top of :mod:`llmfw.core.graph`; the numpy backend
(``llmfw.plugins.backends.numpy_cpu``) is the reference implementation.

Split execution contract (what :meth:`Backend.compile` returns)::

    run = backend.compile(split, kv)
    outputs = run(inputs)        # inputs: {node_id: native value} for every id in split.input_ids
                                 # outputs: {node_id: native value} for every id in split.output_ids

``input`` nodes never appear in a split: their values are handed in through ``inputs`` (already converted
with :meth:`from_numpy`). ``weight`` nodes do appear; the backend resolves them to the handle it returned from
:meth:`load_weight` for ``attrs["name"]``. ``attention`` and ``k_shift`` nodes read and write the KV storage in
``kv[(attrs["cache"], attrs["layer"])]`` (allocated by this backend's :meth:`alloc_kv`).
"""
from __future__ import annotations

import importlib.util
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from .errors import BackendUnavailable, LLMFWError, UnknownBackend
from .graph import Node

log = logging.getLogger(__name__)

#: value handed between splits: a backend-native tensor (numpy array, torch tensor, ...)
NativeValue = Any
#: a compiled split: ``{node_id: value}`` for split.input_ids → ``{node_id: value}`` for split.output_ids
CompiledSplit = Callable[[Mapping[int, NativeValue]], dict[int, NativeValue]]


@dataclass(frozen=True)
class WeightSource:
    """Where a weight's bytes come from: everything a backend needs to convert it once.

    ``raw`` is the tensor's bytes (uint8, possibly a zero-copy view into an mmap'ed file that is closed after
    loading — never keep a reference to it, copy or convert). ``ne`` is ggml's shape (``ne0`` contiguous); the
    numpy shape is ``tuple(reversed(ne))``. ``name`` is the name under which the graph refers to the weight (for a
    duplicated tensor, e.g. a tied ``output.weight``, it differs from ``source_name``, the tensor in the file).
    """

    name: str
    source_name: str
    ggml_type: int
    ne: tuple[int, ...]
    raw: np.ndarray
    #: what the graph does with it: "mul_mat" (matrix multiplied with activations), "get_rows" (embedding
    #: table), "mul"/"add" (norm weights, biases, elementwise), "rope" (freq factors) — a hint to pick a form
    usage: frozenset[str] = frozenset()

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


@dataclass(frozen=True)
class KVLayerShape:
    """Storage one layer needs in one KV cache: ``n_cells`` rows of K [n_head_kv, head_dim_k] and V."""

    cache: str
    layer: int
    n_cells: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int


@dataclass
class Split:
    """A run of graph nodes (topological order) that one backend executes in one go.

    ``input_ids``: ids of nodes computed outside this split (graph inputs or other splits' nodes) that nodes
    of this split consume; ``output_ids``: ids of this split's nodes that later splits or graph outputs need.
    """

    backend: "Backend"
    nodes: list[Node] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


class Backend(ABC):
    """A device + op implementations. Subclass, list ``supported_ops``, register under ``name``.

    One instance serves one device for one model (weights) and all of that model's contexts (each context
    allocates its own KV storage through :meth:`alloc_kv`). Instances must be safe to use from one thread at a
    time; the scheduler never runs two splits concurrently.
    """

    #: registry name ("numpy", "torch", ...)
    name: ClassVar[str] = ""
    #: the pip extra that installs this backend's dependencies (for the BackendUnavailable message)
    pip_extra: ClassVar[str | None] = None
    #: ops of :data:`llmfw.core.graph.OPS` this backend implements; others fall back to numpy
    supported_ops: ClassVar[frozenset[str]] = frozenset()
    #: True for the backend that may hold the token embedding (get_rows on token_embd, like llama.cpp's CPU)
    is_host: ClassVar[bool] = False
    #: importable modules this backend needs (checked with ``find_spec``, without importing them): what
    #: ``llmfw plugins`` reports as "not installed"
    requires: ClassVar[tuple[str, ...]] = ()
    #: how this backend offers itself as the default (``backend=None``): device -> priority. The default is
    #: the highest-priority device whose :meth:`default_unavailable_reason` is None; no entry = never chosen
    #: by default (only when asked for by name)
    default_priority: ClassVar[Mapping[str, int]] = {}

    def __init__(self, device: str | None = None, n_threads: int | None = None):
        self.device = device
        self.n_threads = n_threads

    # -- identity ---------------------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """The backend spec this instance serves: ``"numpy"``, ``"torch:cuda"``..."""
        return f"{self.name}:{self.device}" if self.device else self.name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"

    @classmethod
    def check_available(cls, device: str | None = None) -> None:
        """Raise :class:`BackendUnavailable` (naming the pip extra) when this backend cannot run here."""

    @classmethod
    def install_hint(cls) -> str:
        """How to install what :attr:`requires` names: the pip extra when there is one."""
        if cls.pip_extra:
            return f"pip install 'llmfw[{cls.pip_extra}]'"
        return "pip install " + " ".join(cls.requires)

    @classmethod
    def missing_requirements(cls) -> list[str]:
        """The modules of :attr:`requires` that are not installed (nothing is imported to find out)."""
        return [module for module in cls.requires if not _module_installed(module)]

    @classmethod
    def default_unavailable_reason(cls, device: str) -> str | None:
        """Why this backend cannot be the default on ``device`` here (None: it can). Cheap checks first, so
        that ruling a backend out never imports a large library it does not need."""
        missing = cls.missing_requirements()
        if missing:
            return f"{', '.join(missing)} not installed"
        try:
            cls.check_available(None if device == "cpu" else device)
        except LLMFWError as exc:
            return str(exc)
        return None

    # -- weights ----------------------------------------------------------------------------------------
    @abstractmethod
    def load_weight(self, source: WeightSource) -> Any:
        """Convert one weight once, at load time, into this backend's native form; return its handle.

        The handle is stored by the model under ``source.name`` and handed back to the backend through
        ``weight`` nodes in compiled splits (see :meth:`weight`).
        """

    def begin_loading(self, model_file: Path) -> None:
        """Called once before the weights of ``model_file`` go through :meth:`load_weight` (a backend may restore
        its converted forms from a cache of its own instead of converting)."""

    def end_loading(self) -> None:
        """Called once after every weight of the file was loaded (a backend may persist its converted forms)."""

    def weight(self, name: str) -> Any:
        """The handle :meth:`load_weight` returned for ``name`` (kept by the backend in ``self.weights``)."""
        return self.weights[name]

    @property
    def weights(self) -> dict[str, Any]:
        if not hasattr(self, "_weights"):
            self._weights: dict[str, Any] = {}
        return self._weights

    def free_weights(self) -> None:
        """Drop every weight (model closed or load cancelled)."""
        self.weights.clear()

    # -- KV storage -------------------------------------------------------------------------------------
    @abstractmethod
    def alloc_kv(self, shape: KVLayerShape) -> Any:
        """Allocate (zero-filled) K and V storage for one layer of one cache; return an opaque handle.

        Zero-filled matters: masked cells are multiplied by zero probabilities, and garbage NaNs would leak.
        """

    def read_kv_cells(self, kv: Any, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V rows of ``cells`` as float32 numpy ``[n_head_kv, len(cells), head_dim]`` (saved states).

        The default serves storage whose ``k`` / ``v`` are numpy arrays ``[n_head_kv, n_cells, head_dim]``."""
        return np.ascontiguousarray(kv.k[:, cells]), np.ascontiguousarray(kv.v[:, cells])

    def write_kv_cells(self, kv: Any, cells: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Overwrite the K and V rows of ``cells`` in place (a loaded state)."""
        kv.k[:, cells] = k
        kv.v[:, cells] = v

    # -- compute ----------------------------------------------------------------------------------------
    @abstractmethod
    def compile(self, split: Split, kv: Mapping[tuple[str, int], Any]) -> CompiledSplit:
        """Turn a split into a callable (see the module docstring); called once per graph build."""

    @abstractmethod
    def from_numpy(self, array: np.ndarray) -> NativeValue:
        """A numpy array (graph input or a value from another backend) as this backend's tensor."""

    @abstractmethod
    def to_numpy(self, value: NativeValue) -> np.ndarray:
        """This backend's tensor as a numpy array (a copy, or a view the caller will not keep)."""

    def import_value(self, value: NativeValue, source: "Backend") -> NativeValue:
        """A value produced by ``source`` as this backend's tensor (override for direct device copies)."""
        if source is self:
            return value
        return self.from_numpy(source.to_numpy(value))

    def set_n_threads(self, n_threads: int | None) -> None:
        """Use ``n_threads`` CPU threads for this backend's kernels (None: the library default)."""
        self.n_threads = n_threads

    def synchronize(self) -> None:
        """Wait for queued work (asynchronous devices); the scheduler calls it before reading outputs."""


def release_freed_memory() -> None:
    """Give freed heap pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere). Backends call it after
    converting weights: glibc keeps freed temporaries, and weights of a few MB live in the heap rather than in
    their own mappings, so without it RSS after load would count what was already freed."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))  # the process's own symbols include the C library's
    except (OSError, AttributeError, TypeError):  # not glibc (or no dlopen of the process): nothing to do
        pass


def parse_backend_spec(spec: str) -> tuple[str, str | None]:
    """``"torch:cuda:1"`` → ``("torch", "cuda:1")``; ``"numpy"`` → ``("numpy", None)``."""
    name, _, device = spec.strip().partition(":")
    return name, (device or None)


def backend_class(name: str) -> type[Backend]:
    from .plugins import registry

    reg = registry("backends")
    if name not in reg:
        raise UnknownBackend(f"unknown backend {name!r}; known: {', '.join(reg.names()) or '(none)'}")
    try:
        return reg.get(name)
    except Exception as exc:  # noqa: BLE001 - a backend whose module cannot import is unavailable
        from .errors import PluginError

        if isinstance(exc, PluginError) and isinstance(exc.__cause__, ImportError):
            raise BackendUnavailable(f"backend {name!r} cannot be imported: {exc.__cause__}") from exc
        raise


def create_backend(spec: str, n_threads: int | None = None) -> Backend:
    """Instantiate the backend for ``spec`` after checking it can run here."""
    name, device = parse_backend_spec(spec)
    cls = backend_class(name)
    cls.check_available(device)
    return cls(device=device, n_threads=n_threads)


def _module_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return False


@dataclass(frozen=True)
class BackendChoice:
    """The default backend and why: ``spec`` is what ``backend=None`` resolves to, ``reason`` says so in words."""

    spec: str
    reason: str


def _default_candidates() -> list[tuple[int, str, str]]:
    """(priority, registry name, device) for every default declaration, best first."""
    from .plugins import registry

    candidates = []
    for name in registry("backends").names():
        try:
            cls = backend_class(name)
        except LLMFWError as exc:  # a plugin that cannot be imported offers nothing
            log.debug("backend %s not considered as the default: %s", name, exc)
            continue
        candidates += [(int(priority), name, device) for device, priority in cls.default_priority.items()]
    return sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))


def choose_default_backend() -> BackendChoice:
    """The backend ``backend=None`` means: among the registered backends' declarations
    (:attr:`Backend.default_priority`), the highest priority that can run here. Built in: ``torch:cuda`` (a
    CUDA GPU and torch), then ``onnx`` on the CPU (onnxruntime importable), then ``numpy``."""
    skipped: list[str] = []
    for priority, name, device in _default_candidates():
        spec = name if device == "cpu" else f"{name}:{device}"
        try:
            why_not = backend_class(name).default_unavailable_reason(device)
        except Exception as exc:  # noqa: BLE001 - one broken plugin's check must not leave no default at all
            why_not = f"its availability check failed: {type(exc).__name__}: {exc}"
        if why_not is None:
            reason = f"the highest-priority backend usable here (priority {priority})"
            if skipped:
                reason += "; skipped " + "; ".join(skipped)
            return BackendChoice(spec, reason)
        skipped.append(f"{spec}: {why_not}")
    raise BackendUnavailable("no registered backend can run here as the default"
                             + (f" ({'; '.join(skipped)})" if skipped else "") + "; name one with backend=...")


def default_backend_spec() -> str:
    """The spec ``backend=None`` means (see :func:`choose_default_backend`)."""
    return choose_default_backend().spec
