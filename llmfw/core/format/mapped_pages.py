"""Resident pages of file mappings: a loader that has read a tensor through its mapping, or a cache that has copied
bytes out of one, drops those pages from the process's resident set, so that a load streaming through a file does
not end up counting the whole file in its RSS. The pages stay in the page cache: touching them again reads them
back from there, so dropping them changes what RSS counts, never what the arrays hold.

A mapping whose pages a kernel streams through at every token (a converted-weight cache's blob) asks for huge pages
instead (:func:`prefer_huge_pages`)."""
from __future__ import annotations

import mmap

import numpy as np


def mapping_of(array: np.ndarray) -> mmap.mmap | None:
    """The ``mmap.mmap`` whose memory ``array`` views (through ndarray bases and memoryviews), or None."""
    owner: object = array
    for _ in range(64):  # base chains are short; the bound only guards against a cycle
        if isinstance(owner, mmap.mmap):
            return owner
        if isinstance(owner, np.ndarray):
            owner = owner.base
        elif isinstance(owner, memoryview):
            owner = owner.obj
        else:
            return None
    return None


def drop_mapped_pages(array: np.ndarray) -> bool:
    """Drop the pages under ``array`` from RSS when it is a read-only view of a file mapping; True when it did.
    A writable array is left alone: its mapping may be private (copy-on-write), whose changed pages
    ``MADV_DONTNEED`` would discard."""
    mapping = mapping_of(array)
    if mapping is None or array.flags.writeable or not array.flags.c_contiguous or not array.nbytes or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    try:
        origin = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
    except (ValueError, TypeError):  # a closed or empty mapping
        return False
    start = int(array.ctypes.data) - origin
    if start < 0 or start + array.nbytes > len(mapping):
        return False
    first = start - start % mmap.PAGESIZE
    try:
        mapping.madvise(mmap.MADV_DONTNEED, first, start + array.nbytes - first)
    except (OSError, ValueError):
        return False
    return True


def prefer_huge_pages(array: np.ndarray) -> bool:
    """Ask the kernel to map the file mapping under ``array`` with huge pages (``MADV_HUGEPAGE``); True when it took
    the advice. Where the file system keeps the file in 2 MiB folios (a file system with large folios, as ext4 is on
    Linux 6.18, for a file written or read in whole 2 MiB pieces), the kernel then maps each with one TLB entry
    instead of 512, and a matmul streaming its weights through the mapping stops waiting on page walks every 4 KiB.
    Elsewhere the advice changes nothing, and a system without it (no ``MADV_HUGEPAGE``, or a kernel that refuses)
    loses nothing."""
    mapping = mapping_of(array)
    if mapping is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):  # THP compiled out, or a closed mapping
        return False
    return True
