"""Built-in architectures: one module per family, registered lazily by `general.architecture` name."""
from collections.abc import Callable

from llmfw.sdk import hookimpl

ARCHITECTURES = {
    "llama": "llmfw.plugins.architectures.llama:LlamaArchitecture",
    "gemma3": "llmfw.plugins.architectures.gemma3:Gemma3Architecture",
    "gemma2": "llmfw.plugins.architectures.gemma2:Gemma2Architecture",
    "qwen2": "llmfw.plugins.architectures.qwen2:Qwen2Architecture",
    "qwen3": "llmfw.plugins.architectures.qwen3:Qwen3Architecture",
    "phi3": "llmfw.plugins.architectures.phi3:Phi3Architecture",
}


@hookimpl
def register_architectures(register: Callable[[str, str], None]) -> None:
    for name, ref in ARCHITECTURES.items():
        register(name, ref)
