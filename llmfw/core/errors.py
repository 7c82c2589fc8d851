"""The one exception hierarchy of llmfw.

Every error the project raises on purpose derives from :class:`LLMFWError`, so callers (and the CLI, which
turns them into one-line messages instead of tracebacks) can catch them all at once. Messages say what was
expected and what was found.
"""
from __future__ import annotations


class LLMFWError(Exception):
    """Base class of every error llmfw raises on purpose."""


class GGUFError(LLMFWError):
    """A GGUF file is malformed, truncated, inconsistent or of an unsupported version."""


class QuantError(LLMFWError):
    """A tensor type is unknown or its data do not fit its type."""


class PluginError(LLMFWError):
    """A plugin failed to load, or registered something invalid."""


class UnknownPluginName(PluginError, KeyError):
    """A registry was asked for a name it does not hold; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownArchitecture(UnknownPluginName):
    """`general.architecture` names an architecture no plugin provides."""


class UnknownBackend(UnknownPluginName):
    """A backend name that no plugin provides."""


class BackendUnavailable(LLMFWError):
    """A known backend whose optional dependency is not installed (the message names the extra)."""


class ModelError(LLMFWError):
    """A model's hyperparameters or tensors do not match what its architecture expects."""


class InsufficientMemory(ModelError):
    """A model's weights need more memory than is available (refused before anything is allocated)."""


class UnsupportedVariant(ModelError):
    """A file of a known architecture in a variant its plugin cannot run (Gemma 4's experts, for one); a
    vocab-only load, which needs only the vocabulary, still opens it."""


class MissingMetadataKey(ModelError):
    """A metadata key the architecture needs is not in the file (a vocab-only load may do without it)."""


class LoadCancelled(LLMFWError):
    """The progress callback returned False; the partly loaded model was released."""


class VocabError(LLMFWError):
    """The vocabulary in a model file is missing keys or inconsistent."""


class TokenizerError(VocabError):
    """Text or token ids that the tokenizer cannot handle."""


class ContextError(LLMFWError):
    """Invalid context parameters or an operation the context cannot do."""


class LogitsIndexError(LLMFWError, IndexError):
    """`get_logits_ith` asked for a row that the last decode did not output."""


class SamplerError(LLMFWError, ValueError):
    """An invalid sampler name or parameter."""


class ConfigError(LLMFWError, ValueError):
    """A YAML pipeline or other configuration is invalid; the message names the offending key."""


class CatalogError(LLMFWError):
    """A model name is unknown to the catalog, or fetching/verifying it failed."""


class ChatTemplateError(LLMFWError):
    """A chat template failed to render or tried something the sandbox forbids."""


class RequestError(LLMFWError, ValueError):
    """A generation request (Python API or HTTP body) that is invalid; ``param`` names the field at fault.
    The server answers it with 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownModel(RequestError):
    """A request names a model the server does not serve; the message lists the ones it does (404)."""

    def __init__(self, message: str):
        super().__init__(message, "model")


class EngineBusy(LLMFWError):
    """The serving engine's queue is full (the server answers 503 with Retry-After)."""


class EngineStopped(LLMFWError):
    """The serving engine was shut down (or failed) before the request finished."""


class EngineLoading(EngineStopped):
    """The server's model is still loading (503 until it is ready)."""


class GrammarError(LLMFWError, ValueError):
    """A grammar, JSON schema or regex that does not parse, is too large or too deeply nested, or can never
    match. ``line`` and ``column`` (1-based, or None) point into the source text when the error has a place."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None):
        self.message, self.line, self.column = message, line, column
        where = f"line {line}, column {column}: " if line is not None and column is not None else (
            f"line {line}: " if line is not None else "")
        super().__init__(where + message)
