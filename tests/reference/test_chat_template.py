"""Chat templates: llama.cpp's rendering of SmolLM2's template, the ChatML fallback, and the sandbox."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmfw.core.chat import CHATML_TEMPLATE, apply_chat_template, model_chat_template, render_chat_template
from llmfw.core.errors import ChatTemplateError

DATA = Path(__file__).resolve().parents[1] / "data" / "chat_template_smollm2.json"
MESSAGES = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def smollm2_vocab_model(shared_models):
    return shared_models.get("smollm2", vocab_only=True)


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads(DATA.read_text(encoding="utf-8"))


def test_reference_file_is_llama_cpps(expected):
    assert expected["cases"] and expected["llama_cpp_python"]
    assert any(c["name"] == "three_turns_with_system" and c["add_generation_prompt"] for c in expected["cases"])


def test_smollm2_template_matches_llama_cpp(smollm2_vocab_model, expected):
    assert model_chat_template(smollm2_vocab_model) == expected["template"]
    for case in expected["cases"]:
        got = smollm2_vocab_model.apply_chat_template(case["messages"], case["add_generation_prompt"])
        assert got == case["jinja"], case["name"]
        if case["name"] == "three_turns_with_system":  # llama.cpp's C++ ChatML formatter agrees here
            assert got == case["llama_cpp_builtin"]


def test_chatml_fallback_for_a_model_without_template():
    class NoTemplate:  # a model object as far as chat templates care: metadata without the key
        metadata: dict = {}
        vocab = None

    text = apply_chat_template(NoTemplate(), MESSAGES[:2], add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat_template(CHATML_TEMPLATE, MESSAGES[:2], add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_template_override_and_hf_helpers():
    template = ("{{ bos_token }}{% for m in messages %}{{ m.role }}={{ m.content | tojson }};{% endfor %}"
                "{{ strftime_now('%Y') | length }}")
    out = render_chat_template(template, [{"role": "user", "content": "ñ \"q\""}], bos_token="<s>")
    assert out == '<s>user="ñ \\"q\\"";4'


@pytest.mark.parametrize("template, fragment", [
    ("{{ ''.__class__.__mro__ }}", "'__class__'"),
    ("{{ cycler.__init__.__globals__ }}", "'__init__'"),
    ("{{ messages.__class__.__subclasses__() }}", "'__class__'"),
    ("{{ raise_exception.__globals__ }}", "'__globals__'"),
    ("{{ messages.append({'role': 'x'}) }}", "'append'"),
    ("{{ 'a' * 100000000 }}", "value of 100000000"),
])
def test_sandbox_refuses_python_internals(template, fragment):
    with pytest.raises(ChatTemplateError, match="sandbox forbids") as info:
        render_chat_template(template, MESSAGES)
    assert fragment in str(info.value)


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="refused the conversation: roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render_chat_template("ok\n{% for m in messages %}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="Range too big"):
        render_chat_template("{% for i in range(10**7) %}{% endfor %}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="needs 'role' and 'content'"):
        render_chat_template(CHATML_TEMPLATE, [{"role": "user"}])
