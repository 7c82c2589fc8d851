"""YAML pipelines: schema errors that point at the key, and every example file running for real."""
from __future__ import annotations

from pathlib import Path

import pytest

from llmfw.core.errors import ConfigError
from llmfw.core.pipeline import Pipeline, load_pipeline, merge_overrides, parse_yaml

ROOT = Path(__file__).resolve().parents[2]
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
    ("sampling:\n  top_p: 1.5\n", r"sampling\.top_p: must be <= 1\.0 \(got 1\.5\)"),
    ("sampling:\n  top_k: -2\n", r"sampling\.top_k: must be >= 0"),
    ("sampling:\n  samplers: [top_k, top_z]\n", r"sampling\.samplers: unknown sampler 'top_z'; known: .*top_p"),
    ("sampling:\n  tempp: 0.5\n", r"sampling\.tempp: unknown key, did you mean `temp`\?"),
    ("context:\n  n_ctx: lots\n", r"context\.n_ctx: must be an integer \(got 'lots'\)"),
    ("generation:\n  max_tokens: -3\n", r"generation\.max_tokens"),
    ("chat:\n  enabled: true\n  sytem: hi\n", r"chat\.sytem: unknown key, did you mean `system`\?"),
    ("modle: smollm2\n", r"modle: unknown key, did you mean `model`\?"),
    ("", r"the pipeline file is empty"),
    ("# only a comment\n", r"the pipeline file is empty"),
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


def test_empty_mapping_is_defaults_but_an_empty_file_is_an_error():
    assert Pipeline.from_dict({}).config.model == "smollm2"
    with pytest.raises(ConfigError, match="empty"):
        parse_yaml("", "p.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_runs(path):
    pipeline = load_pipeline(path, {"generation.max_tokens": 3, "context.n_ctx": 256})
    from llmfw.core.generate import GenerationStats

    stats = GenerationStats()
    text = "".join(pipeline.run("Hello", stats=stats))
    assert stats.n_generated >= 1 and stats.stop_reason in ("max_tokens", "eog", "stop")
    if stats.stop_reason != "stop":  # the text is the sampled tokens' pieces (the end-of-generation token prints nothing)
        vocab = pipeline.load_model().vocab
        special = pipeline.config.tokenizer.special
        pieces = b"".join(vocab.token_to_piece(t, special=special) for t in stats.tokens if not vocab.is_eog(t))
        assert text == pieces.decode("utf-8", errors="replace")


def test_every_problem_in_one_message_with_key_paths(tmp_path):
    path = write(tmp_path, "sampling: {top_pp: 0.5, temp: hot, top_p: 1.5}\ncontext: {n_ctxx: 5}\n"
                           "generation: {max_tokens: -5}\n")
    with pytest.raises(ConfigError) as info:
        load_pipeline(path)
    message = str(info.value)
    assert message.startswith(f"{path}: 5 problems: ")
    for part in ("sampling.top_pp: unknown key, did you mean `top_p`?", "sampling.temp: must be a number",
                 "sampling.top_p: must be <= 1.0 (got 1.5)", "context.n_ctxx: unknown key, did you mean `n_ctx`?",
                 "generation.max_tokens: must be >= 0, -1 (until end of generation) or -2"):
        assert part in message
    assert "Extra inputs" not in message and "Input should" not in message  # no pydantic wording


def test_sampling_keys_mirror_the_flags_and_old_spellings_are_aliases(tmp_path):
    new = load_pipeline(write(tmp_path, "sampling: {repeat_penalty: 1.3, repeat_last_n: 32, presence_penalty: 0.2,"
                                        " frequency_penalty: 0.1, mirostat_lr: 0.2, mirostat_ent: 4, typical: 0.9}\n"))
    old = load_pipeline(write(tmp_path, "sampling: {penalty_repeat: 1.3, penalty_last_n: 32, penalty_present: 0.2,"
                                        " penalty_freq: 0.1, mirostat_eta: 0.2, mirostat_tau: 4, typical_p: 0.9}\n",
                              "old.yaml"))
    assert new.config.sampling == old.config.sampling
    s = new.config.sampling
    assert (s.penalty_repeat, s.penalty_last_n, s.typical_p, s.mirostat_eta) == (1.3, 32, 0.9, 0.2)
    # errors use the flag-style name, whichever spelling the file used; a flag overrides either spelling
    with pytest.raises(ConfigError, match=r"sampling\.repeat_penalty: must be > 0"):
        load_pipeline(write(tmp_path, "sampling: {penalty_repeat: 0}\n", "bad.yaml"))
    with pytest.raises(ConfigError, match=r"sampling\.repeat_penalty: given twice"):
        load_pipeline(write(tmp_path, "sampling: {penalty_repeat: 1.1, repeat_penalty: 1.2}\n", "twice.yaml"))
    overridden = load_pipeline(tmp_path / "p.yaml", {"sampling.penalty_repeat": 1.7})
    assert overridden.config.sampling.penalty_repeat == 1.7
    with pytest.raises(ConfigError, match=r"sampling\.repeat_pnealty: unknown key, did you mean `repeat_penalty`"):
        load_pipeline(write(tmp_path, "sampling: {repeat_pnealty: 1.1}\n", "typo.yaml"))


def test_generation_limits_follow_llama_cpp(tmp_path):
    for value in (-1, -2):
        assert load_pipeline(write(tmp_path, f"generation: {{max_tokens: {value}}}\n")).config.generation.max_tokens \
            is None
    assert load_pipeline(write(tmp_path, "generation: {max_tokens: 0}\n")).config.generation.max_tokens == 0


def test_a_missing_model_names_the_yaml_file(tmp_path):
    path = write(tmp_path, "model: no-such-model.gguf\n")
    with pytest.raises(ConfigError, match=rf"^{path}: model: 'no-such-model.gguf' is neither a file"):
        load_pipeline(path).model_location()
    # the same name from a flag is not the file's fault
    flagged = Pipeline.from_dict({"model": "no-such-model.gguf"}, path, overridden=frozenset({"model"}))
    with pytest.raises(ConfigError, match=r"^model: 'no-such-model.gguf'"):
        flagged.model_location()


def test_a_backend_the_file_names_wrongly_names_the_file(tmp_path, smollm2_path):
    from llmfw.core.errors import UnknownBackend

    path = write(tmp_path, f"model: {smollm2_path}\nbackend: numpyy\n")
    with pytest.raises(UnknownBackend, match=rf"^{path}: backend: unknown backend 'numpyy'; known: .*numpy"):
        load_pipeline(path).load_model()
