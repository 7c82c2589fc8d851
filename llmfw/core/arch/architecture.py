"""The Architecture plugin contract.

An architecture (registry kind ``"architectures"``, looked up by ``general.architecture``) says four things
about a model family, and nothing else:

1. **its hyperparameters** — :attr:`Architecture.hparams_class` (a subclass of
   :class:`llmfw.core.ir.hparams.HParams` when it has keys of its own) and :meth:`Architecture.own_hparams`, which
   reads those keys (the common ones are already read);
2. **its tensors** — :meth:`Architecture.tensors` lists every tensor with its ggml shape (``ne`` order, as in
   llama.cpp's ``create_tensor``), the layer that owns it and whether it is required, optional or a duplicate
   of another tensor (``output.weight`` ← ``token_embd.weight`` when the head is tied). The loader checks the
   file against this list and raises :class:`ModelError` for a missing tensor or a wrong shape;
3. **its graph** — :meth:`Architecture.build_graph` receives a :class:`llmfw.core.ir.graph.GraphBuilder` and
   emits the ops for one ubatch using the builder's shared blocks (``build_inp_embd``, ``build_norm``,
   ``build_rope``, ``build_attn``, ``build_ffn``, ``build_inp_out_ids``/``select_outputs``,
   ``build_output``); it must set ``builder.graph.outputs["logits"]``;
4. **its memory** — :attr:`Architecture.memory` names the memory module (registry kind ``"memory"``):
   ``"kv_cache"`` (one unified KV cache for every layer), an interleaved sliding-window variant
   (``"kv_cache_iswa"``), ``"recurrent"`` or ``"hybrid"`` (recurrent layers, declared by
   :meth:`recurrent_state`, beside KV-cached attention layers), plus :meth:`rope_params` per layer, used by the
   graph and by the KV cache's K-shift.

Example (a complete minimal architecture)::

    class MyArch(Architecture):
        name = "myarch"
        def tensors(self, hp):
            return [TensorSpec("token_embd.weight", (hp.n_embd, hp.n_vocab), layer=INPUT_LAYER), ...]
        def build_graph(self, b):
            x = b.build_inp_embd()
            for il in b.layers():  # each node made inside belongs to layer il (placement)
                ...
            b.build_output(x)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Mapping

import numpy as np

from ..errors import ModelError, UnknownArchitecture
from ..ir.hparams import HParams

if TYPE_CHECKING:
    from ..ir.graph import GraphBuilder
    from ..format.metadata import MetadataView

#: layer index of tensors on the input side (token embedding): placed with the host backend
INPUT_LAYER = -1
#: marker for the output side (final norm, head); the real index is ``hparams.n_layer``
OUTPUT_LAYER = -2

RopeType = Literal["norm", "neox", "none"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor an architecture expects.

    ``name``: the GGUF name (``"blk.3.attn_q.weight"``); ``ne``: ggml shape, ``ne0`` first (the contiguous
    dimension: for a matmul weight that is the input size); ``layer``: the block index, or :data:`INPUT_LAYER`
    / :data:`OUTPUT_LAYER`; ``optional``: absent from the file is fine (the graph checks
    ``builder.has_weight``; llama.cpp's ``TENSOR_NOT_REQUIRED``); ``duplicate_of``: when absent, reuse this other
    tensor's data (tied output head; llama.cpp's ``TENSOR_DUPLICATED``), and absent both, the tensor is missing
    unless ``optional``; ``unless``: absent is fine when the file has this other tensor instead (separate Q/K/V
    when a fused ``attn_qkv`` is there). The same name may be declared once only.
    """

    name: str
    ne: tuple[int, ...]
    layer: int = INPUT_LAYER
    optional: bool = False
    duplicate_of: str | None = None
    #: what the graph uses it for ("mul_mat", "get_rows", "mul", "add", "rope"): a hint for backends
    usage: str = "mul_mat"
    #: when absent from the file, compute it from the hyperparameters (float32, numpy shape = reversed ne);
    #: e.g. llama3 rope frequency factors derived from ``rope.scaling.*`` keys. Implicitly optional.
    generate: Callable[[HParams], np.ndarray] | None = None
    #: the fused alternative whose presence makes this tensor unnecessary
    unless: str | None = None


def attention_qkv_tensors(hp: HParams, il: int, n_embd: int | None = None) -> list[TensorSpec]:
    """llama.cpp's ``create_tensor_qkv``: a fused ``attn_qkv`` (optional, with an optional bias) or separate Q, K,
    V projections (required unless fused), each with an optional bias. ``n_embd`` is the input size."""
    n_in = hp.n_embd if n_embd is None else n_embd
    sizes = {"q": hp.n_embd_head_k * hp.n_head(il), "k": hp.n_embd_k_gqa(il), "v": hp.n_embd_v_gqa(il)}
    fused = f"blk.{il}.attn_qkv.weight"
    specs = [TensorSpec(fused, (n_in, sum(sizes.values())), il, optional=True),
             TensorSpec(f"blk.{il}.attn_qkv.bias", (sum(sizes.values()),), il, optional=True, usage="add")]
    specs += [TensorSpec(f"blk.{il}.attn_{part}.weight", (n_in, size), il, unless=fused)
              for part, size in sizes.items()]
    specs += [TensorSpec(f"blk.{il}.attn_{part}.bias", (size,), il, optional=True, usage="add")
              for part, size in sizes.items()]
    return specs


