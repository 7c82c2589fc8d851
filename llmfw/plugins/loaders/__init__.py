"""Built-in model-file loaders (GGUF), by format name."""
from collections.abc import Callable

from llmfw.sdk import hookimpl

LOADERS = {
    "gguf": "llmfw.core.runtime.loader:GGUFLoader",
}


@hookimpl
def register_loaders(register: Callable[[str, str], None]) -> None:
    for name, ref in LOADERS.items():
        register(name, ref)
