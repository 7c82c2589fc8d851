"""Installing the example plugin packages of ``examples/`` the way a user would."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def install_example_package(name: str, tmp_path_factory) -> Path:
    """pip-install ``examples/<name>`` (no dependencies: llmfw comes from this checkout) into a fresh folder
    and return it; with that folder on the path, importlib.metadata finds the package's entry points exactly
    as after a real ``pip install``. Built from a copy, since setuptools writes build/ and *.egg-info next to
    the sources."""
    package = ROOT / "examples" / name
    target = tmp_path_factory.mktemp(f"{name}-site")
    source = shutil.copytree(package, tmp_path_factory.mktemp(f"{name}-src") / name,
                             ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--disable-pip-version-check", "--target", str(target), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=target)
    assert result.returncode == 0, result.stderr
    return target
