"""How a server renders chats and treats thinking, the same for every API in front of the engine.

:class:`ChatOptions` holds the server-wide settings (``llmfw serve`` flags / the ``server`` and ``chat`` keys of
a pipeline file): the chat template override and where it came from, variables every render gets
(``--chat-template-kwargs``), the reasoning format (``--reasoning-format``) and the thinking budget
(``--reasoning-budget``). :func:`chat_template_of` says which template a request is rendered with and names it
for messages (the ``tool_choice: auto`` warning names the template).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.tokenizer.chat import CHATML_TEMPLATE, model_chat_template
from ..core.errors import ConfigError

ReasoningFormat = Literal["deepseek", "none"]
REASONING_FORMATS = ("deepseek", "none")


@dataclass(frozen=True)
class ChatOptions:
    """Server-wide chat settings. ``template_kwargs`` reach every template render (a request's own
    ``chat_template_kwargs`` win over them); ``reasoning_budget`` -1 means no limit."""

    template_origin: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_format: ReasoningFormat = "deepseek"
    reasoning_budget: int = -1


def parse_template_kwargs(value: Any, where: str) -> dict[str, Any]:
    """A ``chat_template_kwargs`` value (a mapping or its JSON text) as a dict; ConfigError otherwise."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a JSON object such as {{\"enable_thinking\": false}}, "
                          f"got {type(value).__name__}")
    return dict(value)


def chat_options_from_config(pipeline: Any) -> ChatOptions:
    """The :class:`ChatOptions` of a pipeline's ``server`` and ``chat`` settings (ConfigError when one is bad;
    the template file is read here, so a missing one fails before the server starts)."""
    cfg = pipeline.config
    server = cfg.server
    pipeline.chat_template()  # reads the file: a missing one is a ConfigError now
    origin = None
    if cfg.chat.template_file:
        origin = f"the chat template file {cfg.chat.template_file}"
    elif cfg.chat.template:
        origin = "the chat.template of the pipeline file"
    kwargs = parse_template_kwargs(server.chat_template_kwargs, "--chat-template-kwargs")
    return ChatOptions(template_origin=origin, template_kwargs=kwargs, reasoning_format=server.reasoning_format,
                       reasoning_budget=server.reasoning_budget)


def chat_template_of(engine: Any) -> tuple[str, str]:
    """(the Jinja source chats are rendered with, a name for it in messages)."""
    if engine.chat_template:
        return engine.chat_template, engine.chat_options.template_origin or "the server's chat template"
    own = model_chat_template(engine.model)
    if own:
        return own, f"the chat template in {engine.alias} (tokenizer.chat_template)"
    return CHATML_TEMPLATE, f"the built-in ChatML template ({engine.alias} has no tokenizer.chat_template)"


def render_chat_prompt(engine: Any, messages: list[dict[str, Any]], tools: Any = None,
                       template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation: the engine's template, the server's template variables overridden by
    the request's (``chat_template_kwargs``), ``tools`` as transformers passes them."""
    from ..core.tokenizer.chat import apply_chat_template
    from .tool_call_ids import needs_mistral_ids, with_mistral_tool_call_ids

    template, _ = chat_template_of(engine)
    extra = {**engine.chat_options.template_kwargs, **(template_kwargs or {})}
    if tools:
        extra["tools"] = tools
    if needs_mistral_ids(template):  # its template raises on any other tool-call id
        messages = with_mistral_tool_call_ids(messages)
    return apply_chat_template(engine.model, messages, template=template, **extra)
