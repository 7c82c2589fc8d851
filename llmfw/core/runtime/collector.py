"""The cyclic garbage collector paused while llmfw builds many long-lived objects at once (a model's vocabulary,
merges and weight tables; a graph and its compiled program). Such a build allocates hundreds of thousands of
tracked containers and frees almost none: each collection the allocations trigger walks the young objects only to
keep them, and the older generations' passes walk everything built so far: a large share of a model's load
(docs/benchmarks.md has the measurement). Reference counting still frees what the build drops; cycles made meanwhile
wait for the next collection after it."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block; it runs again after it only if it was running before (a caller
    that switched it off keeps it off). Process-wide, as the collector is: another thread allocating meanwhile is
    not collected either, which delays its cycles' freeing, never loses them."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
