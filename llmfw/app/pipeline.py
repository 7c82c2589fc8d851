"""YAML pipelines: one file that names the model, where it runs, the context, the tokenizer options, the sampler
chain, the chat settings and the generation limits.

```yaml
model: smollm2                 # a catalog name or a path (relative paths are relative to this file)
backend: numpy                 # optional; default: torch:cuda on a CUDA GPU, else native, else onnx, else numpy
context: {n_ctx: 2048}
tokenizer: {parse_special: true}
sampling: {temp: 0.7, top_k: 40, samplers: [penalties, top_k, top_p, temperature]}
chat: {enabled: true, system: "You are terse."}
generation: {max_tokens: 128, stop: ["\\n\\n"]}
server: {port: 8080, parallel: 4, api_key_file: key.txt}   # llmfw serve
```

Every section is a pydantic model with ``extra="forbid"``: an unknown or misspelled key is an error (with the
closest valid name: "did you mean `top_p`?"), and all of a file's errors come in one :class:`ConfigError` that
names the file and each key path (``p.yaml: sampling.top_p: must be <= 1 (got 1.5); ...``); YAML syntax errors
give the line and column; an empty file is an error.

Keys mirror the command-line flags: ``sampling.repeat_penalty`` is ``--repeat-penalty``, and so on
(:data:`SAMPLING_FLAG_NAMES`); the :class:`SamplerParams` field names (``penalty_repeat``, ...) are accepted as
aliases.
"""
from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Mapping, Sequence, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..core.format.catalog import DEFAULT_MODEL, lookup
from ..core.errors import BackendUnavailable, ConfigError, UnknownBackend
from ..core.generation.sampling import SamplerChain, SamplerParams, validation_problems

if TYPE_CHECKING:
    from ..core.runtime.context import Context
    from ..core.generation.generate import GenerationStats
    from ..core.runtime.model import Model
    from ..core.generation.speculative import Drafter

#: YAML ``sampling`` keys named after the CLI flags (``--repeat-penalty`` -> ``repeat_penalty``) -> the
#: SamplerParams field (llama.cpp's ``common_params_sampling`` name), which stays accepted as an alias
SAMPLING_FLAG_NAMES = {
    "repeat_penalty": "penalty_repeat",
    "repeat_last_n": "penalty_last_n",
    "presence_penalty": "penalty_present",
    "frequency_penalty": "penalty_freq",
    "typical": "typical_p",
    "mirostat_lr": "mirostat_eta",
    "mirostat_ent": "mirostat_tau",
}
_FIELD_TO_FLAG_NAME = {field: name for name, field in SAMPLING_FLAG_NAMES.items()}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContextConfig(_Section):
    """Context parameters (``llmfw.ContextParams``); 0 for n_ctx = min(n_ctx_train, 4096)."""

    n_ctx: int = Field(0, ge=0)
    n_batch: int = Field(2048, ge=1)
    n_ubatch: int = Field(512, ge=1)
    n_seq_max: int = Field(1, ge=1)
    n_threads: int | None = Field(None, ge=1)


class TokenizerConfig(_Section):
    """How prompts are tokenized: llama.cpp's ``add_special`` / ``parse_special`` flags."""

    add_special: bool = True
    parse_special: bool = True
    #: print control tokens in the output (llama-cli ``--special``)
    special: bool = False


class ChatConfig(_Section):
    """Chat settings: wrap prompts in the chat template (``enabled``), the system prompt, a template override
    (Jinja2 source, or ``template_file`` relative to the YAML file)."""

    enabled: bool = False
    system: str | None = None
    template: str | None = None
    template_file: str | None = None


class GenerationConfig(_Section):
    """Generation limits: ``max_tokens`` like ``-n`` (N >= 0; -1 or None = until end of generation, -2 = until
    the context is full — both stop at a full context, llmfw has no context shift), ``stop`` strings, and an
    optional default ``prompt``."""

    max_tokens: int | None = 256
    stop: list[str] = Field(default_factory=list)
    prompt: str | None = None

    @field_validator("max_tokens")
    @classmethod
    def _llama_cpp_limit(cls, value: int | None) -> int | None:
        if value is None or value >= 0:
            return value
        if value in (-1, -2):
            return None
        raise ValueError("must be >= 0, -1 (until end of generation) or -2 (until the context is full)")


