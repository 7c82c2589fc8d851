"""Dropping a file mapping's pages from RSS (llmfw/core/format/mapped_pages.py): what a load does once a tensor is
converted, and what the converted-weight cache's spool does once a weight is stacked or stored. The pages leave the
resident set, the bytes stay what they were; memory the call could not drop safely is left alone. And asking for
huge pages on a mapping (what a converted-weight cache's blob gets): the kernel records the advice on that very
mapping, and memory that is not a file mapping is left alone."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from llmfw.core.format.mapped_pages import drop_mapped_pages, mapping_of, prefer_huge_pages

from support.mappings import huge_page_advice, vm_flags_of

pytestmark = pytest.mark.fast

SIZE = 32 << 20


def rss_file() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("RssFile:"))


@pytest.fixture
def mapped(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(np.arange(SIZE, dtype=np.uint8).tobytes())
    with path.open("rb") as fh:
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mapping, dtype=np.uint8)


def test_a_read_only_view_of_a_file_mapping_leaves_rss_and_keeps_its_bytes(mapped):
    part = mapped[4096 + 7: SIZE - 100]  # not page-aligned at either end
    checksum = int(part.sum(dtype=np.int64))  # every page touched
    before = rss_file()
    assert drop_mapped_pages(part)
    assert before - rss_file() >= SIZE - (1 << 20)
    assert int(part.sum(dtype=np.int64)) == checksum  # read back from the page cache


def test_memory_it_cannot_drop_safely_is_left_alone(mapped, tmp_path):
    anonymous = np.arange(1 << 20, dtype=np.uint8)
    assert mapping_of(anonymous) is None and not drop_mapped_pages(anonymous)
    assert np.array_equal(anonymous, np.arange(1 << 20, dtype=np.uint8))
    path = tmp_path / "private.bin"
    path.write_bytes(bytes(1 << 16))
    with path.open("r+b") as fh:
        private = np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY), dtype=np.uint8)
    private[:] = 5  # copy-on-write pages that MADV_DONTNEED would throw away
    assert not drop_mapped_pages(private) and int(private.min()) == 5
    assert not drop_mapped_pages(mapped[::2])  # strided: not one range of pages


@huge_page_advice
def test_a_file_mapping_is_advised_to_take_huge_pages_and_keeps_its_bytes(mapped):
    address = int(mapped.ctypes.data)
    assert "hg" not in vm_flags_of(address)
    assert prefer_huge_pages(mapped[100:200])  # any view of the mapping advises all of it
    assert "hg" in vm_flags_of(address) and "hg" in vm_flags_of(address + SIZE - 1)
    assert np.array_equal(mapped[:1 << 20], np.arange(1 << 20, dtype=np.uint8))


def test_memory_that_is_no_file_mapping_takes_no_huge_page_advice():
    # (the flags of the heap it lies in are not checked: other libraries of the process may advise the heap)
    assert not prefer_huge_pages(np.arange(1 << 20, dtype=np.uint8))
    assert not prefer_huge_pages(np.frombuffer(bytes(1 << 16), dtype=np.uint8))
