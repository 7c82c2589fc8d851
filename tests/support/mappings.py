"""What the kernel says of this process's mappings (/proc/self/smaps): the flags of the one holding an address."""
from __future__ import annotations

import mmap
from pathlib import Path

import pytest

#: MADV_HUGEPAGE is taken only by a kernel built with transparent huge pages
huge_page_advice = pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").is_dir() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="a kernel without transparent huge pages takes no such advice")


def vm_flags_of(address: int) -> list[str]:
    """The kernel's flags of the mapping holding ``address`` (smaps' VmFlags: ``hg`` is MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, stop = (int(part, 16) for part in head.split("-"))
                inside = start <= address < stop
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
