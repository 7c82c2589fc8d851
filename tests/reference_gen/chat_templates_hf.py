"""Render llama.cpp's chat-template collection with Hugging Face transformers: the expected strings of
tests/unit/test_chat_template_zoo.py (tests/data/chat_templates/expected.json).

Run once, in a throw-away environment (transformers is never a dependency of llmfw or its tests):

    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install transformers jinja2
    /tmp/tfenv/bin/python tests/reference_gen/chat_templates_hf.py

The conversations, tools and the fixed clock live in tests/data/chat_templates/cases.json, which the test reads
too, so both sides render the same input. transformers' renderer is ``render_jinja_template`` (what
``apply_chat_template`` calls); ``strftime_now`` is pinned to the fixed clock on the compiled template, so dates
do not depend on the day the file was made. A template that refuses a conversation (``raise_exception``, or any
error) is recorded as ``{"error": ...}``.
"""
from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from transformers import __version__ as transformers_version
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

DATA = Path(__file__).resolve().parent.parent / "data" / "chat_templates"


def applicable(case: dict, source: str) -> bool:
    """A case runs on a template that mentions every word it needs (tools, tool_calls, enable_thinking ...)."""
    return all(word in source for word in case.get("needs", []))


def render(source: str, case: dict, inputs: dict) -> dict:
    clock = datetime.fromisoformat(inputs["clock"])
    compiled = _compile_jinja_template(source)
    compiled.globals["strftime_now"] = clock.strftime
    extra = dict(case.get("extra", {}))
    if "tools" in case:
        extra["tools"] = inputs["tools"][case["tools"]]
    try:
        rendered, _ = render_jinja_template(conversations=[inputs["conversations"][case["messages"]]],
                                            chat_template=source,
                                            add_generation_prompt=case["add_generation_prompt"],
                                            **inputs["special_tokens"], **extra)
    except Exception as exc:  # noqa: BLE001 - a refused conversation is an expected outcome
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"text": rendered[0]}


def main() -> None:
    inputs = json.loads((DATA / "cases.json").read_text())
    expected: dict[str, dict[str, dict]] = {}
    for path in sorted(DATA.glob("*.jinja")):
        source = path.read_text(encoding="utf-8")
        expected[path.name] = {name: render(source, case, inputs)
                               for name, case in inputs["cases"].items() if applicable(case, source)}
    out = {"transformers": transformers_version, "templates": expected}
    (DATA / "expected.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    n = sum(len(v) for v in expected.values())
    errors = sum("error" in r for v in expected.values() for r in v.values())
    print(f"{len(expected)} templates, {n} renders ({errors} refused)", file=sys.stderr)


if __name__ == "__main__":
    main()
