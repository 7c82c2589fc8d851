"""What a new user met first and was surprised by (issue 31, item 6), each checked in-process with click's
CliRunner on a tiny random-weight model that needs no download: a 259-byte SentencePiece vocabulary (byte
fallback) over a 2-layer llama, with or without a chat template."""
from __future__ import annotations

import json

import pytest

from support.tiny_cli import PIECES, invoke, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))




# -- every command takes -m MODEL ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "chat", "serve", "perplexity", "embed", "tokenize", "inspect", "bench"])
def test_every_command_takes_the_model_as_dash_m(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert "-m, --model MODEL" in result.output


def test_tokenize_takes_dash_m_and_keeps_the_model_text_form(tiny):
    with_option = invoke("tokenize", "-m", tiny, "hello world", "--ids")
    positional = invoke("tokenize", tiny, "hello world", "--ids")
    assert with_option.exit_code == 0 and positional.exit_code == 0, with_option.output + positional.output
    import llmfw

    expected = llmfw.load_model(tiny, vocab_only=True).vocab.tokenize("hello world", add_special=True)
    assert json.loads(with_option.output) == json.loads(positional.output) == expected


def test_a_model_given_twice_is_a_usage_error(tiny):
    result = invoke("tokenize", tiny, "hello", "-m", tiny)
    assert result.exit_code == 2
    assert "given twice" in result.output


@pytest.mark.parametrize("first", ["smollm2", "model-path"])
def test_embed_refuses_a_model_as_its_first_text(tiny, first):
    """``llmfw embed smollm2 hello`` used to embed the word "smollm2"; now it says how to name the model."""
    first = tiny if first == "model-path" else first
    result = invoke("embed", first, "hello")
    assert result.exit_code == 2
    assert f"llmfw embed -m {first} 'hello'" in result.output


def test_embed_with_dash_m_embeds_every_text(tiny):
    result = invoke("embed", "-m", tiny, "--backend", "numpy", "--pooling", "mean", "--no-progress", "hello", "world")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)["data"]
    assert [item["index"] for item in data] == [0, 1]
    assert all(len(item["embedding"]) == 32 for item in data)


def test_inspect_and_bench_take_dash_m(tiny):
    assert invoke("inspect", "-m", tiny, "--json").output == invoke("inspect", tiny, "--json").output
    result = invoke("bench", "-m", tiny, "-p", "0", "-n", "2", "-r", "1", "--backend", "numpy", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["params"]["model"] == tiny and "tg2" in report["llmfw"][0]["tests"]


# -- tokenize shows whitespace pieces escaped ------------------------------------------------------------------
def test_tokenize_shows_newlines_tabs_and_control_pieces_escaped(tiny):
    """A newline piece used to break its ``id -> '...'`` line in two; every piece now stays on its line."""
    result = invoke("tokenize", "-m", tiny, "a\\b\n\tc\x01", "--no-special")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split(" -> ")[1] for line in lines[:-1]] == \
        ["' '", "'a'", "'\\\\'", "'b'", "'\\n'", "'\\t'", "'c'", "'\\x01'"]
    assert lines[-1] == "8 tokens"
    pieces = invoke("tokenize", "-m", tiny, "\n\t", "--no-special", "--pieces")  # JSON keeps its own escaping
    assert [json.loads(line) for line in pieces.output.splitlines()] == [" ", "\n", "\t"]


def test_tokenize_shows_a_partial_utf8_character_as_bytes(tiny):
    result = invoke("tokenize", "-m", tiny, "é", "--no-special")  # two byte-fallback tokens, each half a character
    assert [line.split(" -> ")[1] for line in result.output.splitlines()[:-1]] == ["' '", "'\\xc3'", "'\\xa9'"]


# -- inspect a file whose tensor data is cut short -------------------------------------------------------------
def _cut_copy(tiny: str, tmp_path, keep: int) -> str:
    data = open(tiny, "rb").read()
    cut = tmp_path / f"cut-{keep}.gguf"
    cut.write_bytes(data[:keep])
    return str(cut)


def test_inspect_shows_a_file_whose_tensor_data_is_cut(tiny, tmp_path):
    from llmfw.core.gguf import open_gguf

    with open_gguf(tiny) as whole:
        data_offset, n_tensors = whole.data_offset, len(whole.tensors)
        last = max(whole.tensors.values(), key=lambda t: t.offset)
    cut = _cut_copy(tiny, tmp_path, last.offset + 8)  # every tensor whole but the last
    result = invoke("inspect", "-m", cut)
    assert result.exit_code == 0, result.output
    assert f"the data of 1 of {n_tensors} tensors lies past the end of the file" in result.output
    assert "architecture:    llama" in result.output
    report = json.loads(invoke("inspect", cut, "--json").output)
    assert report["cut_tensors"] == [last.name] and report["tensor_count"] == n_tensors
    assert json.loads(invoke("inspect", tiny, "--json").output)["cut_tensors"] == []
    header_only = _cut_copy(tiny, tmp_path, data_offset)  # no tensor data at all
    assert len(json.loads(invoke("inspect", header_only, "--json").output)["cut_tensors"]) == n_tensors


