"""The import contract: llmfw's layers import one way, no module takes part in an import cycle, the core never names
a plugin.

Every import statement counts — top level, inside a function, under ``TYPE_CHECKING`` — because each is a
dependency a reader (and a refactoring) has to follow, whether or not Python executes it at import time. A
``from pkg import name`` depends on ``pkg`` itself (its ``__init__``) and, when ``name`` is a submodule, on that
module too, so a package ``__init__`` that imports its submodules which import it back is a cycle.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmfw"

#: layer prefix -> rank, lowest first. A module may import its own layer or a lower-ranked one. Two layers with
#: the same rank are siblings and may not import each other.
LAYERS: Mapping[str, int] = {
    "llmfw.core.errors": 0,
    "llmfw.core.validation": 0,
    "llmfw.core.plugins": 1,
    "llmfw.core.format": 2,
    "llmfw.core.tokenizer": 3,
    "llmfw.core.ir": 3,
    "llmfw.core.arch": 4,
    "llmfw.core.exec": 5,
    "llmfw.core.runtime": 6,
    "llmfw.core.generation": 7,
    "llmfw.sdk": 8,
    "llmfw.plugins": 9,
    "llmfw.app": 10,
    "llmfw.serving": 11,
    "llmfw.commands": 12,
    "llmfw.cli": 13,
}
#: modules outside the layering: the package roots (they re-export lazily, by name strings) and the alias finder
UNLAYERED = {"llmfw", "llmfw.core", "llmfw.core._aliases"}
CORE = "llmfw.core"
PLUGINS = "llmfw.plugins"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imported_names(module: str, path: Path, known: Mapping[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported llmfw module, line) for every import statement of ``path``, wherever in the file it stands."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            source = (_resolve_relative(module, is_package, node.level, node.module) if node.level
                      else node.module or "")
            yield source, node.lineno
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    yield f"{source}.{alias.name}", node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported llmfw module: first line}, every edge inside the package."""
    known = all_modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        for target, line in imported_names(module, path, known):
            if target in known and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def layer_of(module: str) -> str | None:
    if module in UNLAYERED:
        return None
    matches = [prefix for prefix in LAYERS if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches, key=len)


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_is_in_a_layer() -> None:
    for module in all_modules():
        layer_of(module)


def test_no_upward_or_sideways_import() -> None:
    graph = import_graph()
    paths = all_modules()
    wrong = []
    for module, edges in graph.items():
        layer = layer_of(module)
        if layer is None:
            continue
        for target, line in edges.items():
            target_layer = layer_of(target)
            if target_layer is None or target_layer == layer:
                continue
            if LAYERS[target_layer] >= LAYERS[layer]:
                wrong.append(f"{paths[module].relative_to(ROOT)}:{line}: {layer} imports {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, f"{len(found)} import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_core_names_no_plugin() -> None:
    """Neither an import nor a ``"llmfw.plugins.x"`` / ``"llmfw.plugins.x:Name"`` string: the core finds plugins
    through hooks (the built-ins through the list ``llmfw.plugins`` holds, like an entry point)."""
    paths = all_modules()
    plugin_ref = re.compile(rf"{re.escape(PLUGINS)}\.[A-Za-z_][\w.]*(:\w+)?")
    wrong = []
    for module, edges in import_graph().items():
        if not module.startswith(CORE + "."):
            continue
        wrong += [f"{module} imports {target}" for target in edges if target.startswith(PLUGINS)]
        tree = ast.parse(paths[module].read_text(encoding="utf-8"))
        wrong += [f"{module}:{node.lineno} names {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and plugin_ref.fullmatch(node.value)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The graph counts function-local, TYPE_CHECKING and relative imports, and a package importing itself back."""
    module = "llmfw.core.ir.graph"
    known = {module: PACKAGE / "core/ir/graph.py", "llmfw.core.ir": PACKAGE / "core/ir/__init__.py",
             "llmfw.core.ir.hparams": PACKAGE / "core/ir/hparams.py", "llmfw.core.exec": PACKAGE / "core/exec"}
    source = tmp_path / "graph.py"
    source.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from .hparams import HParams\n"
                      "def f():\n    from llmfw.core import exec\n"
                      "from . import x\n", encoding="utf-8")
    names = {name for name, _ in imported_names(module, source, known)}
    assert {"llmfw.core.ir.hparams", "llmfw.core", "llmfw.core.exec", "llmfw.core.ir"} <= names
    assert cycles({"a": {"b": 1}, "b": {"a": 1}, "c": {"a": 1}}) == [["a", "b"]]
