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
    # mixture-of-experts families (issue 33)
    "qwen3moe": "llmfw.plugins.architectures.qwen3moe:Qwen3MoeArchitecture",
    "olmoe": "llmfw.plugins.architectures.olmoe:OlmoeArchitecture",
    "gpt-oss": "llmfw.plugins.architectures.gpt_oss:GptOssArchitecture",
    "glm4moe": "llmfw.plugins.architectures.glm4moe:Glm4MoeArchitecture",
    "deepseek2": "llmfw.plugins.architectures.deepseek2:Deepseek2Architecture",
    "smollm3": "llmfw.plugins.architectures.smollm3:SmolLM3Architecture",
    "granite": "llmfw.plugins.architectures.granite:GraniteArchitecture",
    "mistral3": "llmfw.plugins.architectures.mistral3:Mistral3Architecture",
    "lfm2": "llmfw.plugins.architectures.lfm2:LFM2Architecture",
    "granitehybrid": "llmfw.plugins.architectures.granitehybrid:GraniteHybridArchitecture",
    "qwen35": "llmfw.plugins.architectures.qwen35:Qwen35Architecture",
    "qwen35moe": "llmfw.plugins.architectures.qwen35moe:Qwen35MoeArchitecture",
    "nemotron_h": "llmfw.plugins.architectures.nemotron_h:NemotronHArchitecture",
    "gemma4": "llmfw.plugins.architectures.gemma4:Gemma4Architecture",
}


@hookimpl
def register_architectures(register: Callable[[str, str], None]) -> None:
    for name, ref in ARCHITECTURES.items():
        register(name, ref)