class RayAutoscalingConfig(_Section):
    """Ray Serve's autoscaling: replicas between ``min_replicas`` and ``max_replicas``, aiming at
    ``target_ongoing_requests`` per replica; the delays say how long load must stay high / low before a change."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float | None = Field(None, ge=0)
    downscale_delay_s: float | None = Field(None, ge=0)
    #: how often replicas report their load, and over how long a window Ray averages it
    metrics_interval_s: float | None = Field(None, gt=0)
    look_back_period_s: float | None = Field(None, gt=0)


class RayConfig(_Section):
    """``llmfw serve --ray``: the same app as Ray Serve replicas. ``address`` None starts a local Ray instance,
    ``auto`` or ``ray://HOST:PORT`` joins a cluster; ``num_replicas`` or ``autoscaling_config`` (not both);
    ``ray_actor_options`` go to every replica's actor (``num_cpus``, ``memory``, ...)."""

    address: str | None = None
    num_replicas: int | None = Field(None, ge=1)
    autoscaling_config: RayAutoscalingConfig | None = None
    ray_actor_options: dict[str, Any] = Field(default_factory=dict)


class ServerConfig(_Section):
    """``llmfw serve`` settings (the flags of the same names); the model, backend, ``context.n_ctx`` and
    ``context.n_threads`` come from their usual keys."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    parallel: int = Field(4, ge=1, le=64)
    api_key: str | None = None
    api_key_file: str | None = None
    max_queue: int = Field(64, ge=0)
    alias: str | None = None
    cors_origin: list[str] = Field(default_factory=list)
    webui: bool = True  # the browser chat page at / (--no-webui: off)
    ray: RayConfig | None = None  # present (or --ray): serve as a Ray Serve application
    #: thinking text: "deepseek" splits it into reasoning_content, "none" leaves it in the content
    reasoning_format: Literal["deepseek", "none"] = "deepseek"
    #: most thinking tokens before the closing tag is forced (-1: no limit, 0: no thinking)
    reasoning_budget: int = Field(-1, ge=-1)
    #: variables for every chat template render (a mapping, or its JSON text from the command line)
    chat_template_kwargs: dict[str, Any] | str | None = None
    #: serve every ``*.gguf`` of this folder (relative to the YAML file), each named by its file stem
    models_dir: str | None = None
    #: with several models: most loaded at once, the least recently used unloaded to make room (0 = no limit)
    models_max: int = Field(4, ge=0)


class ServedModelConfig(_Section):
    """One entry of a ``models:`` list (``llmfw serve`` with several models): the ``model`` (a catalog name or a
    path, relative to the YAML file), its ``name`` in ``/v1/models`` and requests (default: the file's stem or
    the catalog name) and other names requests may use (``aliases``)."""

    model: str = Field(min_length=1)
    name: str | None = Field(None, min_length=1)
    aliases: list[str] = Field(default_factory=list)


class SpeculativeConfig(_Section):
    """Speculative decoding (``llmfw.core.generation.speculative``): ``draft_max`` > 0 drafts up to that many tokens per
    step — by prompt lookup (n-grams of ``ngram_n`` tokens) or, with ``model_draft``, by a small model with the
    same vocabulary. 0 = off."""

    draft_max: int = Field(0, ge=0, le=1024)
    ngram_n: int = Field(3, ge=1, le=1024)
    model_draft: str | None = None


class PipelineConfig(_Section):
    """The whole pipeline file."""

    model: str = DEFAULT_MODEL
    #: ``llmfw serve`` with several models, each routed by the request's ``model`` (instead of ``model``)
    models: list[ServedModelConfig] | None = None
    backend: str | None = None
    placement: dict[int, str] | None = None
    n_gpu_layers: int = Field(0, ge=-1)
    load_mode: Literal["mmap", "read"] = "mmap"
    #: per backend registry name, its options (``ModelParams.backend_options``): ``{torch: {matmul: int8}}``
    backend_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    context: ContextConfig = Field(default_factory=ContextConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    sampling: SamplerParams = Field(default_factory=SamplerParams)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)


# -- reading -------------------------------------------------------------------------------------------------
def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from a file; syntax errors name the line and column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the pipeline file: {exc.strerror or exc}") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str = "<string>") -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: YAML syntax error at {where}{problem}") from None
    if data is None:
        raise ConfigError(f"{source}: the pipeline file is empty; give at least `model:` (e.g. `model: smollm2`)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a pipeline file must be a mapping of keys (model, sampling, ...), "
                          f"found a {type(data).__name__}")
    return data


def _spellings(parents: list[str], key: str) -> set[str]:
    """Every accepted name of one key (``sampling.repeat_penalty`` / ``sampling.penalty_repeat``)."""
    if parents != ["sampling"]:
        return {key}
    field = SAMPLING_FLAG_NAMES.get(key, key)
    return {field, _FIELD_TO_FLAG_NAME.get(field, field)}


def merge_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with ``overrides`` applied; keys may be dotted (``"sampling.temp"``) or nested mappings. An
    override replaces the key under any of its spellings (a flag wins over the file's alias)."""
    merged = copy.deepcopy(dict(data))
    for key, value in overrides.items():
        parts = key.split(".")
        node = merged
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        for spelling in _spellings(parts[:-1], parts[-1]):
            node.pop(spelling, None)
        node[parts[-1]] = value
    return merged


