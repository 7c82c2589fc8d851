"""Built-in memory modules: the unified KV cache, its interleaved sliding-window variant, the recurrent state and
the hybrid of a KV cache and a recurrent state (issue 34)."""
from collections.abc import Callable

from llmfw.sdk import hookimpl

MEMORY = {
    "kv_cache": "llmfw.core.runtime.memory:KVCache",
    "kv_cache_iswa": "llmfw.core.runtime.memory:KVCacheISWA",
    "recurrent": "llmfw.core.runtime.recurrent:RecurrentMemory",
    "hybrid": "llmfw.core.runtime.recurrent:HybridMemory",
}


@hookimpl
def register_memory(register: Callable[[str, str], None]) -> None:
    for name, ref in MEMORY.items():
        register(name, ref)
