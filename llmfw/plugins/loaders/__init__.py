"""Built-in model-file loaders (GGUF), by format name."""
from llmfw.sdk import hookimpl

LOADERS = {
    "gguf": "llmfw.core.runtime.loader:GGUFLoader",
}


@hookimpl
def register_loaders(register):
    for name, ref in LOADERS.items():
        register(name, ref)
