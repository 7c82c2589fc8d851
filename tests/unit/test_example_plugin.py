"""The example third-party plugin (examples/llmfw-example-plugin) installed for real and found by entry point."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.plugins import install_example_package

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_DIR = ROOT / "examples" / "llmfw-example-plugin"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    """pip-install the plugin (no deps: llmfw comes from this checkout) into a folder on PYTHONPATH;
    importlib.metadata finds its .dist-info there, so the entry point is discovered."""
    target = install_example_package(PLUGIN_DIR.name, tmp_path_factory)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT)])
    env.pop("LLMFW_LOAD_PLUGINS", None)
    env.pop("LLMFW_DISABLE_PLUGINS", None)
    return env


def _python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


def test_plugins_lists_top_a_from_the_package(plugin_env):
    result = _python(plugin_env, "-m", "llmfw.cli", "plugins", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    samplers = {e["name"]: e for e in listing["plugins"]["samplers"]}
    assert "top_a" in samplers
    assert samplers["top_a"]["source"] == "llmfw-example-plugin 0.1.0"
    assert samplers["top_a"]["ref"] == "llmfw_example_plugin:TopA"
    assert samplers["top_k"]["source"] == "llmfw (built-in)"
    assert listing["failures"] == []


def test_top_a_is_usable_by_name_in_a_chain(plugin_env):
    code = """
import numpy as np
from llmfw.core.sampling import SamplerChain, SamplerParams, parse_sampler_seq
params = SamplerParams(samplers=["top_k", "top_a", "temperature"], options={"top_a": {"a": 0.9}}, seed=1)
chain = SamplerChain.from_params(params)
print(",".join(chain.names))
print(chain.samplers[1].a)
logits = np.log(np.array([0.05, 0.7, 0.25]))
print(sorted({chain.sample(logits) for _ in range(40)}))
print(parse_sampler_seq("top_k,top_a,temp"))
"""
    result = _python(plugin_env, "-c", code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "top_k,top_a,temperature,dist"
    assert lines[1] == "0.9"
    assert lines[2] == "[1]"  # 0.25 < 0.9 * 0.7**2 = 0.44: only token 1 survives top-a
    assert lines[3] == "['top_k', 'top_a', 'temperature']"


def test_block_list_hides_the_plugin(plugin_env):
    env = dict(plugin_env, LLMFW_DISABLE_PLUGINS="example_top_a")
    result = _python(env, "-m", "llmfw.cli", "plugins", "--json")
    names = {e["name"] for e in json.loads(result.stdout)["plugins"]["samplers"]}
    assert "top_a" not in names and "top_k" in names


def test_plugin_own_tests_pass(plugin_env):
    result = _python(plugin_env, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PLUGIN_DIR / "tests"))
    assert result.returncode == 0, result.stdout + result.stderr
