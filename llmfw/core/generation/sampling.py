"""Sampling: the :class:`Sampler` interface, the :class:`SamplerChain` and its :class:`SamplerParams`.

The design follows llama.cpp (``src/llama-sampling.cpp`` and ``common/sampling.cpp``):

* a sampler works on a *candidates* structure (:class:`Candidates`, llama.cpp's ``llama_token_data_array``):
  parallel numpy arrays of token ids, logits and — once some sampler computed them — probabilities, plus a
  ``sorted`` flag (descending logits) and the ``selected`` index that a *selecting* sampler (greedy, dist,
  mirostat) sets;
* a :class:`SamplerChain` applies its samplers in order, reads the selected token and ``accept``\\ s it into
  every sampler (penalties and DRY keep a history, mirostat adapts ``mu``);
* :meth:`SamplerChain.from_params` builds llama.cpp's default chain from :class:`SamplerParams` (the defaults of
  ``common_params_sampling``): logit bias → penalties → dry → top-n-sigma → top-k → typical → top-p → min-p →
  xtc → temperature → dist; greedy instead of dist when ``temp <= 0``; mirostat 1/2 replace everything after
  the logit bias by temperature + mirostat, exactly as ``common_sampler_init`` does.

Samplers are plugins: the chain looks every name up in ``registry("samplers")``, so a sampler that a
third-party package registers is usable by name in ``SamplerParams.samplers``, YAML pipelines and
``llmfw run --sampler-seq``.

Random numbers: llama.cpp draws from ``std::mt19937`` seeded with the sampler's seed. :class:`MT19937Rng`
reproduces that generator bit for bit (numpy's MT19937 with the standard ``init_genrand`` state) and the
libstdc++ ``uniform_real_distribution`` / ``discrete_distribution`` draws, so the same seed gives the same
choices as llama.cpp for the same logits.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Sequence

import numpy as np
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from ..validation import validation_error_message as validation_error_message
from .rng import DEFAULT_SEED as DEFAULT_SEED, MT19937Rng as MT19937Rng, resolve_seed as resolve_seed
from .candidates import (Candidates as Candidates, RingHistory as RingHistory, apply_temperature as apply_temperature,
                         ids_lookup as ids_lookup, keep_top_k as keep_top_k, vocab_lookup as vocab_lookup,
                         vocabulary_logits as vocabulary_logits)
from ..validation import validation_problems as validation_problems
from ..errors import GrammarError, SamplerError

if TYPE_CHECKING:
    from ..runtime.context import Context
    from ..runtime.model import Model
    from ..tokenizer.vocab import Vocab

#: llama.cpp's default order of the configurable samplers (common_params_sampling::samplers).
DEFAULT_SAMPLER_ORDER: tuple[str, ...] = (
    "penalties", "dry", "top_n_sigma", "top_k", "typical", "top_p", "min_p", "xtc", "temperature",
)

#: names accepted in ``samplers`` lists besides the registered ones (llama.cpp's spellings)
#: the samplers a chain adds around ``samplers`` by itself (a constraint, a bias, the selecting sampler, mirostat's
#: pair): ``options`` may configure them too
CHAIN_ADDED_SAMPLERS = frozenset({"grammar", "logit_bias", "dist", "greedy", "temperature", "mirostat", "mirostat_v2"})
SAMPLER_ALIASES: dict[str, str] = {
    "typ_p": "typical", "typical_p": "typical", "typ": "typical",
    "temp": "temperature", "nsigma": "top_n_sigma",
    "repetition": "penalties", "penalty": "penalties", "mirostat_v1": "mirostat", "mirostat2": "mirostat_v2",
}

#: llama.cpp's one-letter sampler codes (``--sampler-seq edskypmxt``)
SAMPLER_CHARS: dict[str, str] = {
    "e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typical", "p": "top_p",
    "m": "min_p", "x": "xtc", "t": "temperature",
}


# ---------------------------------------------------------------------------------------------------------
# the interface
# ---------------------------------------------------------------------------------------------------------
@dataclass
class SamplerEnv:
    """What a sampler may need from the model when a chain builds it from parameters."""

    vocab: Vocab | None = None
    n_vocab: int | None = None
    n_ctx_train: int | None = None
    n_ctx: int | None = None

    @classmethod
    def from_model(cls, model: Model | None = None, vocab: Vocab | None = None,
                   n_ctx: int | None = None) -> "SamplerEnv":
        if model is None:
            return cls(vocab=vocab, n_vocab=vocab.n_vocab if vocab is not None else None, n_ctx=n_ctx)
        n_ctx_train = model.hparams.n_ctx_train if model.hparams is not None else None
        return cls(vocab=vocab if vocab is not None else model.vocab, n_vocab=model.n_vocab,
                   n_ctx_train=n_ctx_train, n_ctx=n_ctx)


class Sampler(ABC):
    """One step of a sampler chain.

    Contract:

    * :meth:`apply` receives a :class:`Candidates` (token ids + logits, + probs when computed, as numpy
      arrays — llama.cpp's ``llama_token_data_array``) and modifies it: changes logits, drops candidates,
      computes probabilities, reorders, and — for *selecting* samplers (greedy, dist, mirostat) — sets
      ``cur.selected``. It must keep the arrays parallel and set ``cur.sorted = False`` when it changes the
      logits' order.
    * :meth:`accept` is told every token the chain finally chose (and, in :func:`llmfw.generate`, the prompt
      tokens), so history-based samplers (penalties, DRY) can update their state.
    * :meth:`reset` forgets that state and re-seeds random generators (a fresh generation).
    * :meth:`from_params` builds the sampler from :class:`SamplerParams` (plus ``options``, the
      ``SamplerParams.options[name]`` mapping) when a chain is configured by name. The default passes the
      options as keyword arguments to the constructor, which suits plugin samplers.
    """

    #: the registry name (set by subclasses)
    name: ClassVar[str] = "sampler"
    #: :meth:`apply_logits` does to the whole vocabulary's logits in id order what :meth:`apply` does to such
    #: candidates: it changes logits only, dropping and reordering nothing
    logits_only: ClassVar[bool] = False
    #: :meth:`select_logits` picks the token that :meth:`apply` selects from the whole vocabulary in id order
    selects_from_logits: ClassVar[bool] = False
    #: a sampler that draws random numbers keeps its generator here (saved states carry its state)
    rng: MT19937Rng | None = None

    @abstractmethod
    def apply(self, cur: Candidates) -> None:
        """Transform the candidates (see the class docstring)."""

    def apply_logits(self, logits: np.ndarray) -> None:
        """A ``logits_only`` sampler's fast path: change ``logits`` (float32, every token in id order, the
        chain's own copy) in place exactly as :meth:`apply` would change the candidates' logits."""
        raise NotImplementedError(f"sampler {self.name!r} works on candidates only")

    def select_logits(self, logits: np.ndarray) -> int:
        """A ``selects_from_logits`` sampler's fast path: the token :meth:`apply` would select."""
        raise NotImplementedError(f"sampler {self.name!r} works on candidates only")

    def accept(self, token: int) -> None:  # optional hook
        """Record a chosen token (default: no state)."""

    def reset(self) -> None:  # optional hook
        """Forget the history and re-seed (default: no state)."""

    def accept_prompt(self, token: int) -> None:
        """Record a prompt token (default: like :meth:`accept`; the grammar sampler starts afresh instead)."""
        self.accept(token)

    def done(self) -> bool:
        """True when nothing more may be generated (the grammar sampler: its grammar is complete)."""
        return False

    @classmethod
    def from_params(cls, params: "SamplerParams", env: SamplerEnv, options: dict[str, Any]) -> "Sampler":
        try:
            return cls(**options)
        except TypeError as exc:
            raise SamplerError(f"sampler {cls.name!r}: bad options {options!r}: {exc}") from None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


# ---------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------
def normalize_sampler_name(name: str) -> str:
    """``"Top-K"`` -> ``"top_k"``, llama.cpp's aliases -> registry names."""
    key = name.strip().lower().replace("-", "_")
    return SAMPLER_ALIASES.get(key, key)


def known_sampler_names() -> list[str]:
    from ..plugins import registry

    return registry("samplers").names()


class SamplerParamsError(SamplerError):
    """Invalid :class:`SamplerParams`; ``problems`` keeps (key path, message) pairs so an enclosing
    configuration (a YAML pipeline) can report them under its own key path."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("invalid sampling parameters: " + "; ".join(f"{k}: {m}" for k, m in problems))


class SamplerParams(BaseModel):
    """Sampling parameters with llama.cpp's defaults (``common_params_sampling``).

    Where llama.cpp gives a value a meaning it is accepted with that meaning: ``temp <= 0`` samples greedily,
    ``top_k = 0`` disables top-k, ``top_p = 1`` / ``min_p = 0`` / ``typical_p = 1`` / ``top_n_sigma <= 0`` /
    ``xtc_probability = 0`` / ``dry_multiplier = 0`` disable those samplers, ``penalty_last_n = -1`` and
    ``dry_penalty_last_n = -1`` mean the context size, ``seed = 0xFFFFFFFF`` (or -1) means a random seed.
    Values without a meaning are errors naming the parameter: NaN or infinite numbers, a negative top-k,
    probabilities outside [0, 1], a repeat penalty <= 0, mirostat other than 0/1/2, unknown sampler names.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    seed: int = Field(DEFAULT_SEED, ge=-1, le=0xFFFFFFFF, description="RNG seed; 0xFFFFFFFF or -1 = random")
    temp: float = Field(0.8, description="temperature; <= 0 = greedy")
    top_k: int = Field(40, description="keep the k best tokens; 0 = disabled")
    top_p: float = Field(0.95, ge=0.0, le=1.0, description="nucleus sampling; 1 = disabled")
    min_p: float = Field(0.05, ge=0.0, le=1.0, description="drop tokens with p < min_p * p_max; 0 = disabled")
    typical_p: float = Field(1.0, ge=0.0, le=1.0, description="locally typical sampling; 1 = disabled")
    top_n_sigma: float = Field(-1.0, description="keep logits within n sigma of the max; <= 0 = disabled")
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0, description="chance to exclude top choices")
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0, description="XTC threshold; > 0.5 disables XTC")
    min_keep: int = Field(0, ge=0, description="samplers keep at least this many tokens")
    penalty_last_n: int = Field(64, ge=-1, description="tokens the penalties look at; 0 = off, -1 = n_ctx")
    penalty_repeat: float = Field(1.0, gt=0.0, description="repeat penalty; 1 = disabled")
    penalty_freq: float = Field(0.0, description="frequency penalty; 0 = disabled")
    penalty_present: float = Field(0.0, description="presence penalty; 0 = disabled")
    dry_multiplier: float = Field(0.0, ge=0.0, description="DRY multiplier; 0 = disabled")
    dry_base: float = Field(1.75, gt=0.0, description="DRY base; < 1 disables DRY")
    dry_allowed_length: int = Field(2, ge=0, description="repeats up to this length are not penalized")
    dry_penalty_last_n: int = Field(-1, ge=-1, description="tokens DRY scans; 0 = off, -1 = context size")
    dry_sequence_breakers: list[str] = Field(default_factory=lambda: ["\n", ":", "\"", "*"])
    dynatemp_range: float = Field(0.0, ge=0.0, description="dynamic temperature range; 0 = disabled")
    dynatemp_exponent: float = Field(1.0, description="dynamic temperature exponent")
    mirostat: int = Field(0, description="0 = off, 1 = mirostat, 2 = mirostat 2.0")
    mirostat_tau: float = Field(5.0, ge=0.0, description="mirostat target entropy")
    mirostat_eta: float = Field(0.1, ge=0.0, description="mirostat learning rate")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> added logit")
    samplers: list[str] = Field(default_factory=lambda: list(DEFAULT_SAMPLER_ORDER),
                                description="order of the configurable samplers")
    options: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                               description="extra keyword options per sampler name (plugins)")
    grammar: str | None = Field(None, description="GBNF (llama.cpp syntax) or Lark grammar the output must match")
    json_schema: str | dict[str, Any] | bool | None = Field(
        None, description="JSON schema the output must match ({} or true = any JSON value)")
    regex: str | None = Field(None, description="regular expression the output must match")
    _compiled: tuple[Any, str] | None = PrivateAttr(None)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            grammar_errors = [e["ctx"]["error"] for e in exc.errors()
                              if isinstance((e.get("ctx") or {}).get("error"), GrammarError)]
            if grammar_errors:  # keep its class, line and column (a server answers 400 with it)
                raise grammar_errors[0] from None
            raise SamplerParamsError(validation_problems(exc)) from None

    @field_validator("options")
    @classmethod
    def _options_name_chain_samplers(cls, options: dict[str, dict[str, Any]],
                                     info: ValidationInfo) -> dict[str, dict[str, Any]]:
        """Options for a sampler the chain does not hold would never be used: most likely a sampler left out of
        ``samplers`` or a misspelt name, so say so instead of ignoring them."""
        if "samplers" not in info.data:  # the order itself was invalid: that error is reported
            return options
        chain = [normalize_sampler_name(name) for name in info.data["samplers"]]
        stray = [name for name in options if normalize_sampler_name(name) not in {*chain, *CHAIN_ADDED_SAMPLERS}]
        if stray:
            raise ValueError(f"options for {', '.join(map(repr, stray))}, which the sampler chain does not hold "
                             f"(samplers: {', '.join(chain) or 'none'}); add it to samplers or drop its options")
        return options

    @model_validator(mode="after")
    def _check_grammar(self) -> "SamplerParams":
        self.compiled_grammar()  # a bad grammar is an error now, not when a chain is built
        return self

    def grammar_spec(self) -> Any:
        """The :class:`~.grammar.GrammarSpec` of ``grammar`` / ``json_schema`` / ``regex`` (or None)."""
        if self.grammar is None and self.json_schema is None and self.regex is None:
            return None
        from .grammar import grammar_spec

        return grammar_spec(self.grammar, self.json_schema, self.regex)

    def compiled_grammar(self) -> str | None:
        """The constraint compiled by llguidance (kept with the source it was compiled from, so a copy with
        another grammar compiles its own)."""
        spec = self.grammar_spec()
        if spec is None:
            return None
        if self._compiled is None or self._compiled[0] != spec:
            self._compiled = (spec, spec.compile())
        return self._compiled[1]

    @field_validator("temp", "top_n_sigma", "penalty_freq", "penalty_present", "dynatemp_exponent",
                     "top_p", "min_p", "typical_p", "xtc_probability", "xtc_threshold", "penalty_repeat",
                     "dry_multiplier", "dry_base", "dynatemp_range", "mirostat_tau", "mirostat_eta")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0 (0 disables top-k)")
        return value

    @field_validator("mirostat")
    @classmethod
    def _mirostat_version(cls, value: int) -> int:
        if value not in (0, 1, 2):
            raise ValueError("must be 0 (off), 1 (mirostat) or 2 (mirostat 2.0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if math.isnan(bias) or bias == math.inf:
                raise ValueError(f"bias {bias} for token {token} must be a number (or -inf to ban it)")
        return value

    @field_validator("samplers")
    @classmethod
    def _sampler_names(cls, value: list[str]) -> list[str]:
        names = [normalize_sampler_name(n) for n in value]
        known = known_sampler_names()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown sampler {unknown[0]!r}; known: {', '.join(known)}")
        return names

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


def parse_sampler_seq(text: str) -> list[str]:
    """``--sampler-seq``: llama.cpp's letters (``edskypmxt``) or names separated by ``,`` or ``;``."""
    text = text.strip()
    if not text:
        raise SamplerError("--sampler-seq is empty; give letters like 'kpt' or names like 'top_k,top_p,temp'")
    if any(sep in text for sep in ",; "):
        return [normalize_sampler_name(n) for n in text.replace(";", ",").replace(" ", ",").split(",") if n]
    single = normalize_sampler_name(text)
    if single in known_sampler_names():
        return [single]
    unknown = [c for c in text if c not in SAMPLER_CHARS]
    if unknown:
        letters = ", ".join(f"{c}={n}" for c, n in SAMPLER_CHARS.items())
        raise SamplerError(f"--sampler-seq {text!r}: unknown letter {unknown[0]!r}; letters: {letters} "
                           "(or give names separated by commas)")
    return [SAMPLER_CHARS[c] for c in text]


# ---------------------------------------------------------------------------------------------------------
# the chain
# ---------------------------------------------------------------------------------------------------------
def sampler_class(name: str) -> type[Sampler]:
    """The registered Sampler class for a name (built-in or plugin); errors list the known names."""
    from ..errors import UnknownPluginName
    from ..plugins import registry

    key = normalize_sampler_name(name)
    try:
        cls = registry("samplers").get(key)
    except UnknownPluginName as exc:
        raise SamplerError(str(exc)) from None
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise SamplerError(f"sampler {key!r} is registered as {cls!r}, which is not a Sampler subclass")
    return cls


def build_sampler(name: str, params: SamplerParams | None = None, env: SamplerEnv | None = None,
                  **options: Any) -> Sampler:
    """One sampler by name, configured from ``params`` (+ ``params.options[name]`` + ``options``)."""
    params = params or SamplerParams()
    key = normalize_sampler_name(name)
    merged = {**params.options.get(key, {}), **options}
    return sampler_class(key).from_params(params, env or SamplerEnv(), merged)


class SamplerChain(Sampler):
    """Samplers applied in order; :meth:`sample` picks a token and records it in the history."""

    name = "chain"

    def __init__(self, samplers: Iterable[Sampler] = ()):
        self.samplers: list[Sampler] = list(samplers)
        for s in self.samplers:
            if not isinstance(s, Sampler):
                raise SamplerError(f"a SamplerChain holds Sampler objects, got {s!r}")
        self.history: list[int] = []

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_params(  # type: ignore[override]  # a chain is built from the whole params, not one sampler's
            cls, params: SamplerParams | None = None, vocab: Vocab | None = None, *, model: Model | None = None,
            n_ctx: int | None = None, env: SamplerEnv | None = None,
            options: dict[str, Any] | None = None) -> "SamplerChain":
        """llama.cpp's ``common_sampler_init`` chain for ``params``."""
        params = params or SamplerParams()
        env = env or SamplerEnv.from_model(model, vocab, n_ctx)
        samplers: list[Sampler] = []
        if params.grammar_spec() is not None:  # first, like llama.cpp: later samplers see allowed tokens only
            samplers.append(build_sampler("grammar", params, env))
        if params.logit_bias:
            samplers.append(build_sampler("logit_bias", params, env))
        if params.mirostat == 0:
            samplers += [build_sampler(name, params, env) for name in params.samplers]
            samplers.append(build_sampler("greedy" if params.greedy else "dist", params, env))
        else:
            samplers.append(build_sampler("temperature", params, env, dynamic=False))
            samplers.append(build_sampler("mirostat" if params.mirostat == 1 else "mirostat_v2", params, env))
        return cls(samplers)

    @classmethod
    def greedy(cls) -> "SamplerChain":
        return cls([build_sampler("greedy")])

    @classmethod
    def from_names(cls, names: Sequence[str], params: SamplerParams | None = None, vocab: Vocab | None = None, *,
                   model: Model | None = None, n_ctx: int | None = None) -> "SamplerChain":
        """Exactly the named samplers, in order (add a selecting one such as ``dist`` yourself)."""
        env = SamplerEnv.from_model(model, vocab, n_ctx)
        return cls([build_sampler(n, params, env) for n in names])

    # -- Sampler interface ---------------------------------------------------------------------------------
    def apply(self, cur: Candidates) -> None:
        for sampler in self.samplers:
            sampler.apply(cur)

    def accept(self, token: int) -> None:
        token = int(token)
        for sampler in self.samplers:
            sampler.accept(token)
        self.history.append(token)

    def reset(self) -> None:
        for sampler in self.samplers:
            sampler.reset()
        self.history.clear()

    def accept_prompt(self, token: int) -> None:
        for sampler in self.samplers:
            sampler.accept_prompt(int(token))

    def done(self) -> bool:
        return any(sampler.done() for sampler in self.samplers)

    # -- use -----------------------------------------------------------------------------------------------
    def sample(self, ctx_or_logits: Context | np.ndarray, idx: int = -1) -> int:
        """Pick a token from a context's output row ``idx`` (or a logits vector) and accept it."""
        if isinstance(ctx_or_logits, np.ndarray):
            logits = ctx_or_logits
        else:
            logits = ctx_or_logits.get_logits_ith(idx)
        if self.in_vocabulary_order():
            values = vocabulary_logits(logits)
            for sampler in self.samplers[:-1]:
                sampler.apply_logits(values)
            token = self.samplers[-1].select_logits(values)
        else:
            cur = Candidates.from_logits(logits)
            self.apply(cur)
            token = cur.selected_token
        self.accept(token)
        return token

    def in_vocabulary_order(self) -> bool:
        """True when every sampler but the last only changes logits and the last selects from them (greedy
        with a logit bias or penalties): :meth:`sample` then works on the logits vector itself — no id array,
        no :class:`Candidates`, no copy per sampler — and picks the same token."""
        return (bool(self.samplers) and self.samplers[-1].selects_from_logits
                and all(sampler.logits_only for sampler in self.samplers[:-1]))

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.samplers]

    def __len__(self) -> int:
        return len(self.samplers)

    def __repr__(self) -> str:
        return f"SamplerChain({' -> '.join(self.names)})"
