"""Types of the optional C extension built from _strings.c (the fast path of a GGUF string array)."""
from typing import Any

def decode_strings(buf: Any, pos: int, available: int, out: list[str], index: int, max_len: int, /) \
        -> tuple[int, int]: ...
