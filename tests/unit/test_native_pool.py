"""The native backend's thread pool (csrc/pool.c): whatever the thread count and the chunk count, each chunk of a
job runs exactly once, a job of more chunks than one pass holds included, and jobs follow each other without one
chunk leaking into the next."""
from __future__ import annotations

import ctypes
import threading

import pytest

from support.native import kernels_or_skip

kernels = kernels_or_skip()

CHUNK_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
#: chunks of one pass of the pool's claim words (pool.c's PASS_CHUNKS): a bigger job runs as several passes
PASS_CHUNKS = 65535


def _pool_for():
    """nat_pool_for through a handle of its own, so the typed library's functions keep their types."""
    function = ctypes.CDLL(kernels.load_library()._name).nat_pool_for
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, CHUNK_FN, ctypes.c_void_p]
    return function


def _run_job(pool_for, pool, n_chunks: int) -> tuple[list[int], set[int]]:
    """One job of n_chunks on the pool: how often each chunk ran, and which threads ran chunks."""
    counts = [0] * n_chunks
    threads_seen: set[int] = set()
    lock = threading.Lock()

    def run(_ctx, chunk, ith):
        with lock:
            counts[chunk] += 1
            threads_seen.add(ith)

    pool_for(pool.handle, n_chunks, CHUNK_FN(run), None)
    return counts, threads_seen


@pytest.mark.parametrize("n_threads", (1, 2, 3, 5))
def test_every_chunk_runs_once_on_any_thread_count(n_threads):
    pool_for = _pool_for()
    pool = kernels.ThreadPool(n_threads)
    try:
        for n_chunks in (1, 2, 3, 7, 16, 33, 100, PASS_CHUNKS + 10):
            counts, threads_seen = _run_job(pool_for, pool, n_chunks)
            assert counts == [1] * n_chunks, n_chunks
            assert threads_seen <= set(range(n_threads))
    finally:
        pool.close()
