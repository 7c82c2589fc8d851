"""``load_model(path, vocab_only=True)`` needs only the general and tokenizer keys, as llama.cpp's vocab-only
load: no architecture plugin, no hyperparameters. A full load of such a file still fails clearly."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import llmfw
from llmfw.cli import cli
from llmfw.core.errors import ModelError, UnknownArchitecture
from llmfw.core.gguf import GGUFWriter, open_gguf

TEXT = "Hello world, it's 2026!<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer_only(smollm2_path, tmp_path_factory):
    """write(arch) -> a GGUF holding SmolLM2's tokenizer keys and general.architecture = arch (None: no key)."""
    with open_gguf(smollm2_path) as source:
        keys = [(k, v, source.metadata_types[k], source.metadata_array_types.get(k))
                for k, v in source.metadata.items() if k.startswith("tokenizer.")]
    folder = tmp_path_factory.mktemp("tokenizer_only")

    def write(arch: str | None):
        path = folder / f"{arch or 'no-arch'}.gguf"
        writer = GGUFWriter(path)
        if arch is not None:
            writer.add("general.architecture", arch)
        for key, value, vtype, array_type in keys:
            writer.add(key, value, vtype, array_type=array_type)
        writer.write()
        return path

    return write


@pytest.fixture(scope="module")
def expected_ids(smollm2_path):
    return llmfw.load_model(smollm2_path, vocab_only=True).vocab.tokenize(TEXT, parse_special=True)


@pytest.mark.parametrize("arch", ["llama", "bert", "no-such-arch", None])
def test_vocab_only_needs_only_the_tokenizer_keys(tokenizer_only, expected_ids, arch):
    model = llmfw.load_model(tokenizer_only(arch), vocab_only=True)
    assert model.hparams is None and model.arch_name == (arch or "")
    assert model.vocab.tokenize(TEXT, parse_special=True) == expected_ids
    assert model.n_vocab == 49152
    with pytest.raises(ModelError, match="vocab_only=True and has no hyperparameters"):
        model.n_layer  # noqa: B018 - the attribute access is the test


def test_known_architecture_without_hyperparameters_fails_a_full_load(tokenizer_only):
    with pytest.raises(ModelError, match="missing required metadata key 'llama.context_length'|block_count"):
        llmfw.load_model(tokenizer_only("llama"), backend="numpy")


@pytest.mark.parametrize("arch", ["bert", "no-such-arch"])
def test_unknown_architecture_fails_a_full_load_by_name(tokenizer_only, arch):
    with pytest.raises(UnknownArchitecture, match=arch):
        llmfw.load_model(tokenizer_only(arch), backend="numpy")


def test_present_but_invalid_hyperparameters_still_fail_vocab_only(smollm2_path):
    with pytest.raises(ModelError, match="block_count|n_layer"):
        llmfw.load_model(smollm2_path, vocab_only=True, kv_overrides={"llama.block_count": 0})


def test_cli_tokenize_on_a_file_without_architecture_plugin(tokenizer_only, expected_ids):
    result = CliRunner().invoke(cli, ["tokenize", str(tokenizer_only("bert")), TEXT, "--ids", "--parse-special"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == expected_ids
