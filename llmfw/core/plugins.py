"""Plugin system: pluggy hook specifications, lazy registries and the plugin manager.

Every extensible kind of thing (architectures, backends, tokenizers, samplers, loaders, memory modules) has a
:class:`Registry` of *lazy* references: a plugin registers ``"module:Class"`` strings, so listing plugins does
not import torch or onnxruntime; the class is imported the first time it is asked for.

Plugins are found in two places:

* built-ins: the packages ``llmfw.plugins.BUILTIN_PLUGINS`` lists (one per kind), registered directly so they
  exist even in an uninstalled checkout;
* installed distributions exposing an entry point in the group ``llmfw``; each entry point names a module (or
  object) holding ``@hookimpl`` functions.

A plugin that fails to import or to register is reported (``PluginManager.failures``, a warning) and skipped;
``LLMFW_STRICT_PLUGINS=1`` re-raises instead. ``LLMFW_LOAD_PLUGINS`` is an allow-list of entry-point names
(set but empty: no external plugins), ``LLMFW_DISABLE_PLUGINS`` a block-list.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import pluggy

from .errors import PluginError, UnknownArchitecture, UnknownBackend, UnknownPluginName

PROJECT = "llmfw"
ENTRY_POINT_GROUP = "llmfw"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: A registrar handed to the ``register_*`` hooks: ``register(name, "module:Class" | obj, override=False)``.
Registrar = Callable[..., None]


class HookSpecs:
    """The hooks a plugin may implement. Each receives a registrar (or the click group)."""

    @hookspec
    def register_architectures(self, register: Registrar) -> None:
        """Register :class:`llmfw.core.arch.architecture.Architecture` subclasses by `general.architecture` name."""

    @hookspec
    def register_backends(self, register: Registrar) -> None:
        """Register :class:`llmfw.core.exec.backend.Backend` subclasses by backend name ("numpy", "torch", ...)."""

    @hookspec
    def register_tokenizers(self, register: Registrar) -> None:
        """Register :class:`llmfw.core.tokenizer.vocab.Tokenizer` subclasses by `tokenizer.ggml.model` value."""

    @hookspec
    def register_samplers(self, register: Registrar) -> None:
        """Register :class:`llmfw.core.generation.sampling.Sampler` subclasses by sampler name ("top_k", ...)."""

    @hookspec
    def register_loaders(self, register: Registrar) -> None:
        """Register :class:`llmfw.core.runtime.loader.ModelFileLoader` subclasses by format name ("gguf")."""

    @hookspec
    def register_memory(self, register: Registrar) -> None:
        """Register :class:`llmfw.core.runtime.memory.Memory` subclasses by name ("kv_cache", "kv_cache_iswa")."""

    @hookspec
    def register_commands(self, cli: Any) -> None:
        """Add click commands to the ``llmfw`` command group."""


#: hook name -> registry kind
REGISTRY_HOOKS = {
    "register_architectures": "architectures",
    "register_backends": "backends",
    "register_tokenizers": "tokenizers",
    "register_samplers": "samplers",
    "register_loaders": "loaders",
    "register_memory": "memory",
}
KINDS = tuple(REGISTRY_HOOKS.values())

#: the package of the built-in plugins: its ``BUILTIN_PLUGINS`` lists their modules. The core names this package
#: only, never a plugin module, so it depends on the built-ins no more than on an installed plugin.
BUILTIN_PACKAGE = "llmfw.plugins"
BUILTIN_SOURCE = "llmfw (built-in)"

_UNKNOWN_ERRORS: dict[str, type[UnknownPluginName]] = {
    "architectures": UnknownArchitecture,
    "backends": UnknownBackend,
}


@dataclass
class Entry:
    """One registered name: a lazy reference (``"module:attr"``) or an object, and where it came from."""

    name: str
    ref: Any
    source: str

    @property
    def ref_text(self) -> str:
        if isinstance(self.ref, str):
            return self.ref
        return f"{getattr(self.ref, '__module__', '?')}:{getattr(self.ref, '__qualname__', repr(self.ref))}"


def resolve_ref(ref: Any) -> Any:
    """Import ``"package.module:Attr.sub"`` and return the attribute; objects pass through."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise PluginError(f"plugin reference {ref!r} is not of the form 'module:Attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the plugin's problem, reported by name
        raise PluginError(f"cannot import {module_name!r} for {ref!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"{module_name!r} has no attribute {attr_path!r} (reference {ref!r})") from exc
    return obj


PluginT = TypeVar("PluginT")


class Registry:
    """Name → lazy reference for one kind of plugin."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._resolved: dict[str, Any] = {}

    def register(self, name: str, ref: Any, *, override: bool = False, source: str = BUILTIN_SOURCE) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"{source}: a {self.kind} name must be a non-empty string, got {name!r}")
        if isinstance(ref, str) and ":" not in ref:
            raise PluginError(f"{source}: reference {ref!r} for {self.kind} {name!r} is not 'module:Attribute'")
        if name in self._entries and not override:
            old = self._entries[name]
            raise PluginError(
                f"{source}: {self.kind} {name!r} is already registered by {old.source} ({old.ref_text}); "
                "pass override=True to replace it"
            )
        self._entries[name] = Entry(name, ref, source)
        self._resolved.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            err = _UNKNOWN_ERRORS.get(self.kind, UnknownPluginName)
            known = ", ".join(self.names()) or "(none)"
            raise err(f"unknown {self.kind[:-1] if self.kind.endswith('s') else self.kind} {name!r}; "
                      f"known: {known}") from None

    def get(self, name: str) -> Any:
        """The registered object, importing it on first use."""
        if name not in self._resolved:
            entry = self.entry(name)
            self._resolved[name] = resolve_ref(entry.ref)
        return self._resolved[name]

    def get_class(self, name: str, base: type[PluginT]) -> type[PluginT]:
        """The registered class ``name``, checked to be a subclass of ``base`` (a PluginError otherwise)."""
        obj = self.get(name)
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise PluginError(f"{self.kind} {name!r} is registered as {obj!r}, which is not a "
                              f"{base.__module__}.{base.__qualname__} subclass")
        return obj


@dataclass
class PluginFailure:
    name: str
    reason: str


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {item.strip() for item in raw.split(",") if item.strip()}


def _strict_default() -> bool:
    return os.environ.get("LLMFW_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


class PluginManager:
    """Finds plugins, validates their hooks and fills one :class:`Registry` per kind."""

    def __init__(self, *, load_external: bool = True, strict: bool | None = None):
        self.strict = _strict_default() if strict is None else strict
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(HookSpecs)
        self.registries: dict[str, Registry] = {kind: Registry(kind) for kind in KINDS}
        self.failures: list[PluginFailure] = []
        self.sources: dict[str, str] = {}  # pluggy plugin name -> distribution text
        for module_name in importlib.import_module(BUILTIN_PACKAGE).BUILTIN_PLUGINS:
            self._add_plugin(module_name, functools.partial(importlib.import_module, module_name), BUILTIN_SOURCE)
        if load_external:
            self._load_entry_points()
        for hook_name, kind in REGISTRY_HOOKS.items():
            self._call_registry_hook(hook_name, self.registries[kind])

    # -- discovery -------------------------------------------------------------------------------------
    def _load_entry_points(self) -> None:
        allow = _env_list("LLMFW_LOAD_PLUGINS")
        block = _env_list("LLMFW_DISABLE_PLUGINS") or set()
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            if (allow is not None and ep.name not in allow) or ep.name in block:
                continue
            dist = getattr(ep, "dist", None)
            source = f"{dist.metadata['Name']} {dist.version}" if dist is not None else ep.value
            self._add_plugin(ep.name, ep.load, source)

    def _add_plugin(self, name: str, load: Callable[[], Any], source: str) -> None:
        try:
            plugin = load()
            self._check_hook_names(name, plugin)
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the engine down
            if self.pm.get_plugin(name) is not None:
                self.pm.unregister(name=name)
            self._fail(name, exc)
            return
        self.sources[name] = source

    def _check_hook_names(self, name: str, plugin: Any) -> None:
        """Catch misspelled hooks: any `register_*` function or @hookimpl that is not a known hook."""
        known = set(REGISTRY_HOOKS) | {"register_commands"}
        for attr in dir(plugin):
            obj = getattr(plugin, attr, None)
            marked = callable(obj) and hasattr(obj, f"{PROJECT}_impl")
            if (marked or (attr.startswith("register_") and callable(obj))) and attr not in known:
                raise PluginError(
                    f"plugin {name!r} defines {attr!r}, which is not an llmfw hook; known hooks: "
                    + ", ".join(sorted(known))
                )

    def _fail(self, name: str, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if self.strict:
            if isinstance(exc, PluginError):
                raise exc
            raise PluginError(f"plugin {name!r} failed: {reason}") from exc
        self.failures.append(PluginFailure(name, reason))
        warnings.warn(f"llmfw: plugin {name!r} skipped: {reason}", RuntimeWarning, stacklevel=3)

    def _call_registry_hook(self, hook_name: str, registry: Registry) -> None:
        hook = getattr(self.pm.hook, hook_name)
        # Call each implementation separately so every registration carries its plugin's source and one
        # plugin's error does not stop the others.
        for impl in hook.get_hookimpls():  # registration order: built-ins first, then entry points
            source = self.sources.get(impl.plugin_name, impl.plugin_name)

            def register(name: str, ref: Any, override: bool = False, *, _src: str = source) -> None:
                registry.register(name, ref, override=override, source=_src)

            try:
                impl.function(register=register)
            except Exception as exc:  # noqa: BLE001
                self._fail(impl.plugin_name, exc)

    # -- use ---------------------------------------------------------------------------------------------
    def register_commands(self, cli: Any) -> None:
        for impl in self.pm.hook.register_commands.get_hookimpls():
            try:
                impl.function(cli=cli)
            except Exception as exc:  # noqa: BLE001
                self._fail(impl.plugin_name, exc)

    def registry(self, kind: str) -> Registry:
        try:
            return self.registries[kind]
        except KeyError:
            raise UnknownPluginName(f"unknown plugin kind {kind!r}; known: {', '.join(KINDS)}") from None

    def get(self, kind: str, name: str) -> Any:
        return self.registry(kind).get(name)

    def listing(self) -> dict[str, list[dict[str, str]]]:
        """Everything registered, for `llmfw plugins`: kind -> [{name, ref, source}]."""
        return {
            kind: [{"name": e.name, "ref": e.ref_text, "source": e.source} for e in reg.entries()]
            for kind, reg in self.registries.items()
        }


_manager: PluginManager | None = None
_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget the cached manager (tests that change the environment or install plugins use this)."""
    global _manager
    with _lock:
        _manager = None


def registry(kind: str) -> Registry:
    """Shortcut: ``registry("architectures").get("llama")``."""
    return get_plugin_manager().registry(kind)
