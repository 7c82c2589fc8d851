"""llama.cpp's collection of real chat templates (tests/data/chat_templates/*.jinja) renders exactly as Hugging
Face transformers' ``apply_chat_template`` renders them (expected.json, made by
tests/reference_gen/chat_templates_hf.py from cases.json: system + user, multi-turn, add_generation_prompt both
ways, tools and a tool-call round trip where a template uses them, ``enable_thinking`` where it reads it).
A conversation transformers refuses is refused here too, as a ChatTemplateError."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from llmfw.core.chat import render_chat_template
from llmfw.core.errors import ChatTemplateError

DATA = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
INPUTS = json.loads((DATA / "cases.json").read_text(encoding="utf-8"))
EXPECTED = json.loads((DATA / "expected.json").read_text(encoding="utf-8"))["templates"]
RENDERS = [(template, case) for template, cases in EXPECTED.items() for case in cases]


def render_case(template: str, case_name: str) -> str:
    case = INPUTS["cases"][case_name]
    extra = dict(case.get("extra", {}))
    if "tools" in case:
        extra["tools"] = INPUTS["tools"][case["tools"]]
    clock = datetime.fromisoformat(INPUTS["clock"])
    source = (DATA / template).read_text(encoding="utf-8")
    return render_chat_template(source, INPUTS["conversations"][case["messages"]],
                                add_generation_prompt=case["add_generation_prompt"], strftime_now=clock.strftime,
                                **INPUTS["special_tokens"], **extra)


def test_the_collection_is_complete():
    assert len(EXPECTED) == len(list(DATA.glob("*.jinja"))) == 70
    assert len(RENDERS) >= 400
    assert sum("error" not in EXPECTED[t][c] for t, c in RENDERS) >= 380


@pytest.mark.parametrize("template, case", RENDERS, ids=[f"{t[:-6]}-{c}" for t, c in RENDERS])
def test_renders_as_transformers(template, case):
    expected = EXPECTED[template][case]
    if "error" in expected:
        with pytest.raises(ChatTemplateError):
            render_case(template, case)
    else:
        assert render_case(template, case) == expected["text"]


def test_every_extra_keyword_reaches_the_template():
    template = "{{ tools | tojson }}|{{ documents }}|{{ date_string }}|{{ enable_thinking }}|{{ custom.x if custom is defined }}"
    assert render_chat_template(template, []) == "null|None|||"
    rendered = render_chat_template(template, [], tools=[{"a": "é"}], date_string="1 Jan 2026", enable_thinking=False,
                                    custom={"x": 3})
    assert rendered == '[{"a": "é"}]|None|1 Jan 2026|False|3'


def test_generation_tag_renders_its_body_and_tojson_takes_keywords():
    template = ("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
                "{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=True, separators=(',', ': ')) }}")
    assert render_chat_template(template, [{"role": "user", "content": "x"}]) == \
        '[x]{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}'


def test_reasoning_fields_are_aliased_as_transformers_does():
    template = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }}{% endfor %}"
    assert render_chat_template(template, [{"role": "assistant", "content": "", "reasoning": "hmm"}]) == "hmm/hmm"


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_x=1) %}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ strftime_now.__globals__ }}",
    "{{ tools.__class__.__mro__ }}",
    "{{ messages.append(1) }}",
])
def test_sandbox_still_holds(template):
    with pytest.raises(ChatTemplateError):
        render_chat_template(template, [], tools=[])
