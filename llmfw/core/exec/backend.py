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

Op semantics are those documented at the top of :mod:`llmfw.core.ir.graph`; the numpy backend
(``llmfw.plugins.backends.numpy``) is the reference implementation.

Split execution contract (what :meth:`Backend.compile` returns)::

    run = backend.compile(split, kv)
    outputs = run(inputs)        # inputs: {node_id: native value} for every id in split.input_ids
                                 # outputs: {node_id: native value} for every id in split.output_ids

Backends declare themselves (the core reads these declarations and names no backend): :attr:`Backend.is_host`
(may hold the token embedding and the ops other backends lack, like llama.cpp's CPU backend),
:attr:`Backend.default_priority` (device → priority for the default choice), :meth:`Backend.devices` (the
devices found here) and :attr:`Backend.options_schema` (a pydantic model of the options
``ModelParams(backend_options={name: {...}})`` gives it, validated with a did-you-mean error;
:attr:`Backend.environment_options` maps the CLI's environment variables onto them).

Threads are a property of each compute call: the context hands its ``n_threads`` to :meth:`Backend.use_threads`
before it computes (None: the ``n_threads`` option of the model's backend options, else the library default);
creating a context changes nothing on the model's shared backends.

``input`` nodes never appear in a split: their values are handed in through ``inputs`` (already converted
with :meth:`from_numpy`). ``weight`` nodes do appear; the backend resolves them to the handle it returned from
:meth:`load_weight` for ``attrs["name"]``. ``attention`` and ``k_shift`` nodes read and write the KV storage in
``kv[(attrs["cache"], attrs["layer"])]`` (allocated by this backend's :meth:`alloc_kv`).
"""
from __future__ import annotations

import difflib
import importlib.util
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Hashable, Mapping, Protocol, TypeVar, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import BackendUnavailable, ConfigError, LLMFWError, UnknownBackend
from ..validation import validation_error_message
from ..ir.graph import Node
from ..ir.passes import RewriteRule

log = logging.getLogger(__name__)

#: value handed between splits: a backend-native tensor (numpy array, torch tensor, ORT value). Opaque to the core,
#: which only hands it back to a backend (``to_numpy``, ``import_value``, a compiled split)
NativeValue = object
#: a loaded weight as its backend keeps it (opaque to the core)
WeightHandle = object
#: one (cache, layer)'s KV storage as its backend allocated it (opaque to the core)
KVHandle = object


@runtime_checkable
class ArrayKV(Protocol):
    """KV storage whose K and V are numpy arrays ``[n_head_kv, n_cells, head_dim]``: what the default
    :meth:`Backend.read_kv_cells` / :meth:`Backend.write_kv_cells` serve."""

    k: np.ndarray
    v: np.ndarray


def _array_kv(backend: "Backend", kv: KVHandle) -> ArrayKV:
    if not isinstance(kv, ArrayKV):
        raise NotImplementedError(f"backend {backend.spec}: its KV storage is not numpy arrays; it must override "
                                  "read_kv_cells / write_kv_cells")
    return kv
#: a compiled split: ``{node_id: value}`` for split.input_ids → ``{node_id: value}`` for split.output_ids
CompiledSplit = Callable[[Mapping[int, NativeValue]], dict[int, NativeValue]]


@dataclass(frozen=True)
class WeightSource:
    """Where a weight's bytes come from: everything a backend needs to convert it once.

    ``raw`` is the tensor's bytes (uint8, possibly a zero-copy view into an mmap'ed file that is closed after
    loading — never keep a reference to it, convert it or keep :meth:`kept_raw`). ``ne`` is ggml's shape (``ne0``
    contiguous); the numpy shape is ``tuple(reversed(ne))``. ``name`` is the name under which the graph refers to
    the weight (for a duplicated tensor, e.g. a tied ``output.weight``, it differs from ``source_name``, the tensor
    in the file).
    """

    name: str
    source_name: str
    ggml_type: int
    ne: tuple[int, ...]
    raw: np.ndarray
    #: what the graph does with it: "mul_mat" (matrix multiplied with activations), "get_rows" (embedding
    #: table), "mul"/"add" (norm weights, biases, elementwise), "rope" (freq factors) — a hint to pick a form
    usage: frozenset[str] = frozenset()
    #: the bytes of ``raw`` as a read-only array that outlives the load (a mapping of the file of its own, see
    #: :meth:`kept_raw`), or None when the loader cannot give one (read mode, generated weights)
    lasting: Callable[[], np.ndarray | None] = field(default=lambda: None, repr=False, compare=False)

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    def kept_raw(self) -> np.ndarray:
        """The bytes for a backend that keeps raw blocks (a lookup table decoded row by row): the lasting mapping
        when there is one — only the pages read become resident, not the whole tensor — else a copy."""
        lasting = self.lasting()
        return lasting if lasting is not None else np.array(self.raw, dtype=np.uint8, copy=True)


@dataclass(frozen=True)
class KVLayerShape:
    """Storage one layer needs in one KV cache: ``n_cells`` rows of K [n_head_kv, head_dim_k] and V."""

    cache: str
    layer: int
    n_cells: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int


class BackendOptions(BaseModel):
    """Options every backend accepts; a backend with its own subclasses this and names the subclass in
    :attr:`Backend.options_schema`. Unknown keys are errors (see :func:`parse_backend_options`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: CPU threads for this backend's kernels when the context does not name a count (None: the library's)
    n_threads: int | None = Field(default=None, ge=1)


OptionsT = TypeVar("OptionsT", bound=BackendOptions)

#: backend registry name → that backend's raw options (``ModelParams.backend_options``)
BackendOptionsByName = Mapping[str, Mapping[str, Any]]


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
    #: liveness (core ``last_uses``): index in ``nodes`` → ids of the values no later node of the split reads
    #: (never an output or a weight), which the backend may free once that node ran
    release_after: dict[int, tuple[int, ...]] = field(default_factory=dict)


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
    #: ops of :data:`llmfw.core.ir.graph.OPS` this backend implements; others fall back to numpy
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
    #: weight usage (a TensorSpec's ``usage``) → the backend spec this backend would rather leave such weights
    #: to when it is the default: the model places them there when that backend runs here and takes them (the
    #: scheduler runs the nodes reading them there too), else keeps them here
    delegated_weights: ClassVar[Mapping[str, str]] = {}
    #: fusions this backend implements as ops of its own: the core's pass manager applies them to the nodes
    #: placed here (core/ir/passes.py), and :meth:`compile` then sees the rule's ``op``
    rewrite_rules: ClassVar[tuple[RewriteRule, ...]] = ()
    #: the pydantic model of this backend's options (``ModelParams(backend_options={name: {...}})``)
    options_schema: ClassVar[type[BackendOptions]] = BackendOptions
    #: True when :meth:`to_numpy` of a split's output is an array that no later compute writes, so the caller may
    #: keep it: the context then keeps a step's logits as the backend made them instead of copying them
    fresh_outputs: ClassVar[bool] = False
    #: environment variable → option field: what the CLI maps onto the options (conveniences for the command
    #: line; ``load_model`` in Python reads only ``backend_options``)
    environment_options: ClassVar[Mapping[str, str]] = {}

    def __init__(self, device: str | None = None, options: BackendOptions | None = None):
        self.device = device
        self.options = options if options is not None else self.options_schema()
        #: the thread count the kernels use now (None: the library default); changed by :meth:`use_threads`
        self.n_threads: int | None = None

    def options_as(self, schema: type[OptionsT]) -> OptionsT:
        """:attr:`options` typed as this backend's schema (validated into it when built from another model)."""
        if isinstance(self.options, schema):
            return self.options
        return schema.model_validate(self.options.model_dump(exclude_unset=True))

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
    def prepare_process(cls, options: BackendOptions) -> None:
        """Apply the options a library reads once, when it loads (OpenMP's wait policy): called with the validated
        options before :meth:`check_available`, which may import that library."""

    @classmethod
    def devices(cls) -> list[str]:
        """The devices this backend can run on here (``["cpu"]``, ``["cpu", "cuda:0"]``, or ``[]``). The default
        asks :meth:`check_available` about the devices of :attr:`default_priority` (the CPU when none)."""
        found = []
        for device in cls.default_priority or {"cpu": 0}:
            try:
                cls.check_available(None if device == "cpu" else device)
            except LLMFWError:
                continue
            found.append(device)
        return found

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
    def cache_dirs(cls, environ: Mapping[str, str]) -> list[Path]:
        """Folders of files this backend derives from model files and rebuilds when they are missing (converted
        weights): `llmfw models` lists their entries with their size and `llmfw models --prune` removes them.
        ``environ`` is the CLI's environment (:attr:`environment_options` may move them). Default: none."""
        return []

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

    def decline_reason(self, ops: frozenset[str], weight_types: Mapping[str, int]) -> str | None:
        """Why this backend cannot run the part of a model placed on it (None: it can). ``ops``: the graph ops of
        that part (a one-token graph of the model, before the core's passes); ``weight_types``: the GGML type of
        each weight it would load. Asked once at load, before any weight is converted: a default backend that
        declines is skipped for the next by priority (``-v`` says why), one asked for by name fails the load with
        the reason. Default: never declines (ops it lacks run on the host)."""
        return None

    # -- weights ----------------------------------------------------------------------------------------
    @abstractmethod
    def load_weight(self, source: WeightSource) -> WeightHandle:
        """Convert one weight once, at load time, into this backend's native form; return its handle.

        The handle is stored by the model under ``source.name`` and handed back to the backend through
        ``weight`` nodes in compiled splits (see :meth:`weight`).
        """

    def begin_loading(self, model_file: Path) -> None:
        """Called once before the weights of ``model_file`` go through :meth:`load_weight` (a backend may restore
        its converted forms from a cache of its own instead of converting)."""

    def end_loading(self) -> None:
        """Called once after every weight of the file was loaded (a backend may persist its converted forms)."""

    def weight(self, name: str) -> WeightHandle:
        """The handle :meth:`load_weight` returned for ``name`` (kept by the backend in ``self.weights``)."""
        return self.weights[name]

    @property
    def weights(self) -> dict[str, WeightHandle]:
        if not hasattr(self, "_weights"):
            self._weights: dict[str, WeightHandle] = {}
        return self._weights

    def free_weights(self) -> None:
        """Drop every weight (model closed or load cancelled)."""
        self.weights.clear()

    def resident_bytes(self, ggml_type: int, ne: tuple[int, ...], usage: frozenset[str], file_bytes: int) -> int:
        """Bytes this backend will keep for a weight of this type, shape and use (checked against the memory
        available before a load: core/runtime/memory_fit.py). Default: its bytes in the file."""
        return file_bytes

    def weight_nbytes(self) -> int:
        """Bytes of distinct weight storage: the numpy arrays of every handle (a handle itself, or the array
        fields of a handle object), counted once per underlying buffer, so a fused weight and its parts' views
        count once; a view of a file mapping (``WeightSource.lasting``) counts its own bytes, not the file's.
        A backend keeping device tensors overrides it."""
        buffers: dict[tuple[int, int], int] = {}
        for handle in self.weights.values():
            fields = vars(handle).values() if hasattr(handle, "__dict__") else ()
            for array in [handle] if isinstance(handle, np.ndarray) else fields:
                if not isinstance(array, np.ndarray):
                    continue
                base: object = array if array.base is None else array.base  # a mapping's view: a memoryview
                if isinstance(base, np.ndarray):
                    buffers[(id(base), 0)] = int(base.nbytes)
                else:  # memory numpy does not own (a mapping): this view's part of it
                    buffers[(id(base), int(array.ctypes.data))] = int(array.nbytes)
        return sum(buffers.values())

    def fusion_key(self, weight_name: str) -> Hashable | None:
        """Which weights :meth:`fuse_weights` can stack with the loaded weight ``weight_name``: those of an equal
        key. The core splits each group of matmuls sharing an input by this key and asks :meth:`fuse_weights`
        for every sub-group of two or more (e.g. a block-quantized backend keys by its block layout, so a group
        of mixed quant types still fuses its same-type subsets); None = never fuse this weight. The default:
        one key for every weight."""
        return ()

    def fuse_weights(self, name: str, parts: tuple[str, ...]) -> bool:
        """Build, once at load, the weight ``name``: the matrices ``parts`` (loaded here) stacked by output rows,
        ``[Σ n_out, n_in]``, multiplied with one input in one ``mul_mat`` (core/ir/passes.py). Keep it in
        :attr:`weights` under ``name`` and return True; False when this backend cannot (e.g. mixed quant types),
        and the graph then keeps the separate matmuls. The parts may still be used alone afterwards."""
        return False

    # -- KV storage -------------------------------------------------------------------------------------
    @abstractmethod
    def alloc_kv(self, shape: KVLayerShape) -> KVHandle:
        """Allocate (zero-filled) K and V storage for one layer of one cache; return an opaque handle.

        Zero-filled matters: masked cells are multiplied by zero probabilities, and garbage NaNs would leak.
        """

    def read_kv_cells(self, kv: KVHandle, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V rows of ``cells`` as float32 numpy ``[n_head_kv, len(cells), head_dim]`` (saved states).

        The default serves storage whose ``k`` / ``v`` are numpy arrays ``[n_head_kv, n_cells, head_dim]`` of any
        float type (an f16 cache's values widen exactly; :meth:`write_kv_cells` rounds to the storage's type)."""
        storage = _array_kv(self, kv)
        return (np.ascontiguousarray(storage.k[:, cells], dtype=np.float32),
                np.ascontiguousarray(storage.v[:, cells], dtype=np.float32))

    def write_kv_cells(self, kv: KVHandle, cells: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Overwrite the K and V rows of ``cells`` in place (a loaded state)."""
        storage = _array_kv(self, kv)
        storage.k[:, cells] = k
        storage.v[:, cells] = v

    # -- compute ----------------------------------------------------------------------------------------
    @abstractmethod
    def compile(self, split: Split, kv: Mapping[tuple[str, int], KVHandle]) -> CompiledSplit:
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

    def use_threads(self, n_threads: int | None) -> None:
        """Run the next compute calls with ``n_threads`` CPU threads (None: the ``n_threads`` option, else the
        library default). Called by the context before every compute; cheap when the count is unchanged."""
        wanted = n_threads if n_threads is not None else self.options.n_threads
        if wanted != self.n_threads:
            self.set_n_threads(wanted)

    def set_n_threads(self, n_threads: int | None) -> None:
        """Apply a changed thread count to this backend's kernels (override; call the base to record it)."""
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
    from ..plugins import registry

    reg = registry("backends")
    if name not in reg:
        raise UnknownBackend(f"unknown backend {name!r}; known: {', '.join(reg.names()) or '(none)'}")
    try:
        return reg.get_class(name, Backend)
    except Exception as exc:  # a backend whose module cannot import is unavailable
        from ..errors import PluginError

        if isinstance(exc, PluginError) and isinstance(exc.__cause__, ImportError):
            raise BackendUnavailable(f"backend {name!r} cannot be imported: {exc.__cause__}") from exc
        raise


def create_backend(spec: str, options: BackendOptionsByName | None = None) -> Backend:
    """Instantiate the backend for ``spec`` after checking it can run here, with its entry of ``options``
    (backend name → raw options) validated against its :attr:`Backend.options_schema`."""
    name, device = parse_backend_spec(spec)
    cls = backend_class(name)
    parsed = parse_backend_options(cls, (options or {}).get(name, {}))
    cls.prepare_process(parsed)
    cls.check_available(device)
    return cls(device=device, options=parsed)


def parse_backend_options(cls: type[Backend], raw: Mapping[str, Any]) -> BackendOptions:
    """``raw`` validated against ``cls.options_schema``; a ConfigError names every bad key (with the closest
    valid one for a misspelt key) and what the schema expects."""
    schema = cls.options_schema
    try:
        return schema.model_validate(dict(raw))
    except ValidationError as exc:
        problems = validation_error_message(exc, known_keys=schema.model_fields, key_noun="option")
        raise ConfigError(f"invalid options for backend {cls.name!r}: {problems}") from None


def check_backend_options(options: BackendOptionsByName) -> None:
    """Validate every entry of ``options`` (backend name → raw options) against its backend's schema, also for
    backends the placement does not use: a misspelt backend name or option is an error, not ignored."""
    from ..plugins import registry

    known = registry("backends").names()
    for name, raw in options.items():
        if name not in known:
            match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {match[0]!r}?" if match else f"known backends: {', '.join(known) or '(none)'}"
            raise ConfigError(f"backend_options names backend {name!r}, which is not registered; {hint}")
        if not isinstance(raw, Mapping):
            raise ConfigError(f"backend_options[{name!r}] must be a mapping of option → value, got "
                              f"{type(raw).__name__}")
        try:
            cls = backend_class(name)
        except BackendUnavailable:  # not importable here: its options are checked if it is ever used
            continue
        parse_backend_options(cls, raw)


def backend_options_from_environment(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """The options the registered backends map from environment variables
    (:attr:`Backend.environment_options`) — the CLI's conveniences, merged below the configured options."""
    from ..plugins import registry

    options: dict[str, dict[str, str]] = {}
    for name in registry("backends").names():
        try:
            cls = backend_class(name)
        except LLMFWError:  # a backend that cannot import has no options to set
            continue
        found = {option: environ[var] for var, option in cls.environment_options.items() if var in environ}
        if found:
            options[name] = found
    return options


def merge_backend_options(below: BackendOptionsByName, above: BackendOptionsByName) -> dict[str, dict[str, Any]]:
    """Per backend, ``above``'s options over ``below``'s."""
    merged = {name: dict(raw) for name, raw in below.items()}
    for name, raw in above.items():
        merged[name] = {**merged.get(name, {}), **raw}
    return merged


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
    from ..plugins import registry

    candidates = []
    for name in registry("backends").names():
        try:
            cls = backend_class(name)
        except LLMFWError as exc:  # a plugin that cannot be imported offers nothing
            log.debug("backend %s not considered as the default: %s", name, exc)
            continue
        candidates += [(int(priority), name, device) for device, priority in cls.default_priority.items()]
    return sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))


def choose_default_backend(*, devices_only: bool = False, declined: Mapping[str, str] | None = None) -> BackendChoice:
    """The backend ``backend=None`` means: among the registered backends' declarations
    (:attr:`Backend.default_priority`), the highest priority that can run here. Built in: ``torch:cuda`` (a
    CUDA GPU and torch), then ``onnx`` on the CPU (onnxruntime importable), then ``numpy``. ``devices_only``:
    only declarations for a device other than the CPU (where ``n_gpu_layers`` offloads). ``declined``: spec →
    why it declined the model being loaded (:meth:`Backend.decline_reason`): skipped, saying so."""
    skipped: list[str] = []
    for priority, name, device in _default_candidates():
        if devices_only and device == "cpu":
            continue
        spec = name if device == "cpu" else f"{name}:{device}"
        if declined and spec in declined:
            skipped.append(f"{spec}: declines this model: {declined[spec]}")
            continue
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
    what = "a device (GPU) backend" if devices_only else "the default"
    raise BackendUnavailable(f"no registered backend can run here as {what}"
                             + (f" ({'; '.join(skipped)})" if skipped else "") + "; name one with backend=...")


def choose_host_backend(placed: Mapping[str, Backend]) -> str:
    """The spec of the host backend (token embedding, ops a backend lacks): a placed backend that declares
    :attr:`Backend.is_host`, else the highest-priority registered host backend that runs on the CPU."""
    for spec, backend in placed.items():
        if backend.is_host:
            return spec
    from ..plugins import registry

    hosts: list[tuple[int, str]] = []
    for name in registry("backends").names():
        try:
            cls = backend_class(name)
        except LLMFWError:
            continue
        if cls.is_host and cls.default_unavailable_reason("cpu") is None:
            hosts.append((int(cls.default_priority.get("cpu", 0)), name))
    if not hosts:
        raise BackendUnavailable("no registered backend declares itself the host (is_host), so nothing can hold "
                                 "the token embedding")
    return min(hosts, key=lambda h: (-h[0], h[1]))[1]


def default_backend_spec() -> str:
    """The spec ``backend=None`` means (see :func:`choose_default_backend`)."""
    return choose_default_backend().spec
