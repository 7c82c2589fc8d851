"""Loading a model: ``llmfw.load_model(path_or_name, params)`` → :class:`Model`.

The steps (docs/design.md, "The flow", 1-6): open the file through its loader (kv overrides applied) → pick the architecture
from ``general.architecture`` → read the hyperparameters (common, then the architecture's own) → build the
vocabulary → check the architecture's tensor list against the file → place each layer on a backend
(``backend`` / ``n_gpu_layers`` / ``placement``) → convert every weight once on its backend, reporting
progress. Any failure (including a cancel from the progress callback) releases what was loaded and closes the
file before the error propagates: no half-built model escapes.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..arch.architecture import INPUT_LAYER, OUTPUT_LAYER, Architecture, TensorSpec, get_architecture
from ..exec.backend import Backend, check_backend_options, choose_default_backend, choose_host_backend, create_backend
from ..errors import BackendUnavailable, MissingMetadataKey, ModelError, UnsupportedVariant
from ..format.quants import GGMLType
from ..validation import validation_error_message
from ..ir.hparams import HParams, make_hparams, read_common_hparams
from .collector import collector_paused
from .loader import ModelFileLoader, WeightLoad, open_loader
from .memory_fit import check_memory
from ..ir.passes import prepare_fused_weights, representative_graph
from ..tokenizer.vocab import Vocab

if TYPE_CHECKING:
    from ..ir.graph import Graph, Node
    from .context import Context, ContextParams

log = logging.getLogger(__name__)


class ModelParams(BaseModel):
    """How to load a model (pinned public API)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    #: None = the default backend, chosen from the backends' declarations (core/exec/backend.py
    #: choose_default_backend; built in: "torch:cuda" with a CUDA GPU and torch, else "onnx" when onnxruntime
    #: imports, else "numpy"); or a spec: "numpy", "torch", "torch:cuda", "onnx", "native", ...
    backend: str | None = None
    #: the last n layers go to the highest-priority device (GPU) backend that runs here (built in: "torch:cuda";
    #: n > n_layer: the output head too; -1: everything), like llama.cpp
    n_gpu_layers: int = Field(default=0, ge=-1)
    #: explicit layer → backend spec; layer n_layer means the output head. Wins over n_gpu_layers.
    placement: dict[int, str] | None = None
    load_mode: Literal["mmap", "read"] = "mmap"
    vocab_only: bool = False
    #: called with the fraction loaded; returning False cancels (LoadCancelled)
    progress: Callable[[float], bool | None] | None = None
    kv_overrides: dict[str, bool | int | float | str] = Field(default_factory=dict)
    #: per backend registry name, that backend's options, validated against its ``options_schema``
    #: (``{"torch": {"matmul": "int8"}, "numpy": {"n_threads": 2}}``); a misspelt key is a ConfigError
    backend_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    #: bytes the weights may take (None: ``$LLMFW_MEMORY_AVAILABLE``, else the kernel's MemAvailable; negative:
    #: no check); a load needing more is refused before anything is allocated (memory_fit.py)
    memory_available: int | None = None

    @field_validator("backend")
    @classmethod
    def _strip_backend(cls, value: str | None) -> str | None:
        return value.strip() if isinstance(value, str) else value


