"""The pair-merge loop BPE and SPM share: merge the cheapest adjacent pair of symbols (leftmost on ties) until no
pair has a cost. BPE's cost is a merge's rank (keyed by the pair), SPM's the negated score of the joined text.

Short words rescan a list of costs with ``min`` / ``index`` (C loops beat a heap there); long ones (runs of
spaces, long numbers) use llama.cpp's linked list and priority queue.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Mapping
from itertools import repeat
from operator import add
from typing import Any, Union

#: up to this many symbols a C-level rescan per merge beats a heap
SMALL_WORD = 256
Cost = Union[int, float]


def _pair(left: str, right: str) -> tuple[str, str]:
    return left, right


class PairCosts:
    """The cost of merging two adjacent symbols: ``table[a + b]`` (``joined``) or ``table[(a, b)]``."""

    def __init__(self, table: Mapping[Any, Cost], joined: bool, none: Cost):
        self.get = table.get
        self.joined = joined
        #: the cost of a pair that does not merge, above every real one
        self.none = none
        #: the table's key of a pair (a plain function, called once per merge: ``add`` runs in C)
        self.key: Callable[[str, str], Hashable] = add if joined else _pair

    def keys(self, symbols: list[str]) -> Iterable[Hashable]:
        return map(add, symbols[:-1], symbols[1:]) if self.joined else zip(symbols, symbols[1:])


def merge_pairs(text: str, costs: PairCosts) -> list[str]:
    """The symbols ``text``'s characters merge into."""
    return merge_small(text, costs) if len(text) <= SMALL_WORD else merge_large(text, costs)


def merge_small(text: str, costs: PairCosts) -> list[str]:
    """Rescans the pair costs after each merge; ``min`` / ``index`` run in C. The key of a new pair is built inline
    (no call per merge: this loop is most of a tokenizer's time)."""
    symbols = list(text)
    get, joined, none = costs.get, costs.joined, costs.none
    pair_costs = list(map(get, costs.keys(symbols), repeat(none)))  # loops in C
    while pair_costs:
        best = min(pair_costs)
        if best == none:
            break
        at = pair_costs.index(best)
        symbols[at:at + 2] = [symbols[at] + symbols[at + 1]]
        del pair_costs[at]
        if at > 0:
            left, right = symbols[at - 1], symbols[at]
            pair_costs[at - 1] = get(left + right if joined else (left, right), none)
        if at < len(pair_costs):
            left, right = symbols[at], symbols[at + 1]
            pair_costs[at] = get(left + right if joined else (left, right), none)
    return symbols


def merge_large(text: str, costs: PairCosts) -> list[str]:
    """llama.cpp's linked list + priority queue."""
    symbols = list(text)
    n = len(symbols)
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    get, key = costs.get, costs.key
    heap: list[tuple[Cost, int, int, int]] = []  # (cost, left, right, merged length): cheapest, then leftmost

    def push(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            cost = get(key(symbols[left], symbols[right]))
            if cost is not None:
                heapq.heappush(heap, (cost, left, right, len(symbols[left]) + len(symbols[right])))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
            continue  # stale: a side grew or was merged away since the pair was queued (symbols only grow)
        symbols[left], symbols[right] = symbols[left] + symbols[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    return [s for s in symbols if s]

