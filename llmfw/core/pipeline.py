"""YAML pipelines: one file that names the model, where it runs, the context, the tokenizer options, the sampler
chain, the chat settings and the generation limits.

```yaml
model: smollm2                 # a catalog name or a path (relative paths are relative to this file)
backend: numpy                 # optional; default: torch when installed, else numpy
context: {n_ctx: 2048}
tokenizer: {parse_special: true}
sampling: {temp: 0.7, top_k: 40, samplers: [penalties, top_k, top_p, temperature]}
chat: {enabled: true, system: "You are terse."}
generation: {max_tokens: 128, stop: ["\\n\\n"]}
```

Every section is a pydantic model with ``extra="forbid"``: an unknown or misspelled key is an error, and every
error is a :class:`ConfigError` that names the file and the key path (``sampling.top_p: ...``); YAML syntax
errors give the line and column.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .catalog import DEFAULT_MODEL
from .errors import ConfigError
from .sampling import SamplerChain, SamplerParams, validation_error_message


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


class ChatConfig(_Section):
    """Chat settings: wrap prompts in the chat template (``enabled``), the system prompt, a template override
    (Jinja2 source, or ``template_file`` relative to the YAML file)."""

    enabled: bool = False
    system: str | None = None
    template: str | None = None
    template_file: str | None = None


class GenerationConfig(_Section):
    """Generation limits: ``max_tokens`` (None = until end of generation or a full context), ``stop`` strings,
    and an optional default ``prompt``."""

    max_tokens: int | None = Field(256, ge=0)
    stop: list[str] = Field(default_factory=list)
    prompt: str | None = None


class SpeculativeConfig(_Section):
    """Speculative decoding (``llmfw.core.speculative``): ``draft_max`` > 0 drafts up to that many tokens per
    step — by prompt lookup (n-grams of ``ngram_n`` tokens) or, with ``model_draft``, by a small model with the
    same vocabulary. 0 = off."""

    draft_max: int = Field(0, ge=0, le=1024)
    ngram_n: int = Field(3, ge=1, le=1024)
    model_draft: str | None = None


class PipelineConfig(_Section):
    """The whole pipeline file."""

    model: str = DEFAULT_MODEL
    backend: str | None = None
    placement: dict[int, str] | None = None
    n_gpu_layers: int = Field(0, ge=-1)
    load_mode: Literal["mmap", "read"] = "mmap"
    context: ContextConfig = Field(default_factory=ContextConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    sampling: SamplerParams = Field(default_factory=SamplerParams)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
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
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a pipeline file must be a mapping of keys (model, sampling, ...), "
                          f"found a {type(data).__name__}")
    return data


def merge_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with ``overrides`` applied; keys may be dotted (``"sampling.temp"``) or nested mappings."""
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
        node[parts[-1]] = value
    return merged


def validate_config(data: Mapping[str, Any], source: str = "<config>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(f"{source}: {validation_error_message(exc)}") from None


# -- the pipeline ----------------------------------------------------------------------------------------------
class Pipeline:
    """A validated configuration and the objects it builds (model, context, sampler chain) on demand."""

    def __init__(self, config: PipelineConfig, source: str | Path | None = None):
        self.config = config
        self.source = Path(source) if source is not None and not str(source).startswith("<") else None
        self._model: Any = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | Path | None = None) -> "Pipeline":
        return cls(validate_config(data, str(source or "<config>")), source)

    # -- paths -------------------------------------------------------------------------------------------
    def _relative(self, value: str) -> Path:
        path = Path(value).expanduser()
        if not path.is_absolute() and self.source is not None:
            beside = self.source.parent / path
            if beside.exists():
                return beside
        return path

    def model_location(self) -> str:
        """A path (relative ones resolved against the YAML file) or the catalog name."""
        candidate = self._relative(self.config.model)
        return str(candidate) if candidate.exists() else self.config.model

    def chat_template(self) -> str | None:
        chat = self.config.chat
        if chat.template_file:
            path = self._relative(chat.template_file)
            try:
                return path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ConfigError(f"chat.template_file: cannot read {path}: {exc.strerror or exc}") from None
        return chat.template

    # -- building ------------------------------------------------------------------------------------------
    def load_model(self, progress: Any = None) -> Any:
        """The model (loaded once)."""
        if self._model is None:
            from .model import load_model

            cfg = self.config
            self._model = load_model(self.model_location(), backend=cfg.backend, placement=cfg.placement,
                                     n_gpu_layers=cfg.n_gpu_layers, load_mode=cfg.load_mode, progress=progress)
        return self._model

    def new_context(self, model: Any = None) -> Any:
        model = model or self.load_model()
        params = self.config.context.model_dump(exclude_none=True)
        return model.new_context(**params)

    def make_drafter(self, model: Any = None, n_ctx: int = 0) -> Any:
        """The speculative drafter ``speculative`` configures, or None when it is off."""
        from .speculative import DEFAULT_DRAFT_MAX, DraftModelDrafter, NgramDrafter

        spec = self.config.speculative
        if spec.model_draft:
            from .model import load_model

            draft_model = load_model(str(self._relative(spec.model_draft)), backend=self.config.backend)
            return DraftModelDrafter(model or self.load_model(), draft_model, spec.draft_max or DEFAULT_DRAFT_MAX,
                                     n_ctx)
        return NgramDrafter(spec.draft_max, spec.ngram_n) if spec.draft_max else None

    def make_sampler(self, model: Any = None, n_ctx: int | None = None) -> SamplerChain:
        return SamplerChain.from_params(self.config.sampling, model=model or self.load_model(), n_ctx=n_ctx)

    def render_prompt(self, prompt: str, model: Any = None) -> str:
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

    def render_messages(self, messages: Sequence[Mapping[str, Any]], model: Any = None,
                        add_generation_prompt: bool = True) -> str:
        from .chat import apply_chat_template

        return apply_chat_template(model or self.load_model(), messages, add_generation_prompt,
                                   template=self.chat_template())

    def run(self, prompt: str | None = None, *, ctx: Any = None, sampler: SamplerChain | None = None,
            stats: Any = None, draft: Any = None) -> Iterator[str]:
        """Generate for ``prompt`` (or ``generation.prompt``) with everything the file configures."""
        from .generate import context_int, generate

        text = prompt if prompt is not None else self.config.generation.prompt
        if text is None:
            raise ConfigError("no prompt: pass one or set generation.prompt in the pipeline file")
        model = self.load_model()
        ctx = ctx if ctx is not None else self.new_context(model)
        sampler = sampler if sampler is not None else self.make_sampler(model, context_int(ctx, "n_ctx"))
        gen = self.config.generation
        tok = self.config.tokenizer
        return generate(ctx, self.render_prompt(text, model), sampler, max_tokens=gen.max_tokens, stop=gen.stop,
                        parse_special=tok.parse_special, add_special=tok.add_special, stats=stats,
                        draft=draft if draft is not None else self.make_drafter(model, context_int(ctx, "n_ctx") or 0))


def load_pipeline(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Pipeline:
    """Read, override (dotted keys) and validate a pipeline file."""
    data = read_yaml(path)
    if overrides:
        data = merge_overrides(data, overrides)
    return Pipeline.from_dict(data, Path(path))


__all__ = ["ChatConfig", "ContextConfig", "GenerationConfig", "Pipeline", "PipelineConfig", "SpeculativeConfig",
           "TokenizerConfig", "load_pipeline", "merge_overrides", "parse_yaml", "read_yaml", "validate_config"]