class Model:
    """A loaded model: architecture, hyperparameters, vocabulary, weights on their backends."""

    def __init__(self, *, path: Path, params: ModelParams, metadata: dict[str, Any], arch: Architecture | None,
                 hparams: HParams | None, vocab: Vocab, tensor_specs: list[TensorSpec] | None = None):
        self.path = path
        self.params = params
        self.metadata = metadata
        self.arch = arch
        self.hparams = hparams
        self.vocab = vocab
        self.tensor_specs = tensor_specs or []
        #: backend spec → instance
        self.backends: dict[str, Backend] = {}
        #: graph weight name → (backend, owning layer)
        self._weights: dict[str, tuple[Backend, int]] = {}
        #: graph weight name → (file tensor it was loaded from or None when generated, ggml shape)
        self.weight_sources: dict[str, tuple[str | None, tuple[int, ...]]] = {}
        #: weights fused at load (core/ir/passes.py): part names → the fused weight's name (a weight of its own,
        #: on the parts' backend, shape [Σ n_out, n_in])
        self.fused_weights: dict[tuple[str, ...], str] = {}
        self._fused_shapes: dict[str, tuple[int, ...]] = {}
        #: backend spec per layer index (0..n_layer-1) and for the output side (n_layer)
        self.layer_specs: list[str] = []
        self.host_backend: Backend | None = None
        #: which backend runs the model and why (``llmfw run -v``): "onnx (default: ...)" or "numpy (asked for)"
        self.backend_choice = ""
        #: weight usage → the backend spec the default backend left those weights to (Backend.delegated_weights)
        self.delegated: dict[str, str] = {}
        self.closed = False
        self._sha256: str | None = None

    # -- public ------------------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return int(self.hparams.n_vocab) if self.hparams is not None else int(self.vocab.n_vocab)

    @property
    def n_layer(self) -> int:
        return self.known_hparams.n_layer

    @property
    def n_embd(self) -> int:
        return self.known_hparams.n_embd

    @property
    def n_ctx_train(self) -> int:
        return self.known_hparams.n_ctx_train

    @property
    def arch_name(self) -> str:
        if self.hparams is not None:
            return self.hparams.arch
        name = self.metadata.get("general.architecture")
        return name if isinstance(name, str) else ""

    @property
    def known_hparams(self) -> HParams:
        """The hyperparameters (a ModelError for a vocab-only model whose architecture is unknown)."""
        if self.hparams is None:
            raise ModelError(f"{self.path.name} was loaded with vocab_only=True and has no hyperparameters "
                             f"(architecture {self.arch_name or '(none)'!r} unknown or its keys absent)")
        return self.hparams

    @property
    def known_arch(self) -> Architecture:
        """The architecture (a ModelError for a vocab-only model without one)."""
        if self.arch is None:
            raise ModelError(f"{self.path.name}: architecture {self.arch_name or '(none)'!r} is not known to any "
                             "plugin (the model was loaded with vocab_only=True)")
        return self.arch

    @property
    def host(self) -> Backend:
        """The host backend (token embedding, ops other backends lack); a vocab-only model has none."""
        if self.host_backend is None:
            raise ModelError(f"{self.path.name} has no backends (loaded with vocab_only=True)")
        return self.host_backend

    @property
    def vocab_only(self) -> bool:
        return self.params.vocab_only

    def new_context(self, params: ContextParams | None = None, **kw: Any) -> Context:
        """A fresh :class:`llmfw.Context` (its own KV cache) on this model."""
        from .context import Context

        return Context(self, params, **kw)

    def embed(self, texts: str | Sequence[str | Sequence[int]], pooling: str | None = None, normalize: bool = True,
              **kw: Any) -> np.ndarray | list[np.ndarray]:
        """Embeddings of ``texts`` (a string or a list of strings / token id lists), llama.cpp's way.

        Returns float32 ``[n_texts, n_embd]`` (``[n_embd]`` for one string); with ``pooling="none"`` a list of
        ``[n_tokens, n_embd]`` arrays (one array for one string). ``pooling`` None = the GGUF's
        ``pooling_type``. See :func:`llmfw.core.runtime.embedding.embed_texts` for the token counts too.
        """
        from .embedding import embed_texts

        result = embed_texts(self, texts, pooling, normalize, **kw)
        if result.pooling == "none":
            return result.vectors[0] if isinstance(texts, str) else result.vectors
        stacked = np.stack(result.vectors)
        return stacked[0] if isinstance(texts, str) else stacked

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render chat messages with the model's template (``tokenizer.chat_template``)."""
        from ..tokenizer.chat import apply_chat_template

        return apply_chat_template(self, messages, add_generation_prompt)

    @property
    def sha256(self) -> str:
        """The model file's sha256 (computed on first use, then remembered): saved prompt states name it."""
        if self._sha256 is None:
            from ..format.catalog import file_sha256

            self._sha256 = file_sha256(self.path)
        return self._sha256

    @property
    def n_params(self) -> int:
        """Parameters in the file's tensors (a tied head is counted once)."""
        counted = {source: ne for source, ne in self.weight_sources.values() if source is not None}
        return sum(int(np.prod(ne)) for ne in counted.values())

    def describe(self) -> str:
        n_params = self.n_params
        placement = ", ".join(sorted(set(self.layer_specs))) or "-"
        delegated = "".join(f", {', '.join(sorted(u for u, s in self.delegated.items() if s == spec))} weights on "
                            f"{spec}" for spec in sorted(set(self.delegated.values())))
        return (f"{self.path.name}: arch {self.arch_name}, {self.n_layer} layers, n_embd {self.n_embd}, "
                f"n_vocab {self.n_vocab}, {n_params / 1e6:.1f}M params, backends {placement}{delegated}")

    def close(self) -> None:
        """Drop the weights on every backend (the model cannot be used afterwards)."""
        for backend in self.backends.values():
            backend.free_weights()
        self._weights.clear()
        self.fused_weights.clear()
        self._fused_shapes.clear()
        self.closed = True

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layers = self.hparams.n_layer if self.hparams is not None else "?"
        return f"<Model {self.path.name} arch={self.arch_name} n_layer={layers}>"

    # -- used by the graph builder and the scheduler -----------------------------------------------------
    def has_weight(self, name: str) -> bool:
        return name in self._weights

    def weight_layer(self, name: str) -> int:
        return self._weights[name][1]

    def weight_shape(self, name: str) -> tuple[int, ...]:
        """The numpy shape of weight ``name`` (the tensor info's ``ne`` reversed; fused: [Σ n_out, n_in])."""
        if name in self._fused_shapes:
            return self._fused_shapes[name]
        return tuple(reversed(self.weight_sources[name][1]))

    def add_fused_weight(self, name: str, parts: tuple[str, ...]) -> None:
        """Record a weight a backend fused from ``parts`` at load: graphs refer to it by ``name``."""
        shapes = [self.weight_shape(p) for p in parts]
        self._fused_shapes[name] = (sum(s[0] for s in shapes), shapes[0][1])
        self._weights[name] = self._weights[parts[0]]
        self.fused_weights[parts] = name

    def weight_backend(self, name: str) -> Backend:
        try:
            return self._weights[name][0]
        except KeyError:
            raise ModelError(f"model has no weight {name!r}") from None

    def layer_backend(self, il: int) -> Backend:
        """Backend of layer ``il``; -1 (input side) is the host, n_layer the output head."""
        if il < 0:
            return self.host
        il = min(il, len(self.layer_specs) - 1)
        return self.backends[self.layer_specs[il]]


