"""Built-in architectures: one module per family, registered lazily by `general.architecture` name."""
from llmfw.core.plugins import hookimpl

ARCHITECTURES = {
    "llama": "llmfw.plugins.architectures.llama:LlamaArchitecture",
}


@hookimpl
def register_architectures(register):
    for name, ref in ARCHITECTURES.items():
        register(name, ref)