def test_a_cut_file_still_does_not_load_and_its_cut_tensors_do_not_read(tiny, tmp_path):
    import llmfw
    from llmfw.core.errors import GGUFError
    from llmfw.core.gguf import open_gguf

    with open_gguf(tiny) as whole:
        last = max(whole.tensors.values(), key=lambda t: t.offset)
    cut = _cut_copy(tiny, tmp_path, last.offset + 8)
    with pytest.raises(GGUFError, match="lies outside the file"):
        llmfw.load_model(cut, backend="numpy")
    with open_gguf(cut, allow_cut_data=True) as g:
        assert g.cut_tensors == [last.name]
        with pytest.raises(GGUFError, match="past the end of the file"):
            g.tensor_bytes(last.name)
        first = min(g.tensors.values(), key=lambda t: t.offset)
        assert g.tensor_bytes(first.name).nbytes == first.nbytes


def test_inspect_of_a_file_cut_inside_its_metadata_stays_an_error(tiny, tmp_path):
    """(The console script turns the error into one ``llmfw: error:`` line: tests/cli/test_inspect.py.)"""
    from llmfw.core.errors import GGUFError

    result = invoke("inspect", "-m", _cut_copy(tiny, tmp_path, 300))
    assert result.exit_code == 1
    assert isinstance(result.exception, GGUFError) and "bytes follow the header" in str(result.exception)


# -- options for a sampler outside the chain are a configuration error -----------------------------------------
def test_yaml_options_for_a_sampler_not_in_the_chain_are_an_error(tmp_path):
    import llmfw
    from llmfw.core.errors import ConfigError

    path = tmp_path / "p.yaml"
    path.write_text("sampling:\n  samplers: [top_k, temperature]\n  options: {top_p: {p: 0.5}}\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: sampling\.options: options for 'top_p', which the sampler "
                                          r"chain does not hold \(samplers: top_k, temperature\)"):
        llmfw.load_pipeline(path)
    path.write_text("sampling:\n  samplers: [top_k, top_p]\n  options: {top_p: {min_keep: 2}, dist: {seed: 3}}\n")
    assert llmfw.load_pipeline(path).config.sampling.options["top_p"] == {"min_keep": 2}  # in the chain, or added by it


def test_sampler_options_outside_the_chain_fail_in_python_too():
    from llmfw.core.errors import SamplerError
    from llmfw.core.sampling import SamplerParams

    with pytest.raises(SamplerError, match="options for 'xtc'"):
        SamplerParams(samplers=["top_k"], options={"xtc": {"probability": 0.5}})
    assert SamplerParams(samplers=["temp"], options={"temperature": {}}).options == {"temperature": {}}  # an alias


# -- an unknown architecture points to the plugin docs ---------------------------------------------------------
def test_unknown_architecture_points_to_the_plugin_docs(tmp_path):
    """The error a user meets running a family llmfw does not know says where adding one is described."""
    from pathlib import Path

    from llmfw.core.architecture import PLUGIN_DOCS
    from llmfw.core.errors import UnknownArchitecture

    path = write_tiny_model(tmp_path / "mystery.gguf", architecture="mystery")
    result = invoke("run", "-m", str(path), "--backend", "numpy", "--no-progress", "hello")
    assert result.exit_code == 1 and isinstance(result.exception, UnknownArchitecture)
    message = str(result.exception)
    assert "'mystery'" in message and "llama" in message  # still names the known ones
    assert PLUGIN_DOCS in message
    page, anchor = PLUGIN_DOCS.split("#")
    docs = Path(__file__).resolve().parents[2] / page
    assert f"## {anchor.replace('-', ' ').capitalize()}" in docs.read_text()  # the page and its section exist


# -- -v prints the seed actually used --------------------------------------------------------------------------
def _run(tiny: str, *flags: str):
    result = invoke("run", "-m", tiny, "--backend", "numpy", "--no-progress", "-n", "12", *flags, "hello")
    assert result.exit_code == 0, result.output
    return result.output


def _seed_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("seed: "))


def test_verbose_prints_the_random_seed_it_drew_and_that_seed_repeats_the_run(tiny):
    first = _run(tiny, "-v", "--temp", "2.0")
    line = _seed_line(first)
    seed = line.split()[1]
    assert line == f"seed: {seed} (drawn at random; --seed {seed} repeats it)"
    again = _run(tiny, "--temp", "2.0", "--seed", seed)

    def text(output: str) -> str:  # the generated text: stdout's line before the timing line
        return output.splitlines()[-2]

    assert text(again) == text(first)