# ---------------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------------

def resolve_model_path(path_or_name: str | os.PathLike[str]) -> Path:
    """A path that exists, else a catalog name (fetched on first use)."""
    path = Path(path_or_name).expanduser()
    if path.exists():
        return path
    from ..format.catalog import resolve_model

    return Path(resolve_model(str(path_or_name)))


def load_model(path_or_name: str | os.PathLike[str], params: ModelParams | None = None, **kw: Any) -> Model:
    """Load a GGUF model (path or catalog name). ``kw`` are :class:`ModelParams` fields."""
    params = _model_params(params, kw)
    path = resolve_model_path(path_or_name)
    with collector_paused():
        loader = open_loader(path, mode=params.load_mode, kv_overrides=params.kv_overrides)
        model: Model | None = None
        try:
            model = _build_model(loader, path, params)
            return model
        except BaseException:
            if model is not None:
                model.close()
            raise
        finally:
            loader.close()


def _model_params(params: ModelParams | None, kw: dict[str, Any]) -> ModelParams:
    """``params`` updated with keyword fields, validated; a bad field is a ConfigError naming it."""
    from pydantic import ValidationError

    from ..errors import ConfigError

    base = dict(params) if params is not None else {}
    try:
        return ModelParams(**{**base, **kw})
    except ValidationError as exc:
        problems = validation_error_message(exc, known_keys=ModelParams.model_fields)
        raise ConfigError(f"invalid model parameters: {problems}") from None


def _build_model(loader: ModelFileLoader, path: Path, params: ModelParams) -> Model:
    if params.vocab_only:
        vocab = Vocab.from_metadata(loader.metadata)
        arch, hparams = _architecture_if_described(loader)
        return Model(path=path, params=params, metadata=loader.metadata, arch=arch, hparams=hparams, vocab=vocab)
    arch = get_architecture(loader.arch_name)
    hparams = read_hparams(arch, loader)
    vocab = Vocab.from_metadata(loader.metadata)
    specs = arch.tensors(hparams)
    declined: dict[str, str] = {}  # default backends that declined this model → why
    while True:
        model = Model(path=path, params=params, metadata=loader.metadata, arch=arch, hparams=hparams, vocab=vocab,
                      tensor_specs=specs)
        try:
            default = _place_layers(model, params, declined)
            loads = plan_weights(model, loader, specs)
            if default is not None:
                _delegate_weights(model, loads, params, declined)
            for load in loads:
                model._weights[load.name] = (load.backend, _spec_layer(hparams, load.layer))
                model.weight_sources[load.name] = (load.source_name, load.ne)
            graph = representative_graph(model)  # built once: both checks below read it
            refusal = _declining_backend(model, graph, loader, loads)
            if refusal is not None and (refusal[0] == default or refusal[0] in model.delegated.values()):
                # the next default by priority, or the default keeping the weights it delegated: a fresh model
                declined[refusal[0]] = refusal[1]
                model.close()
                continue
            if refusal is not None:
                raise ModelError(f"backend {refusal[0]!r} cannot run {path.name}: {refusal[1]}")
            check_memory(loads, loader, params.memory_available)
            with _loading(loads, path):
                loader.load_all_data(loads, params.progress)
                for parts, name in prepare_fused_weights(model, graph).items():
                    model.add_fused_weight(name, parts)
        except BaseException:
            model.close()
            raise
        log.info("%s", model.describe())
        return model


