#!/usr/bin/env bash
# llmfw's C code under AddressSanitizer + UndefinedBehaviorSanitizer: both extensions are built with both into a
# temporary folder; the native backend's kernel tests load that build (LLMFW_NATIVE_LIBRARY), and the GGUF string
# tests run against a copy of the package holding the sanitized string reader. Any invalid read or write, or
# undefined behaviour, aborts the run. Usage: bash benchmarks/native_sanitizers.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CC=${CC:-gcc}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CFLAGS="$SANITIZE" LDFLAGS="$SANITIZE" "$PY" setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/tmp"
SO=$(find "$OUT/lib" -name '_native*.so' | head -1)
STRINGS_SO=$(find "$OUT/lib" -name '_strings*.so' | head -1)
if [ -z "$SO" ] || [ -z "$STRINGS_SO" ]; then
    echo "the sanitized build failed (see above)" >&2
    exit 1
fi
if ! ldd "$SO" | grep libasan >/dev/null; then  # not grep -q: its early exit would fail the pipe (pipefail)
    echo "$SO is not linked with AddressSanitizer (CFLAGS/LDFLAGS ignored?)" >&2
    exit 1
fi
# the sanitizer runtimes must be loaded before the interpreter's own allocations; Python's arenas "leak" by design
PRELOAD="$("$CC" -print-file-name=libasan.so) $("$CC" -print-file-name=libubsan.so)"
LD_PRELOAD="$PRELOAD" ASAN_OPTIONS=detect_leaks=0 LLMFW_NATIVE_LIBRARY="$SO" \
    "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_native_kernels.py tests/unit/test_native_ops.py \
    tests/unit/test_native_repack_fuzz.py tests/unit/test_native_recurrent.py tests/unit/test_native_moe.py "$@"
# the string reader is imported as a module, so it runs from a package copy (pytest from the copy's folder: the
# working directory comes first on the path)
ROOT=$(pwd)
cp -r llmfw "$OUT/llmfw"
find "$OUT/llmfw" -name '*.so' -delete
cp "$STRINGS_SO" "$OUT/llmfw/core/format/"
cd "$OUT"
LD_PRELOAD="$PRELOAD" ASAN_OPTIONS=detect_leaks=0 \
    "$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/unit/test_gguf_strings.py" \
    "$ROOT/tests/reference/test_gguf_fuzz.py" "$@"
