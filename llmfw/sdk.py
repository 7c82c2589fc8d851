"""Everything a plugin author needs, from one module: ``from llmfw.sdk import Architecture, GraphBuilder, hookimpl``.

The names live in the core's layers (``llmfw.core.arch``, ``llmfw.core.exec``, ...); this module only re-exports
them, so a plugin does not have to know the core's tree, and the tree may change without breaking plugins. A
plugin registers its classes through the hooks (``@hookimpl def register_architectures(register): ...``).

Importing it imports the core's contracts (numpy, pydantic), never a backend's runtime (torch, onnxruntime).
"""
from __future__ import annotations

from .core.arch.architecture import (INPUT_LAYER, OUTPUT_LAYER, Architecture, RopeParams, RopeType, TensorSpec,
                                     attention_qkv_tensors, default_rope_params, gated_ffn_tensors, layer_tensor)
from .core.errors import (LLMFWError, GGUFError, QuantError, PluginError, UnknownPluginName, UnknownArchitecture,
                          UnknownBackend, BackendUnavailable, ModelError, MissingMetadataKey, UnsupportedVariant,
                          LoadCancelled, VocabError, TokenizerError, ContextError, LogitsIndexError, SamplerError, ConfigError,
                          CatalogError, ChatTemplateError, RequestError, EngineBusy, EngineStopped, EngineLoading,
                          GrammarError)
from .core.exec.backend import (Backend, BackendOptions, CompiledSplit, KVLayerShape, Split, WeightSource,
                                release_freed_memory)
from .core.format.metadata import MetadataView
from .core.format.quants import GGMLType, dequantize, dequantize_rows
from .core.generation.sampling import (Candidates, MT19937Rng, RingHistory, Sampler, SamplerChain, SamplerEnv,
                                       SamplerParams, apply_temperature, ids_lookup, keep_top_k, resolve_seed,
                                       vocab_lookup)
from .core.ir.graph import DYNAMIC, OPS, BuildParams, Graph, GraphBuilder, Node, Shape
from .core.ir.hparams import HParams
from .core.ir.passes import ANY, Pattern, RewriteRule
from .core.ir.rope import rope_angle_slopes, rope_cos_sin, yarn_corr_dims
from .core.plugins import hookimpl, registry
from .core.runtime.memory import Memory, MemoryBatch, MemoryParams, pad_to
from .core.tokenizer.tokens import TokenAttr, TokenizerDefaults, TokenType
from .core.tokenizer.vocab import Tokenizer, Vocab

__all__ = [
    # plugin hooks
    "hookimpl", "registry",
    # architectures: hyperparameters, tensors, the graph
    "Architecture", "TensorSpec", "attention_qkv_tensors", "gated_ffn_tensors", "layer_tensor", "INPUT_LAYER",
    "OUTPUT_LAYER", "RopeParams", "RopeType", "default_rope_params", "HParams", "MetadataView", "GraphBuilder", "Graph",
    "Node", "BuildParams", "Shape",
    "DYNAMIC", "OPS", "rope_cos_sin", "rope_angle_slopes", "yarn_corr_dims",
    # backends
    "Backend", "BackendOptions", "CompiledSplit", "KVLayerShape", "Split", "WeightSource", "release_freed_memory",
    "GGMLType", "dequantize", "dequantize_rows", "ANY", "Pattern", "RewriteRule",
    # memory modules
    "Memory", "MemoryBatch", "MemoryParams", "pad_to",
    # tokenizers
    "Tokenizer", "TokenizerDefaults", "TokenAttr", "TokenType", "Vocab",
    # samplers
    "Sampler", "SamplerChain", "SamplerEnv", "SamplerParams", "Candidates", "MT19937Rng", "RingHistory",
    "apply_temperature", "ids_lookup", "keep_top_k", "resolve_seed", "vocab_lookup",
    # the exception hierarchy
    "LLMFWError", "GGUFError", "QuantError", "PluginError", "UnknownPluginName", "UnknownArchitecture",
    "UnknownBackend", "BackendUnavailable", "ModelError", "MissingMetadataKey", "UnsupportedVariant", "LoadCancelled", "VocabError",
    "TokenizerError", "ContextError", "LogitsIndexError", "SamplerError", "ConfigError", "CatalogError",
    "ChatTemplateError", "RequestError", "EngineBusy", "EngineStopped", "EngineLoading", "GrammarError",
]