def _declining_backend(model: Model, graph: Graph | None, loader: ModelFileLoader,
                       loads: list[WeightLoad]) -> tuple[str, str] | None:
    """(spec, reason) of the first backend of ``model`` that declines the part of it placed there
    (:meth:`Backend.decline_reason`, asked with the ops of ``graph``, its representative one-token graph, and its
    weights' types), or None."""
    if graph is None:  # the architecture cannot build it now: the first decode reports why
        return None
    def runs_on(node: Node) -> Backend:  # the scheduler's rule: a node reading a weight runs where it lives
        weights = [inp for inp in node.inputs if inp.op == "weight"]
        return model.weight_backend(weights[0].attr_str("name")) if weights else model.layer_backend(node.layer)

    for spec, backend in model.backends.items():
        ops = frozenset(node.op for node in graph.nodes if node.op not in ("input", "weight")
                        and runs_on(node) is backend)
        types = {load.name: (loader.tensor_record(load.file_tensor).ggml_type if load.generated is None
                             else int(GGMLType.F32)) for load in loads if load.backend is backend}
        reason = backend.decline_reason(ops, types)
        if reason is not None:
            return spec, reason
    return None


def _delegate_weights(model: Model, loads: list[WeightLoad], params: ModelParams,
                      declined: Mapping[str, str]) -> None:
    """Move the weights the default backend would rather leave to another (:attr:`Backend.delegated_weights`:
    onnx's experts to native) to that backend, when it runs here and has not declined this model."""
    unavailable: set[str] = set()
    for load in loads:
        spec = load.backend.delegated_weights.get(load.usage)
        if spec is None or spec in declined or spec in unavailable:
            continue
        if spec not in model.backends:
            try:
                model.backends[spec] = create_backend(spec, params.backend_options)
            except BackendUnavailable as exc:
                log.info("%s weights stay on the default backend: %s", load.usage, exc)
                unavailable.add(spec)
                continue
        load.backend = model.backends[spec]
        model.delegated[load.usage] = spec


@contextmanager
def _loading(loads: list[WeightLoad], path: Path) -> Iterator[None]:
    """Each backend told when the weights of ``path`` begin and, once they and the fused weights built from them
    are all in place, end (not after a failed load)."""
    backends = list({id(load.backend): load.backend for load in loads}.values())
    for backend in backends:
        backend.begin_loading(path)
    yield
    for backend in backends:
        backend.end_loading()


def _architecture_if_described(loader: ModelFileLoader) -> tuple[Architecture | None, HParams | None]:
    """For a vocab-only load, which needs only the general and tokenizer keys (as llama.cpp reads with
    ``vocab_only``): the architecture and hyperparameters when a plugin knows the architecture and the file has
    its keys, else None. A hyperparameter that is present but invalid is still a ModelError: the file is broken."""
    from ..plugins import registry

    name = loader.metadata.get("general.architecture")
    if not isinstance(name, str) or name not in registry("architectures"):
        return None, None
    arch = get_architecture(name)
    try:
        return arch, read_hparams(arch, loader)
    except MissingMetadataKey as exc:
        log.info("vocab-only load of a %s file without its hyperparameters (%s)", name, exc)
        return arch, None
    except UnsupportedVariant as exc:
        log.info("vocab-only load of a %s file whose variant the plugin cannot run (%s)", name, exc)
        return arch, None


def read_hparams(arch: Architecture, loader: ModelFileLoader) -> HParams:
    keys = loader.keys
    values = read_common_hparams(keys)
    values.update(arch.own_hparams(keys, dict(values)))
    hparams = make_hparams(arch.hparams_class, values)
    arch.check_hparams(hparams)
    return hparams


def _spec_layer(hp: HParams, layer: int) -> int:
    return hp.n_layer if layer == OUTPUT_LAYER else layer