def test_verbose_prints_a_given_seed_and_says_when_none_is_used(tiny):
    assert _seed_line(_run(tiny, "-v", "--temp", "1.0", "-s", "7")) == "seed: 7"
    assert _seed_line(_run(tiny, "-v")) == "seed: not used (greedy)"


# -- chat on a model without a chat template warns and suggests run --------------------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat(model: str):
    result = invoke("chat", "-m", model, "--backend", "numpy", "--no-progress", "-n", "4", input="hello\n/exit\n")
    assert result.exit_code == 0, result.output
    return result.output


def test_chat_without_a_chat_template_warns_and_suggests_run(tiny):
    output = _chat(tiny)
    assert "warning: tiny.gguf has no chat template" in output
    assert f'llmfw run -m {tiny} "TEXT"' in output


def test_chat_with_a_chat_template_does_not_warn(tmp_path, tiny):
    with_template = str(write_tiny_model(tmp_path / "templated.gguf", chat_template=CHATML))
    assert "no chat template" not in _chat(with_template)
    config = tmp_path / "chat.yaml"  # a template given in the pipeline counts too
    config.write_text(f"model: {tiny}\nchat: {{template: {json.dumps(CHATML)}}}\n")
    result = invoke("chat", "--config", str(config), "--backend", "numpy", "--no-progress", "-n", "4",
                    input="hello\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "no chat template" not in result.output


# -- llmfw models shows the converted-weight caches and --prune removes them -----------------------------------
def test_models_lists_the_converted_weight_cache_and_prune_removes_it(tmp_path, monkeypatch):
    import llmfw

    monkeypatch.setenv("LLMFW_MODELS_DIR", str(tmp_path))
    monkeypatch.delenv("LLMFW_ONNX_CACHE_DIR", raising=False)
    monkeypatch.delenv("LLMFW_NATIVE_CACHE_DIR", raising=False)
    # a file over the onnx cache's 8 MiB threshold, its FFN quantized so that the backend converts it
    path = write_tiny_model(tmp_path / "big.gguf", n_ff=45056, quantized_ffn=True)
    with llmfw.load_model(path, backend="onnx") as model:
        assert model.n_vocab == 3 + 256 + len(PIECES)
        host = model.host_backend.name  # the token embedding's backend: native where it is built, with its own cache
    entries = [p for p in (tmp_path / ".onnx").iterdir() if p.is_dir()]
    assert len(entries) == 1
    size = sum(f.stat().st_size for f in entries[0].rglob("*") if f.is_file())
    assert size > 4_000_000  # the converted FFN matrices
    host_entries = [p for p in (tmp_path / ".native").iterdir() if p.is_dir()] if host == "native" else []
    total = size + sum(f.stat().st_size for e in host_entries for f in e.rglob("*") if f.is_file())
    count = 1 + len(host_entries)
    noun = "entry" if count == 1 else "entries"

    listed = invoke("models")
    assert listed.exit_code == 0, listed.output
    assert f"converted weights (onnx): {tmp_path / '.onnx'}" in listed.output
    lines = listed.output.splitlines()  # each backend's entries under its own heading (their names may coincide)
    onnx_at = lines.index(f"converted weights (onnx): {tmp_path / '.onnx'}")
    row = next(line for line in lines[onnx_at + 1:] if entries[0].name in line)
    assert row.split()[-2:] == [f"{size / 1e6:.1f}", "MB"]
    assert f"{count} converted-weight {noun}" in listed.output and "--prune" in listed.output

    pruned = invoke("models", "--prune")
    assert pruned.exit_code == 0, pruned.output
    assert pruned.output.strip() == f"removed {count} converted-weight {noun}, {total / 1e6:.1f} MB"
    assert not entries[0].exists() and path.exists()  # the model file stays
    assert f"converted weights (onnx): {tmp_path / '.onnx'} (empty)" in invoke("models").output


def test_chat_verbose_prints_one_seed_that_repeats_the_conversation(tiny):
    def chat(*flags: str):
        result = invoke("chat", "-m", tiny, "--backend", "numpy", "--no-progress", "-n", "8", "--temp", "2.0", *flags,
                        input="hello\n/exit\n")
        assert result.exit_code == 0, result.output
        return result.output

    first = chat("-v")
    seed = _seed_line(first).split()[1]
    assert _seed_line(first) == f"seed: {seed} (drawn at random; --seed {seed} repeats it)"
    again = chat("--seed", seed)
    answer = [line for line in first.splitlines() if line.startswith("> ")]
    assert answer and answer == [line for line in again.splitlines() if line.startswith("> ")]
