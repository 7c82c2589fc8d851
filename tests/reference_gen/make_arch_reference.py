"""Regenerate ``tests/data/arch/*.json``: llama.cpp's numbers for the random-weight architecture models.

    python3 -m venv /tmp/lcpp && /tmp/lcpp/bin/pip install llama-cpp-python==0.3.36   # ~10 min, builds llama.cpp
    python3 tests/reference_gen/make_arch_reference.py --llama-python /tmp/lcpp/bin/python [NAME ...]

The models are built here, with the project's interpreter and GGUF writer (the tests rebuild the same bytes and
check the sha256 stored in each JSON); llama.cpp then measures them in its own interpreter. llama-cpp-python is
only this measuring stick: nothing in llmfw or the tests imports it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from arch_files import DATA_DIR, build_model_file  # noqa: E402
from arch_specs import SPECS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"models to regenerate (default: all of {', '.join(SPECS)})")
    parser.add_argument("--llama-python", required=True, help="python of an environment with llama-cpp-python")
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="where the JSON files go")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(SPECS)}")
    with tempfile.TemporaryDirectory(prefix="llmfw-arch-") as tmp:
        paths = [str(build_model_file(name, tmp)) for name in (args.names or SPECS)]
        subprocess.run([args.llama_python, str(HERE / "measure_llamacpp.py"), str(args.out), *paths], check=True)


if __name__ == "__main__":
    main()
