"""The thread count of numpy's BLAS (OpenBLAS or MKL), set through the loaded library's own function."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

_BLAS_SET_THREADS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads", "MKL_Set_Num_Threads")


@functools.lru_cache(maxsize=1)  # the loaded library does not change: look it up once per process
def _find_blas_setter() -> Any:
    """The loaded BLAS library's set-num-threads function (OpenBLAS / MKL), found in /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "blas" in line.lower() or "mkl" in line.lower()}
    except OSError:
        return None
    for path in sorted(paths):
        if not path.startswith("/"):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in _BLAS_SET_THREADS:
            fn = getattr(lib, symbol, None)
            if fn is not None:
                return fn
    return None


def set_blas_threads(n_threads: int) -> bool:
    """Limit numpy's BLAS to ``n_threads`` (process-wide). On an oversubscribed CPU, BLAS threads that spin
    while waiting for each other make small matmuls many times slower; one thread per context avoids that."""
    setter = _find_blas_setter()
    if setter is None:
        return False
    setter(ctypes.c_int(int(n_threads)))
    return True
