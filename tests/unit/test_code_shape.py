"""The shape of the code base: no module of the package over 600 lines, and test modules that share helpers
through ``tests/support/``, never by importing one another."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the most lines a module of the package may have: past it, split it along its seams (re-exporting the names)
MAX_MODULE_LINES = 600
#: the folders of test modules (a helper they share belongs in tests/support/)
TEST_FOLDERS = ("unit", "tiny", "cli", "reference")


def test_no_module_of_the_package_is_over_the_limit():
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "llmfw").rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of ``path`` names, wherever the statement stands."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_test_module_imports_another():
    """``from test_engine import ...`` ties one test file's helpers to another's collection (and its skips)."""
    tests = ROOT / "tests"
    test_modules = {path.stem for folder in TEST_FOLDERS for path in (tests / folder).glob("test_*.py")}
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        if "data" in path.relative_to(tests).parts:
            continue
        for name in imported_modules(path):
            if name.split(".")[-1] in test_modules or any(part.startswith("test_") for part in name.split(".")):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert offenders == []


def test_the_checks_see_what_they_look_for(tmp_path: Path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from reference.test_quants import F16_FIELDS\nimport test_engine\n",
                      encoding="utf-8")
    assert {"reference.test_quants", "test_engine"} <= imported_modules(source)