def _place_layers(model: Model, params: ModelParams, declined: Mapping[str, str]) -> str | None:
    """Decide the backend spec of every layer and the output head, and instantiate the backends. Returns the spec
    chosen as the default (None when one was asked for), skipping the ``declined`` ones."""
    n_layer = model.n_layer
    default = None
    if params.backend:
        main, model.backend_choice = params.backend, f"{params.backend} (asked for)"
    else:
        choice = choose_default_backend(declined=declined)
        main, model.backend_choice = choice.spec, f"{choice.spec} (the default: {choice.reason})"
        default = main
    specs = [main] * (n_layer + 1)
    if params.n_gpu_layers:
        offload = choose_default_backend(devices_only=True).spec
        specs = [offload if on_gpu else spec for spec, on_gpu in zip(specs, gpu_layers(n_layer, params.n_gpu_layers))]
    for il, spec in (params.placement or {}).items():
        if not 0 <= il <= n_layer:
            raise ModelError(f"placement names layer {il}, but the model has layers 0..{n_layer - 1} "
                             f"(and {n_layer} for the output head)")
        specs[il] = spec
    model.layer_specs = specs
    check_backend_options(params.backend_options)
    for spec in dict.fromkeys(specs):
        model.backends[spec] = create_backend(spec, params.backend_options)
    host = choose_host_backend(model.backends)
    if host not in model.backends:
        model.backends[host] = create_backend(host, params.backend_options)
    model.host_backend = model.backends[host]
    return default


def gpu_layers(n_layer: int, n_gpu_layers: int) -> list[bool]:
    """Which of layers 0..n_layer (n_layer = the output head) llama.cpp offloads for ``n_gpu_layers``: the
    last n blocks, and the head only when n_gpu_layers > n_layer (-1 = everything)."""
    n_gpu = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    first = max(n_layer - n_gpu, 0)  # llama.cpp's i_gpu_start
    active = min(n_gpu, n_layer + 1)
    return [first <= il and il - first < active for il in range(n_layer + 1)]


def plan_weights(model: Model, loader: ModelFileLoader, specs: list[TensorSpec]) -> list[WeightLoad]:
    """Check every declared tensor against the file and decide what to load where."""
    hp = model.known_hparams
    loads: list[WeightLoad] = []
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ModelError(f"architecture {hp.arch!r} declares tensor {spec.name!r} twice")
        seen.add(spec.name)
        backend = model.host if spec.layer == INPUT_LAYER else model.layer_backend(_spec_layer(hp, spec.layer))
        load = _plan_one(model, loader, spec, backend)
        if load is not None:
            load.layer = spec.layer
            loads.append(load)
    return loads


def _plan_one(model: Model, loader: ModelFileLoader, spec: TensorSpec, backend: Backend) -> WeightLoad | None:
    if loader.has_tensor(spec.name):
        _check_shape(loader, spec.name, spec)
        return WeightLoad(spec.name, spec.name, spec.ne, backend, spec.usage)
    if spec.duplicate_of and loader.has_tensor(spec.duplicate_of):
        _check_shape(loader, spec.duplicate_of, spec)
        return WeightLoad(spec.name, spec.duplicate_of, spec.ne, backend, spec.usage)
    if spec.generate is not None:
        data = np.asarray(spec.generate(model.known_hparams), dtype=np.float32)
        if data.shape != tuple(reversed(spec.ne)):
            raise ModelError(f"generated tensor {spec.name!r} has shape {data.shape}, expected {tuple(reversed(spec.ne))}")
        return WeightLoad(spec.name, None, spec.ne, backend, spec.usage, generated=data)
    if spec.optional or (spec.unless is not None and loader.has_tensor(spec.unless)):
        return None
    alternative = spec.duplicate_of or spec.unless
    extra = f" (nor {alternative!r})" if alternative else ""
    raise ModelError(f"{model.path.name}: missing tensor {spec.name!r}{extra} required by architecture "
                     f"{model.known_hparams.arch!r}")


def _check_shape(loader: ModelFileLoader, file_name: str, spec: TensorSpec) -> None:
    found = tuple(loader.tensor_record(file_name).ne)
    # ggml drops trailing 1s: [n, 1] and [n] are the same tensor
    def trim(ne: tuple[int, ...]) -> tuple[int, ...]:
        ne = tuple(int(d) for d in ne)
        while len(ne) > 1 and ne[-1] == 1:
            ne = ne[:-1]
        return ne

    if trim(found) != trim(spec.ne):
        raise ModelError(f"tensor {file_name!r} has shape {list(found)} in the file, but architecture expects "
                         f"{list(spec.ne)} (ggml ne order)")
