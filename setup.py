"""Builds llmfw's two optional C extensions: the native backend (llmfw/plugins/backends/native/csrc) and the GGUF
reader's string loop (llmfw/core/format/_strings.c). Everything else is declared in pyproject.toml. A failed compile
(no C compiler, no Python headers) is a warning, not an error: the install still succeeds, the native backend reports
itself unavailable with the reason, and GGUF string arrays are read by the Python loop instead."""
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE_EXTENSION = "llmfw.plugins.backends.native._native"
STRINGS_EXTENSION = "llmfw.core.format._strings"
#: what a failed build of each extension means for the install
SKIPPED_WARNINGS = {
    NATIVE_EXTENSION: ("the llmfw native backend's C extension was not built",
                       "the 'native' backend reports itself unavailable"),
    STRINGS_EXTENSION: ("llmfw's C string reader for GGUF files was not built",
                        "vocabularies are read by a Python loop: slower loads"),
}
NATIVE_SOURCES = ["module.c", "pool.c", "ops.c", "attention.c", "kernels_scalar.c", "kernels_x86.c", "recurrent.c",
                  "moe.c"]


class OptionalBuildExt(build_ext):
    """build_ext that leaves a failed extension out instead of failing the install."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - distutils raises several unrelated types for a missing compiler
            self._skip(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._skip(exc, ext.name)

    @staticmethod
    def _skip(exc, name=None):
        """Warn about the extension ``name`` that failed (every one when the whole step failed)."""
        for extension, (what, instead) in SKIPPED_WARNINGS.items():
            if name in (None, extension):
                sys.stderr.write(f"WARNING: {what} ({exc}); llmfw works without it ({instead})\n")


def native_extension():
    # -ffp-contract=off: no fused multiply-add but the kernels' explicit ones, so every ISA path rounds like the scalar
    # one (csrc/native.h); -falign-loops=64: each loop starts a cache line, so how fast a kernel's inner loop runs
    # does not change with where the linker happens to put it (measured: batched Q4_K / Q6_K / Q5_0 tiles took
    # 10-20 % longer with GCC's default alignment)
    flags = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-falign-loops=64"]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        flags.append("-DLLMFW_NATIVE_SCALAR_ONLY")
    return Extension(NATIVE_EXTENSION,
                     sources=[f"llmfw/plugins/backends/native/csrc/{name}" for name in NATIVE_SOURCES],
                     depends=["llmfw/plugins/backends/native/csrc/native.h", "llmfw/plugins/backends/native/csrc/nat_exp.h",
                              "llmfw/plugins/backends/native/csrc/pool.h"],
                     extra_compile_args=flags, extra_link_args=["-pthread"],
                     libraries=[] if sys.platform == "win32" else ["m"], optional=True)


def strings_extension():
    return Extension(STRINGS_EXTENSION, sources=["llmfw/core/format/_strings.c"],
                     extra_compile_args=["-std=c11", "-O2", "-Wall"], optional=True)


setup(ext_modules=[native_extension(), strings_extension()], cmdclass={"build_ext": OptionalBuildExt})
