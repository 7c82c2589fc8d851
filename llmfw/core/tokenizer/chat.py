"""Chat templates: render a conversation into the prompt text a chat model was trained on.

Models ship their template as Jinja2 source in the GGUF key ``tokenizer.chat_template`` (the Hugging Face
convention). Those templates come from files we did not write, so they are rendered in jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` with the globals Hugging Face and llama-cpp-python
provide (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text), and with two extra
guards: touching an unsafe attribute (``__class__``, ``__globals__``, ...) is an immediate
:class:`ChatTemplateError` instead of a silent empty string, and ``*`` / ``**`` may not build huge values.

A model without a template gets ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``), llama.cpp's fallback.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..errors import ChatTemplateError

if TYPE_CHECKING:
    from .vocab import Vocab

#: llama.cpp's built-in fallback format
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: metadata key of a model's default template
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

#: largest string / list a template may build with ``*`` (and largest result of ``**``)
MAX_TEMPLATE_VALUE = 1 << 20


class _GuardedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, made loud: unsafe access raises at once, and ``*`` / ``**`` are bounded."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:  # jinja2 hook
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not "
                            "allowed in a chat template")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) \
                        and len(seq) * count > MAX_TEMPLATE_VALUE:
                    raise SecurityError(f"the template tried to build a value of {len(seq) * count} items "
                                        f"(limit {MAX_TEMPLATE_VALUE})")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 4096:
            raise SecurityError(f"the template tried to compute a power with exponent {right}")
        return super().call_binop(context, operator, left, right)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's part with it (to build an
    assistant-token mask); for rendering it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(Namespace):
    """jinja2's ``namespace()`` that refuses underscore names, as transformers' does (no ``ns.__class__`` tricks)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja2's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not store the underscore name {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """Hugging Face's tojson: unlike jinja2's built-in, it keeps non-ASCII text and does not HTML-escape."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def template_environment() -> _GuardedEnvironment:
    """The shared sandbox (trim_blocks / lstrip_blocks, as Hugging Face and llama-cpp-python render), built once:
    it caches compiled templates, and nothing in it depends on the caller."""
    env = _GuardedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


#: names a message's reasoning comes under; transformers fills the first from the others and ``thinking`` too
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} must be a mapping with 'role' and 'content', got {message!r}")
        if "role" not in message or "content" not in message:
            raise ChatTemplateError(f"message {i} needs 'role' and 'content' keys, got {sorted(message)}")
        checked.append(_with_reasoning_aliases(dict(message)))
    return checked


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``_alias_reasoning_fields``: templates read ``reasoning_content`` (gpt-oss ``thinking``)."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "", **extra: Any) -> str:
    """Render a Jinja2 chat template in the sandbox; any failure is a :class:`ChatTemplateError`.

    Every ``extra`` keyword (``tools``, ``documents``, ``date_string``, ``enable_thinking`` ...) reaches the template
    as a variable; ``tools`` and ``documents`` are None when not given, as transformers passes them."""
    checked = _check_messages(messages)
    variables = {"tools": None, "documents": None, **extra}
    try:
        compiled = _compiled(template)
        return compiled.render(messages=checked, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **variables)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"the chat template tried something the sandbox forbids: {exc}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template has a syntax error at line {exc.lineno}: {exc.message}") \
            from None
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError,
            RecursionError, OverflowError) as exc:
        raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from None


@lru_cache(maxsize=32)
def _compiled(template: str) -> jinja2.Template:
    """Compiling a large template costs tens of milliseconds; a chat or a server renders the same one again and
    again (bounded: a few distinct templates per process)."""
    return template_environment().from_string(template)


def _metadata_value(model: object, key: str) -> Any:
    """A GGUF metadata value from the model, whichever way the engine exposes it."""
    for attr in ("metadata", "meta", "kv"):
        table = getattr(model, attr, None)
        if table is None:
            continue
        getter = getattr(table, "get", None)
        if callable(getter):
            value = getter(key)
            if value is not None:
                return getattr(value, "value", value)
    loader = getattr(model, "loader", None)
    return _metadata_value(loader, key) if loader is not None and loader is not model else None


def model_chat_template(model: object) -> str | None:
    """The model's own template (``tokenizer.chat_template``), or None."""
    template = _metadata_value(model, CHAT_TEMPLATE_KEY)
    if isinstance(template, bytes):
        template = template.decode("utf-8", errors="replace")
    return template if isinstance(template, str) and template.strip() else None


def _special_text(vocab: Vocab, names: tuple[str, ...]) -> str:
    token = None
    for name in names:
        value = getattr(vocab, name, None)
        value = value() if callable(value) else value
        if isinstance(value, int) and value >= 0:
            token = value
            break
    if token is None:
        return ""
    try:
        piece = vocab.token_to_piece(token, special=True)
    except Exception:  # noqa: BLE001 - a missing special token only means an empty bos/eos string
        return ""
    return piece.decode("utf-8", errors="replace") if isinstance(piece, bytes) else str(piece)


def apply_chat_template(model: object, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        template: str | None = None, **extra: Any) -> str:
    """Render ``messages`` with ``template``, else the model's ``tokenizer.chat_template``, else ChatML.

    ``bos_token`` / ``eos_token`` are the model's special tokens as text, as llama.cpp passes them.
    """
    source = template or model_chat_template(model) or CHATML_TEMPLATE
    vocab = getattr(model, "vocab", None)
    bos = _special_text(vocab, ("bos_id", "bos", "token_bos", "special_bos_id", "bos_token_id")) if vocab else ""
    eos = _special_text(vocab, ("eos_id", "eos", "token_eos", "special_eos_id", "eos_token_id")) if vocab else ""
    return render_chat_template(source, messages, add_generation_prompt, bos_token=bos, eos_token=eos, **extra)
