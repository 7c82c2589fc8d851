"""The core's modules moved into layered subpackages; their old names still import, as the very same modules.

Only the alias answers an old name (no file stays at an old path), and the package itself names the new modules.
"""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmfw.core._aliases import MOVED_MODULES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old, new", sorted(MOVED_MODULES.items()))
def test_old_name_imports_the_new_module_object(old: str, new: str) -> None:
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is sys.modules[new]
    assert module.__name__ == new
    parent, _, child = old.rpartition(".")
    assert getattr(sys.modules[parent], child) is module


def test_private_names_and_patches_reach_through_the_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmfw.core.generate import _prepare_prompt
    from llmfw.core.generation import generate

    assert _prepare_prompt is generate._prepare_prompt
    import llmfw.core.sampling as old_sampling
    from llmfw.core.generation import sampling

    monkeypatch.setattr(old_sampling, "DEFAULT_SEED", 1234)
    assert sampling.DEFAULT_SEED == 1234


def test_no_file_stays_at_an_old_path() -> None:
    for old, new in MOVED_MODULES.items():
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file(), new


def test_unknown_names_still_fail() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("llmfw.core.no_such_module")
    import llmfw.core

    with pytest.raises(AttributeError):
        llmfw.core.no_such_module  # noqa: B018 - the attribute access is the test


def test_old_name_as_attribute_of_a_fresh_core() -> None:
    """``import llmfw.core`` then ``llmfw.core.graph`` works before anything imported the old name."""
    code = ("import sys, llmfw.core\n"
            "assert 'llmfw.core.graph' not in sys.modules\n"
            "assert llmfw.core.graph is sys.modules['llmfw.core.ir.graph']\n"
            "from llmfw.core import quants\n"
            "assert quants is sys.modules['llmfw.core.format.quants']\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_module_first_imported_by_its_old_name_keeps_its_own_spec() -> None:
    """Importing an old name first must not hand the module the old name's spec: a relative import inside it
    (vocab's function-local ``from .vocab_loader import``) would then warn, and fail where warnings are errors."""
    code = ("import warnings, llmfw.core.vocab as old\n"
            "from llmfw.core.errors import LLMFWError\n"
            "assert old.__spec__.name == 'llmfw.core.tokenizer.vocab', old.__spec__.name\n"
            "warnings.simplefilter('error')\n"
            "try:\n"
            "    old.Vocab.from_metadata({})\n"
            "except LLMFWError:\n"
            "    pass\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_package_names_only_new_modules() -> None:
    """No module of llmfw imports (or names in a ``module:attr`` string) an old path."""
    old_names = "|".join(re.escape(name.rpartition(".")[2]) for name in MOVED_MODULES)
    absolute = re.compile(rf"\bllmfw\.core\.({old_names})\b")
    relative_in_core = re.compile(rf"^\s*from \.\.?({old_names}) import", re.M)
    found = []
    for path in sorted((ROOT / "llmfw").rglob("*.py")):
        if path.name == "_aliases.py":
            continue
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(ROOT)}: {match.group(0)}" for match in absolute.finditer(text)]
        if path.parent == ROOT / "llmfw" / "core":
            found += [f"{path.relative_to(ROOT)}: {match.group(0)}" for match in relative_in_core.finditer(text)]
    assert found == []


def test_loading_the_package_touches_no_old_name() -> None:
    """The built-in plugins (torch aside: slow to import) and the front ends load without the alias.

    Installed third-party plugins are left out (LLMFW_LOAD_PLUGINS empty): they may import old names."""
    code = ("import sys, llmfw, llmfw.cli, llmfw.serving.app, llmfw.commands.run\n"
            "from llmfw.core._aliases import MOVED_MODULES\n"
            "from llmfw.core.plugins import BUILTIN_SOURCE, KINDS, registry\n"
            "for kind in KINDS:\n"
            "    for entry in registry(kind).entries():\n"
            "        if entry.source == BUILTIN_SOURCE and entry.name != 'torch':\n"
            "            registry(kind).get(entry.name)\n"
            "print(sorted(set(MOVED_MODULES) & set(sys.modules)))\n")
    env = {**os.environ, "LLMFW_LOAD_PLUGINS": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def _names_llmfw(module: str) -> bool:
    return module == "llmfw" or module.startswith("llmfw.")


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every ``from X import`` / ``import X`` naming llmfw in ``path``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
        elif isinstance(node, ast.ImportFrom) and _names_llmfw(node.module or ""):
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if _names_llmfw(alias.name)]
    return found


def test_every_import_inside_the_package_names_a_real_file() -> None:
    """A relative import written against the old flat core (``from .errors import`` in a moved module) fails here,
    not at the first run that reaches it (function-local imports included). A compiled extension's module names
    its C source and typed stub (``_strings.c`` / ``_strings.pyi``)."""
    missing = []
    for path in sorted((ROOT / "llmfw").rglob("*.py")):
        for line, name in _imported_modules(path):
            where = ROOT / name.replace(".", "/")
            extension = where.with_suffix(".pyi").is_file() and where.with_suffix(".c").is_file()
            if not (where.with_suffix(".py").is_file() or (where / "__init__.py").is_file() or extension):
                missing.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert missing == []
