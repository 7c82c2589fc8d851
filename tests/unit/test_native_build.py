"""The C extensions are optional: setup.py builds them with the C compiler, an install without a working one
still succeeds, the native backend then says why it is unavailable, and GGUF files are read by Python alone."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_COMPILER = bool(shutil.which("cc") or shutil.which("gcc"))


def build_ext(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def built_extensions(tmp_path: Path, pattern: str = "_native*.so") -> list[Path]:
    return sorted((tmp_path / "lib").rglob(pattern)) if (tmp_path / "lib").exists() else []


def test_a_build_without_a_working_compiler_succeeds_without_the_extensions(tmp_path):
    result = build_ext(tmp_path, CC="/bin/false")
    assert result.returncode == 0, result.stderr
    assert "native backend's C extension was not built" in result.stderr
    assert "C string reader for GGUF files was not built" in result.stderr
    assert built_extensions(tmp_path) == [] and built_extensions(tmp_path, "_strings*.so") == []


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")
def test_a_build_with_the_compiler_makes_a_loadable_extension(tmp_path):
    result = build_ext(tmp_path)
    assert result.returncode == 0, result.stderr
    (extension,) = built_extensions(tmp_path)
    lib = ctypes.CDLL(str(extension))
    assert lib.nat_cpu_isas() & 1  # the scalar path is always there
    (strings,) = built_extensions(tmp_path, "_strings*.so")
    probe = "from llmfw.core.format import _strings; print(_strings.decode_strings(b'\\1' + bytes(7) + b'x', 0, 9, [''], 0, 9))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path / "lib")}, cwd=tmp_path)
    assert loaded.stdout.strip() == "(1, 9)", loaded.stderr


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine")
def test_the_scalar_only_build_of_other_architectures_runs_only_the_scalar_path(tmp_path):
    """What setup.py builds on aarch64 (LLMFW_NATIVE_SCALAR_ONLY), compiled here: the x86 kernels are left out."""
    result = build_ext(tmp_path, CFLAGS="-DLLMFW_NATIVE_SCALAR_ONLY")
    assert result.returncode == 0, result.stderr
    (extension,) = built_extensions(tmp_path)
    lib = ctypes.CDLL(str(extension))
    assert lib.nat_cpu_isas() == 1
    assert not hasattr(lib, "nat_qgemm_avx2")


def test_without_the_extension_the_backend_is_unavailable_with_the_reason(tmp_path):
    """A copy of the package without the built extension (what an install without a compiler leaves)."""
    shutil.copytree(ROOT / "llmfw", tmp_path / "llmfw", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    # run from the copy's directory: ``python -m`` puts the working directory first on the path
    listing = subprocess.run([sys.executable, "-m", "llmfw.cli", "plugins"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=300)
    assert listing.returncode == 0, listing.stderr
    (line,) = [line for line in listing.stdout.splitlines() if line.strip().startswith("native ")]
    assert "not installed: its C extension is not built" in line
    probe = ("from llmfw.core.backend import create_backend\n"
             "from llmfw.core.errors import BackendUnavailable\n"
             "try:\n    create_backend('native')\nexcept BackendUnavailable as exc:\n    print('unavailable:', exc)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert "unavailable: native backend: its C extension is not built" in result.stdout, result.stderr

