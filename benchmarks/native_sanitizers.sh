#!/usr/bin/env bash
# The native backend's kernel tests under AddressSanitizer + UndefinedBehaviorSanitizer: the extension is built
# with both into a temporary folder and the tests load that build (LLMFW_NATIVE_LIBRARY). Any invalid read or
# write, or undefined behaviour, aborts the run. Usage: bash benchmarks/native_sanitizers.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CC=${CC:-gcc}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
CFLAGS="$SANITIZE" LDFLAGS="$SANITIZE" "$PY" setup.py -q build_ext --build-lib "$OUT/lib" --build-temp "$OUT/tmp"
SO=$(find "$OUT/lib" -name '_native*.so' | head -1)
if [ -z "$SO" ]; then
    echo "the sanitized build failed (see above)" >&2
    exit 1
fi
if ! ldd "$SO" | grep libasan >/dev/null; then  # not grep -q: its early exit would fail the pipe (pipefail)
    echo "$SO is not linked with AddressSanitizer (CFLAGS/LDFLAGS ignored?)" >&2
    exit 1
fi
# the sanitizer runtimes must be loaded before the interpreter's own allocations; Python's arenas "leak" by design
LD_PRELOAD="$("$CC" -print-file-name=libasan.so) $("$CC" -print-file-name=libubsan.so)" \
ASAN_OPTIONS=detect_leaks=0 LLMFW_NATIVE_LIBRARY="$SO" \
    "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_native_kernels.py tests/unit/test_native_ops.py \
    tests/unit/test_native_repack_fuzz.py tests/unit/test_native_recurrent.py tests/unit/test_native_moe.py "$@"