def _canonical_sampling(data: dict[str, Any]) -> list[str]:
    """Rename the flag-style ``sampling`` keys to SamplerParams fields in place; problems for a key given twice."""
    sampling = data.get("sampling")
    if not isinstance(sampling, dict):
        return []
    problems = []
    renamed = {}
    for key, value in sampling.items():
        field = SAMPLING_FLAG_NAMES.get(key, key) if isinstance(key, str) else key
        if field in renamed:
            problems.append(f"sampling.{_FIELD_TO_FLAG_NAME.get(field, field)}: given twice (as "
                            f"`{_FIELD_TO_FLAG_NAME.get(field, field)}` and `{field}`), keep one")
        renamed[field] = value
    data["sampling"] = renamed
    return problems


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds: itself, or inside a list or an optional (``list[X] | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for inner in get_args(annotation):
        found = _section_class(inner)
        if found is not None:
            return found
    return None


def _section_names(path: list[str]) -> list[str]:
    """The valid keys of the section at ``path`` (flag-style names for ``sampling``), for "did you mean"."""
    model: Any = PipelineConfig
    for part in path:
        if part.isdigit():  # an entry of a list section (``models.0``)
            continue
        field = getattr(model, "model_fields", {}).get(part)
        model = _section_class(getattr(field, "annotation", None))
        if model is None:
            return []
    names = list(model.model_fields)
    return [_FIELD_TO_FLAG_NAME.get(n, n) for n in names] + list(_FIELD_TO_FLAG_NAME) if path == ["sampling"] else names


def _shown_path(path: str) -> str:
    """A key path as the documentation spells it (``sampling.penalty_repeat`` -> ``sampling.repeat_penalty``)."""
    parts = path.split(".")
    if len(parts) == 2 and parts[0] == "sampling":
        parts[1] = _FIELD_TO_FLAG_NAME.get(parts[1], parts[1])
    return ".".join(parts)


def _problem_text(path: str, message: str) -> str:
    if message.startswith("unknown key"):
        parts = path.split(".")
        match = difflib.get_close_matches(parts[-1], _section_names(parts[:-1]), n=1, cutoff=0.6)
        if match:
            message = f"unknown key, did you mean `{match[0]}`?"
        else:
            message = "unknown key; valid here: " + ", ".join(sorted(set(_section_names(parts[:-1])))) \
                if _section_names(parts[:-1]) else "unknown key"
    return f"{_shown_path(path)}: {message}"


def validate_config(data: Mapping[str, Any], source: str = "<config>") -> PipelineConfig:
    """The validated configuration; every problem of the file in one :class:`ConfigError` naming ``source``."""
    copied: dict[str, Any] = copy.deepcopy(dict(data))
    problems = _canonical_sampling(copied)
    config: PipelineConfig | None = None
    try:
        config = PipelineConfig.model_validate(copied)
    except ValidationError as exc:
        problems += [_problem_text(path, message) for path, message in validation_problems(exc)]
    if problems or config is None:
        count = f"{len(problems)} problems: " if len(problems) > 1 else ""
        raise ConfigError(f"{source}: {count}{'; '.join(problems)}")
    return config


# -- the pipeline ----------------------------------------------------------------------------------------------
class Pipeline:
    """A validated configuration and the objects it builds (model, context, sampler chain) on demand."""

    def __init__(self, config: PipelineConfig, source: str | Path | None = None, *,
                 overridden: frozenset[str] = frozenset()):
        self.config = config
        self.source = Path(source) if source is not None and not str(source).startswith("<") else None
        #: dotted keys set from outside the file (command-line flags): errors about them do not blame the file
        self.overridden = overridden
        self._model: Model | None = None
        self._draft_model: Model | None = None  # speculative.model_draft, loaded once like the model

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | Path | None = None, *,
                  overridden: frozenset[str] = frozenset()) -> "Pipeline":
        data = _with_constraint_files_read(data, source)
        return cls(validate_config(data, str(source or "<config>")), source, overridden=overridden)

    def _from_file(self, key: str) -> bool:
        return self.source is not None and key not in self.overridden

    def _blame(self, key: str) -> str:
        """``"p.yaml: model: "`` for a key the file set, ``"model: "`` for one a flag set."""
        return f"{self.source}: {key}: " if self._from_file(key) else f"{key}: "

    # -- paths -------------------------------------------------------------------------------------------
    def _relative(self, value: str) -> Path:
        path = Path(value).expanduser()
        if not path.is_absolute() and self.source is not None:
            beside = self.source.parent / path
            if beside.exists():
                return beside
        return path

    def model_location(self) -> str:
        """A path (relative ones resolved against the YAML file) or the catalog name; neither is an error
        naming the file that asked for it."""
        return self.locate_model(self.config.model, "model")

    def locate_model(self, value: str, key: str) -> str:
        """:meth:`model_location` of any model the configuration names (``key``: where, for the error)."""
        candidate = self._relative(value)
        if candidate.exists():
            return str(candidate)
        if lookup(value) is None:
            where = f" (as given or relative to {self.source.parent})" if self.source is not None else ""
            raise ConfigError(f"{self._blame(key)}{value!r} is neither a file{where} nor a catalog "
                              "model (`llmfw models` lists them)")
        return value

    def relative_path(self, value: str) -> Path:
        """``value`` as a path, relative ones resolved against the YAML file's folder when that holds them."""
        return self._relative(value)

    def with_model(self, location: str) -> "Pipeline":
        """This pipeline with another ``model`` (each model of a server that serves several)."""
        config = self.config.model_copy(update={"model": location, "models": None}, deep=True)
        return Pipeline(config, self.source, overridden=self.overridden | {"model"})

    def chat_template(self) -> str | None:
        chat = self.config.chat
        if chat.template_file:
            path = self._relative(chat.template_file)
            try:
                return path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"{self._blame('chat.template_file')}cannot read {path}: "
                                  f"{exc.strerror or exc}") from None
        return chat.template

    # -- building ------------------------------------------------------------------------------------------
    def load_model(self, progress: Callable[[float], bool | None] | None = None) -> Model:
        """The model (loaded once)."""
        if self._model is None:
            from ..core.runtime.model import load_model

            cfg = self.config
            location = self.model_location()
            try:
                self._model = load_model(location, backend=cfg.backend, placement=cfg.placement,
                                         n_gpu_layers=cfg.n_gpu_layers, load_mode=cfg.load_mode, progress=progress,
                                         backend_options=self.backend_options())
            except (UnknownBackend, BackendUnavailable) as exc:
                if cfg.backend is None or not self._from_file("backend"):
                    raise
                raise type(exc)(f"{self._blame('backend')}{exc}") from exc  # the file asked for it: say which
        return self._model

    def backend_options(self) -> dict[str, dict[str, Any]]:
        """The file's ``backend_options`` over those the environment sets (``LLMFW_TORCH_MATMUL``, ...: every
        CLI command runs a pipeline, so the variables stay command-line conveniences)."""
        import os

        from ..core.exec.backend import backend_options_from_environment, merge_backend_options

        return merge_backend_options(backend_options_from_environment(os.environ), self.config.backend_options)

    def new_context(self, model: Model | None = None) -> Context:
        model = model or self.load_model()
        params = self.config.context.model_dump(exclude_none=True)
        return model.new_context(**params)

    def make_drafter(self, model: Model | None = None, n_ctx: int = 0) -> Drafter | None:
        """The speculative drafter ``speculative`` configures, or None when it is off."""
        from ..core.generation.speculative import DEFAULT_DRAFT_MAX, DraftModelDrafter, NgramDrafter

        spec = self.config.speculative
        if spec.model_draft:
            from ..core.runtime.model import load_model

            if self._draft_model is None:
                self._draft_model = load_model(str(self._relative(spec.model_draft)), backend=self.config.backend,
                                               backend_options=self.backend_options())
            return DraftModelDrafter(model or self.load_model(), self._draft_model,
                                     spec.draft_max or DEFAULT_DRAFT_MAX, n_ctx)
        return NgramDrafter(spec.draft_max, spec.ngram_n) if spec.draft_max else None

    def make_sampler(self, model: Model | None = None, n_ctx: int | None = None) -> SamplerChain:
        return SamplerChain.from_params(self.config.sampling, model=model or self.load_model(), n_ctx=n_ctx)

    def render_prompt(self, prompt: str, model: Model | None = None) -> str:
        """The prompt as the model sees it: wrapped in the chat template when ``chat.enabled``."""
        if not self.config.chat.enabled:
            return prompt
        return self.render_messages(self.messages_for(prompt), model)

    def messages_for(self, prompt: str) -> list[dict[str, str]]:
        messages = []
        if self.config.chat.system:
            messages.append({"role": "system", "content": self.config.chat.system})
        messages.append({"role": "user", "content": prompt})
        return messages

    def render_messages(self, messages: Sequence[Mapping[str, Any]], model: Model | None = None,
                        add_generation_prompt: bool = True) -> str:
        from ..core.tokenizer.chat import apply_chat_template

        return apply_chat_template(model or self.load_model(), messages, add_generation_prompt,
                                   template=self.chat_template())

    def run(self, prompt: str | None = None, *, ctx: Context | None = None, sampler: SamplerChain | None = None,
            stats: GenerationStats | None = None, draft: Drafter | None = None) -> Iterator[str]:
        """Generate for ``prompt`` (or ``generation.prompt``) with everything the file configures."""
        from ..core.generation.generate import generate

        text = prompt if prompt is not None else self.config.generation.prompt
        if text is None:
            raise ConfigError("no prompt: pass one or set generation.prompt in the pipeline file")
        model = self.load_model()
        ctx = ctx if ctx is not None else self.new_context(model)
        sampler = sampler if sampler is not None else self.make_sampler(model, ctx.n_ctx)
        gen = self.config.generation
        tok = self.config.tokenizer
        return generate(ctx, self.render_prompt(text, model), sampler, max_tokens=gen.max_tokens, stop=gen.stop,
                        parse_special=tok.parse_special, add_special=tok.add_special, stats=stats,
                        special=tok.special,
                        draft=draft if draft is not None else self.make_drafter(model, ctx.n_ctx))


