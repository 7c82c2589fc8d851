"""YAML pipelines: schema errors that point at the key, and every example file running for real."""
from __future__ import annotations

from pathlib import Path

import pytest

from llmfw.core.errors import ConfigError
from llmfw.core.pipeline import Pipeline, load_pipeline, merge_overrides, parse_yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_examples_exist_and_validate():
    assert {p.name for p in EXAMPLES} >= {"smollm2-greedy.yaml", "smollm2-chat.yaml", "gemma3-creative.yaml"}
    for path in EXAMPLES:
        pipeline = load_pipeline(path)
        assert pipeline.config.model


def test_defaults_are_llamas_and_sections_parse(tmp_path):
    p = load_pipeline(write(tmp_path, "model: smollm2\nsampling: {top_k: 5, samplers: [top_k, temp]}\n"))
    assert p.config.sampling.top_k == 5 and p.config.sampling.top_p == 0.95
    assert p.config.sampling.samplers == ["top_k", "temperature"]
    assert p.config.context.n_ctx == 0 and p.config.tokenizer.parse_special is True


@pytest.mark.parametrize("text, message", [
    ("sampling:\n  top_p: 1.5\n", r"sampling\.top_p: .*less than or equal to 1 \(got 1\.5\)"),
    ("sampling:\n  top_k: -2\n", r"sampling\.top_k: must be >= 0"),
    ("sampling:\n  samplers: [top_k, top_z]\n", r"sampling\.samplers: unknown sampler 'top_z'; known: .*top_p"),
    ("sampling:\n  tempp: 0.5\n", r"sampling\.tempp: Extra inputs are not permitted"),
    ("context:\n  n_ctx: lots\n", r"context\.n_ctx: .*valid integer"),
    ("generation:\n  max_tokens: -3\n", r"generation\.max_tokens"),
    ("chat:\n  enabled: true\n  sytem: hi\n", r"chat\.sytem: Extra inputs"),
    ("modle: smollm2\n", r"modle: Extra inputs"),
    ("- a\n- b\n", r"must be a mapping"),
])
def test_errors_name_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_pipeline(path)
    assert str(path) in str(info.value)


def test_yaml_syntax_error_gives_the_line(tmp_path):
    path = write(tmp_path, "model: smollm2\nsampling:\n  temp: [0.5\n  top_k: 3\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error at line \d+, column \d+"):
        load_pipeline(path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_pipeline(tmp_path / "nope.yaml")


def test_overrides_and_relative_paths(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!", encoding="utf-8")
    path = write(tmp_path, "model: m.gguf\nchat: {template_file: t.jinja}\n")
    p = load_pipeline(path, {"sampling.temp": 0.0, "generation.stop": ["x"]})
    assert p.model_location() == str(tmp_path / "m.gguf")
    assert p.chat_template() == "{{ messages[0].content }}!"
    assert p.config.sampling.greedy and p.config.generation.stop == ["x"]
    assert merge_overrides({"a": {"b": 1}}, {"a.c": 2, "d": 3}) == {"a": {"b": 1, "c": 2}, "d": 3}


def test_chat_prompt_uses_template_override(tmp_path):
    p = Pipeline.from_dict({"chat": {"enabled": True, "system": "S", "template": "{% for m in messages %}"
                                     "[{{ m.role }}:{{ m.content }}]{% endfor %}"}})
    assert p.render_prompt("hi", model=object()) == "[system:S][user:hi]"
    assert Pipeline.from_dict({}).render_prompt("hi", model=object()) == "hi"


def test_parse_yaml_empty_is_defaults():
    assert parse_yaml("") == {}
    assert Pipeline.from_dict({}).config.model == "smollm2"


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_runs(path):
    pipeline = load_pipeline(path, {"generation.max_tokens": 3, "context.n_ctx": 256})
    from llmfw.core.generate import GenerationStats

    stats = GenerationStats()
    text = "".join(pipeline.run("Hello", stats=stats))
    assert stats.n_generated >= 1 and stats.stop_reason in ("max_tokens", "eog", "stop")
    assert isinstance(text, str)
