"""The plugin system: registries, built-ins, entry points, broken plugins, allow/block lists, strict mode."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llmfw.core.errors import PluginError, UnknownArchitecture, UnknownPluginName
from llmfw.core.plugins import KINDS, PluginManager, Registry, resolve_ref

ROOT = Path(__file__).resolve().parents[2]


def make_plugin_dist(site: Path, dist: str, module: str, body: str, ep_name: str | None = None) -> None:
    """A real installed distribution (dist-info + entry point) on a folder that goes on sys.path."""
    (site / f"{module}.py").write_text(textwrap.dedent(body))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[llmfw]\n{ep_name or dist} = {module}\n")


def run_llmfw(args: list[str], site: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("LLMFW_")}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site) if site else "", str(ROOT)) if p)
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "llmfw.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


GOOD_PLUGIN = """
    from llmfw.core.plugins import hookimpl

    @hookimpl
    def register_samplers(register):
        register("shout", "json:dumps")
"""


def test_builtins_are_registered_without_importing_heavy_modules():
    code = ("import sys; from llmfw.core.plugins import get_plugin_manager as g; m = g(); "
            "assert 'llama' in m.registry('architectures'); assert 'torch' in m.registry('backends'); "
            "print('torch' in sys.modules, 'onnxruntime' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_help_imports_neither_torch_nor_onnxruntime():
    code = ("import sys\nfrom llmfw.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('MODS', 'torch' in sys.modules, 'onnxruntime' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "run" in out.stdout and "MODS False False" in out.stdout


def test_registry_duplicate_override_and_unknown():
    reg = Registry("samplers")
    reg.register("a", "json:dumps", source="one")
    with pytest.raises(PluginError, match="already registered by one"):
        reg.register("a", "json:loads", source="two")
    reg.register("a", "json:loads", override=True, source="two")
    assert reg.get("a") is json.loads and reg.entry("a").source == "two"
    with pytest.raises(UnknownPluginName, match="known: a"):
        reg.get("b")
    with pytest.raises(PluginError, match="module:Attribute"):
        reg.register("c", "no_colon")


def test_unknown_architecture_lists_known_ones():
    manager = PluginManager(load_external=False)
    with pytest.raises(UnknownArchitecture, match="llama"):
        manager.get("architectures", "no-such-arch")


def test_resolve_ref_reports_import_failures():
    with pytest.raises(PluginError, match="cannot import"):
        resolve_ref("llmfw_no_such_module:X")
    with pytest.raises(PluginError, match="has no attribute"):
        resolve_ref("json:no_such_function")


def test_listing_covers_every_kind():
    listing = PluginManager(load_external=False).listing()
    assert set(listing) == set(KINDS)
    assert all(e["source"] == "llmfw (built-in)" for entries in listing.values() for e in entries)


def test_entry_point_plugin_is_listed_with_its_distribution(tmp_path):
    make_plugin_dist(tmp_path, "llmfw-shout", "llmfw_shout", GOOD_PLUGIN)
    out = run_llmfw(["plugins", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    samplers = {e["name"]: e for e in json.loads(out.stdout)["plugins"]["samplers"]}
    assert samplers["shout"]["source"] == "llmfw-shout 0.1"


def test_plugins_lists_what_each_backend_declares():
    out = run_llmfw(["plugins", "--json"])
    assert out.returncode == 0, out.stderr
    backends = {e["name"]: e["declaration"] for e in json.loads(out.stdout)["plugins"]["backends"]}
    assert backends["onnx"]["default_priority"] == {"cpu": 200} and backends["onnx"]["is_host"] is False
    assert backends["numpy"]["is_host"] is True and backends["ggml"]["default_priority"] == {}
    assert backends["ggml"]["options"]["f16_gelu"] == "True" and "spin" in backends["onnx"]["options"]
    text = run_llmfw(["plugins"]).stdout
    assert "default priority: cpu 200" in text and "never default" in text


def test_allow_and_block_lists(tmp_path):
    make_plugin_dist(tmp_path, "llmfw-shout", "llmfw_shout", GOOD_PLUGIN)
    for env in ({"LLMFW_LOAD_PLUGINS": ""}, {"LLMFW_LOAD_PLUGINS": "other"}, {"LLMFW_DISABLE_PLUGINS": "llmfw-shout"}):
        out = run_llmfw(["plugins", "--json"], tmp_path, **env)
        names = [e["name"] for e in json.loads(out.stdout)["plugins"]["samplers"]]
        assert "shout" not in names, env
    out = run_llmfw(["plugins", "--json"], tmp_path, LLMFW_LOAD_PLUGINS="llmfw-shout")
    assert "shout" in [e["name"] for e in json.loads(out.stdout)["plugins"]["samplers"]]


@pytest.mark.parametrize("body, reason", [
    ("raise ImportError('needs libfoo')\n", "needs libfoo"),
    ("from llmfw.core.plugins import hookimpl\n@hookimpl\ndef register_architecure(register):\n    pass\n",
     "register_architecure"),
    ("from llmfw.core.plugins import hookimpl\n@hookimpl\ndef register_backends(register):\n"
     "    register('numpy', 'json:dumps')\n", "already registered"),
])
def test_broken_plugin_is_reported_and_skipped_or_raised_in_strict_mode(tmp_path, body, reason):
    make_plugin_dist(tmp_path, "llmfw-broken", "llmfw_broken", body)
    make_plugin_dist(tmp_path, "llmfw-shout", "llmfw_shout", GOOD_PLUGIN)
    out = run_llmfw(["plugins", "--json"], tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [f["name"] for f in data["failures"]] == ["llmfw-broken"]
    assert reason in data["failures"][0]["reason"]
    assert "shout" in [e["name"] for e in data["plugins"]["samplers"]]  # the good one still loads
    numpy_entry = [e for e in data["plugins"]["backends"] if e["name"] == "numpy"][0]
    assert numpy_entry["source"] == "llmfw (built-in)"
    strict = run_llmfw(["plugins"], tmp_path, LLMFW_STRICT_PLUGINS="1")
    assert strict.returncode == 1
    assert "llmfw: error:" in strict.stderr and reason in strict.stderr
    assert "Traceback" not in strict.stderr


def test_plugin_may_override_a_builtin(tmp_path):
    body = ("from llmfw.core.plugins import hookimpl\n@hookimpl\ndef register_backends(register):\n"
            "    register('numpy', 'json:dumps', override=True)\n")
    make_plugin_dist(tmp_path, "llmfw-fastnp", "llmfw_fastnp", body)
    data = json.loads(run_llmfw(["plugins", "--json"], tmp_path).stdout)
    numpy_entry = [e for e in data["plugins"]["backends"] if e["name"] == "numpy"][0]
    assert numpy_entry["source"] == "llmfw-fastnp 0.1" and numpy_entry["ref"] == "json:dumps"


def test_plugin_commands_are_added(tmp_path):
    body = """
        import click
        from llmfw.core.plugins import hookimpl

        @hookimpl
        def register_commands(cli):
            @cli.command("hello")
            def hello():
                click.echo("hello from a plugin")
    """
    make_plugin_dist(tmp_path, "llmfw-hello", "llmfw_hello", body)
    out = run_llmfw(["hello"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hello from a plugin"