def layer_tensor(il: int, name: str, ne: tuple[int, ...], usage: str = "mul_mat") -> TensorSpec:
    """The required tensor ``blk.{il}.{name}`` of layer ``il``."""
    return TensorSpec(f"blk.{il}.{name}", ne, il, usage=usage)


def gated_ffn_tensors(hp: HParams, il: int) -> list[TensorSpec]:
    """A gated FFN's gate, down and up projections of layer ``il`` (SwiGLU / GeGLU without biases)."""
    n_embd, n_ff = hp.n_embd, hp.n_ff(il)
    return [layer_tensor(il, "ffn_gate.weight", (n_embd, n_ff)), layer_tensor(il, "ffn_down.weight", (n_ff, n_embd)),
            layer_tensor(il, "ffn_up.weight", (n_embd, n_ff))]


@dataclass(frozen=True)
class RopeParams:
    """The attributes of a ``rope`` node for one layer (ggml_rope_ext's parameters)."""

    n_dims: int
    mode: str  # "norm" | "neox"
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0

    def attrs(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> "RopeParams":
        """The parameters of a ``rope`` (or ``k_shift``) node; other attributes are ignored."""
        known = {k: attrs[k] for k in cls.__dataclass_fields__ if k in attrs}
        mode = str(known.get("mode", "norm")).lower()
        if mode not in ("norm", "neox"):
            raise ModelError(f"rope mode must be 'norm' or 'neox', got {mode!r}")
        known["mode"] = mode
        return cls(**known)


class Architecture(ABC):
    """A model family. Instances are stateless helpers created once per loaded model (``model.arch``)."""

    #: the ``general.architecture`` value this class serves (registry name)
    name: ClassVar[str] = ""
    #: hyperparameter model; subclass HParams to add fields and fill them in :meth:`own_hparams`
    hparams_class: ClassVar[type[HParams]] = HParams
    #: memory module name in the ``"memory"`` registry
    memory: ClassVar[str] = "kv_cache"
    #: rope mode of this family (llama: "norm", gemma / qwen2 / phi: "neox")
    rope_type: ClassVar[RopeType] = "norm"

    # -- hyperparameters -----------------------------------------------------------------------------
    def own_hparams(self, keys: "MetadataView", common: dict[str, Any]) -> dict[str, Any]:
        """Extra :attr:`hparams_class` fields (or overrides of common ones) read from the file's metadata.

        ``common`` holds the fields read already (see :func:`llmfw.core.ir.hparams.read_common_hparams`).
        The default reads nothing.
        """
        return {}

    #: the norm epsilon the family needs ("rms": attention.layer_norm_rms_epsilon, "layer": layer_norm_epsilon)
    norm_kind: ClassVar[str] = "rms"

    def check_hparams(self, hp: HParams) -> None:
        """Raise ModelError for values this architecture cannot run with (called after loading hparams).

        The default checks what every transformer family here needs: a positive norm epsilon and equal key /
        value head sizes. Override to add checks (and call ``super().check_hparams(hp)``).
        """
        if self.norm_kind == "rms" and hp.f_norm_rms_eps <= 0:
            raise ModelError(f"{self.name}: attention.layer_norm_rms_epsilon must be > 0, found {hp.f_norm_rms_eps}")
        if self.norm_kind == "layer" and hp.f_norm_eps <= 0:
            raise ModelError(f"{self.name}: attention.layer_norm_epsilon must be > 0, found {hp.f_norm_eps}")
        if hp.n_embd_head_k != hp.n_embd_head_v:
            raise ModelError(f"{self.name}: key_length {hp.n_embd_head_k} != value_length {hp.n_embd_head_v}")

    # -- tensors -----------------------------------------------------------------------------------------
    def tensors(self, hp: HParams) -> list[TensorSpec]:
        """Every tensor of the model, in load order.

        The default is the common layout: token embedding, output norm, output head (tied to the embedding
        when the file has none), then :meth:`layer_tensors` for each layer. Override for other layouts.
        """
        n_embd, n_vocab = hp.n_embd, hp.n_vocab
        specs = [
            TensorSpec("token_embd.weight", (n_embd, n_vocab), INPUT_LAYER, usage="get_rows"),
            TensorSpec("output_norm.weight", (n_embd,), OUTPUT_LAYER, usage="mul"),
            TensorSpec("output.weight", (n_embd, n_vocab), OUTPUT_LAYER, duplicate_of="token_embd.weight"),
        ]
        for il in range(hp.n_layer):
            specs += self.layer_tensors(hp, il)
        return specs

    def layer_tensors(self, hp: HParams, il: int) -> list[TensorSpec]:
        """The tensors of layer ``il`` (used by the default :meth:`tensors`)."""
        raise NotImplementedError(f"{type(self).__name__} must define layer_tensors() or tensors()")

    # -- graph -------------------------------------------------------------------------------------------
    @abstractmethod
    def build_graph(self, b: "GraphBuilder") -> None:
        """Emit the graph for one ubatch into ``b.graph`` and set ``b.graph.outputs["logits"]``."""

    def recurrent_state(self, hp: HParams, il: int) -> dict[str, tuple[int, ...]] | None:
        """The recurrent state layer ``il`` carries from one ubatch to the next, per sequence: kind → shape
        (LFM2's short convolution: ``{"conv": (K - 1, n_embd)}``), or None for a layer without one (attention).
        A family with recurrent layers names the memory ``"hybrid"`` (KV cache for the others) or
        ``"recurrent"`` (every layer recurrent); the graph reads and writes the state with
        ``GraphBuilder.build_rs`` / ``store_rs``."""
        return None

    def has_kv(self, hp: HParams, il: int) -> bool:
        """Whether a layer without a recurrent state keeps a KV cache (the hybrid memory's attention layers);
        False for a layer that keeps nothing between ubatches (Nemotron-H's MLP-only layers)."""
        return True

    def ubatch_inputs(self, hp: HParams, pos: np.ndarray) -> dict[str, np.ndarray]:
        """Graph inputs of this family's own computed per ubatch from the token positions ``pos`` (int32 [T]),
        e.g. Mistral-3's attention temperature ``attn_temp`` [T, 1, 1]. The default adds none."""
        return {}

    def rope_params(self, hp: HParams, il: int) -> RopeParams:
        """RoPE attributes for layer ``il`` (override for per-layer bases, e.g. sliding-window layers)."""
        return default_rope_params(hp, self.rope_type, swa=hp.is_swa(il))

    def has_rope(self, hp: HParams, il: int) -> bool:
        """Whether layer ``il`` rotates its queries and keys (llama.cpp's ``hparams.has_rope``): False for the
        NoPE layers of SmolLM3, Granite with rope switched off... The K-shift skips such layers."""
        return True

    def rope_freq_factors(self, hp: HParams, il: int) -> str | None:
        """Name of the weight holding layer ``il``'s per-dimension-pair frequency divisors
        (``"rope_freqs.weight"``), or None. A factor tensor computed from metadata (llama3 scaling) is declared
        as a :class:`TensorSpec` with ``generate``."""
        return None

    def rope_factors_for(self, b: "GraphBuilder", il: int) -> str | None:
        """The frequency-factor weight of layer ``il`` in the graph ``b`` builds (rope and K-shift alike).
        Defaults to :meth:`rope_freq_factors`; override when the choice depends on the context: Phi-3's LongRoPE
        picks long or short factors by ``b.params.n_ctx_seq``, like llama.cpp's ``get_rope_factors``."""
        return self.rope_freq_factors(b.hp, il)


def default_rope_params(hp: HParams, mode: RopeType, *, swa: bool = False) -> RopeParams:
    """llama.cpp's rope parameters from the hyperparameters (cparams left at their defaults)."""
    return RopeParams(
        n_dims=hp.n_rot,
        mode="neox" if mode == "neox" else "norm",
        freq_base=hp.rope_freq_base_train_swa if swa else hp.rope_freq_base_train,
        freq_scale=hp.rope_freq_scale_train_swa if swa else hp.rope_freq_scale_train,
        ext_factor=hp.yarn_ext_factor_effective,
        # llama.cpp's cparams: YaRN's own magnitude factor cancels out in the context set-up (ggml applies it),
        # and rope.scaling.attn_factor multiplies the result (Phi-3's LongRoPE writes it, YaRN files may)
        attn_factor=hp.yarn_attn_factor * hp.rope_attn_factor,
        beta_fast=hp.yarn_beta_fast,
        beta_slow=hp.yarn_beta_slow,
        n_ctx_orig=hp.n_ctx_orig_yarn or hp.n_ctx_train,
    )


#: where an author of a new family starts (the message of an unknown architecture points there)
PLUGIN_DOCS = "docs/plugins.md#an-architecture-plugin"


def get_architecture(name: str) -> Architecture:
    """An instance of the architecture registered as ``name``; UnknownArchitecture lists the known ones and says
    how to add one."""
    from ..plugins import registry

    try:
        return registry("architectures").get_class(name, Architecture)()
    except UnknownArchitecture as exc:
        raise UnknownArchitecture(f"{exc}. An architecture plugin adds a family (one file and one entry point): "
                                  f"see {PLUGIN_DOCS}") from None
