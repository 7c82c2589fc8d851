"""Built-in tokenizers, by `tokenizer.ggml.model` value."""
from collections.abc import Callable

from llmfw.sdk import hookimpl

TOKENIZERS = {
    "gpt2": "llmfw.plugins.tokenizers.bpe:BPETokenizer",
    "llama": "llmfw.plugins.tokenizers.spm:SPMTokenizer",
    "gemma4": "llmfw.plugins.tokenizers.bpe:Gemma4Tokenizer",
    "bert": "llmfw.plugins.tokenizers.wpm:WPMTokenizer",
    "t5": "llmfw.plugins.tokenizers.ugm:UGMTokenizer",
}


@hookimpl
def register_tokenizers(register: Callable[[str, str], None]) -> None:
    for name, ref in TOKENIZERS.items():
        register(name, ref)
