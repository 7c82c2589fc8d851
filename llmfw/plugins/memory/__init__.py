"""Built-in memory modules: the unified KV cache and its interleaved sliding-window variant."""
from collections.abc import Callable

from llmfw.sdk import hookimpl

MEMORY = {
    "kv_cache": "llmfw.core.runtime.memory:KVCache",
    "kv_cache_iswa": "llmfw.core.runtime.memory:KVCacheISWA",
}


@hookimpl
def register_memory(register: Callable[[str, str], None]) -> None:
    for name, ref in MEMORY.items():
        register(name, ref)
