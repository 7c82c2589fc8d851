"""The model catalog: names resolve to cached real files; unknown names and bad downloads are clear errors."""
from __future__ import annotations

import hashlib

import pytest
from click.testing import CliRunner

from llmfw.cli import cli
from llmfw.core import catalog
from llmfw.core.errors import CatalogError


def test_catalog_models_resolve_to_verified_files(smollm2_path, gemma3_path):
    for name, path in (("smollm2", smollm2_path), ("gemma-3-270m", gemma3_path)):
        model = catalog.lookup(name)
        assert path == catalog.cached_path(model) and path.stat().st_size == model.size
    digest = hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    assert digest == catalog.CATALOG["smollm2"].sha256


def test_aliases_and_paths(smollm2_path):
    assert catalog.resolve_model("SmolLM2-135M") == smollm2_path
    assert catalog.resolve_model(str(smollm2_path)) == smollm2_path
    assert catalog.resolve_model(None) == smollm2_path  # the default model


@pytest.mark.fast
def test_unknown_name_lists_catalog():
    with pytest.raises(CatalogError, match="smollm2"):
        catalog.resolve_model("no-such-model")
    with pytest.raises(CatalogError, match="gemma-3-270m"):
        catalog.pull("no-such-model")


@pytest.mark.fast
def test_missing_cache_without_pull_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFW_MODELS_DIR", str(tmp_path))
    with pytest.raises(CatalogError, match="llmfw pull smollm2"):
        catalog.resolve_model("smollm2", pull_missing=False)


def test_models_command_lists_cache(smollm2_path):
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 0
    line = [row for row in result.output.splitlines() if row.startswith("smollm2")][0]
    assert "cached" in line


def test_pull_of_cached_model_prints_path(smollm2_path):
    result = CliRunner().invoke(cli, ["pull", "smollm2"])
    assert result.exit_code == 0 and result.output.strip() == str(smollm2_path)