def _with_constraint_files_read(data: Mapping[str, Any], source: str | Path | None) -> Mapping[str, Any]:
    """``sampling.grammar`` / ``sampling.json_schema`` naming a file (relative to the YAML file) -> its text."""
    from ..core.errors import GrammarError
    from ..core.generation.grammar import constraint_file, read_constraint_file

    sampling = data.get("sampling")
    if not isinstance(sampling, Mapping):
        return data
    base = Path(source).parent if source is not None and not str(source).startswith("<") else Path(".")
    replaced = dict(sampling)
    for key in ("grammar", "json_schema"):
        name = constraint_file(key, sampling.get(key))
        if name is not None:
            path = Path(name).expanduser()
            try:
                replaced[key] = read_constraint_file(path if path.is_absolute() else base / path, key)
            except GrammarError as exc:
                raise ConfigError(f"{source or '<config>'}: sampling.{key}: {exc}") from None
    return {**data, "sampling": replaced}


def load_pipeline(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Pipeline:
    """Read, override (dotted keys) and validate a pipeline file."""
    data = read_yaml(path)
    if overrides:
        data = merge_overrides(data, overrides)
    return Pipeline.from_dict(data, Path(path))


__all__ = ["ChatConfig", "ContextConfig", "GenerationConfig", "Pipeline", "PipelineConfig", "RayAutoscalingConfig",
           "RayConfig", "ServedModelConfig", "ServerConfig", "SpeculativeConfig",
           "TokenizerConfig", "load_pipeline", "merge_overrides", "parse_yaml", "read_yaml", "validate_config"]
