"""Built-in backends, registered lazily so that listing them never imports torch or onnxruntime."""
from collections.abc import Callable

from llmfw.sdk import hookimpl

BACKENDS = {
    "numpy": "llmfw.plugins.backends.numpy:NumpyBackend",
    "ggml": "llmfw.plugins.backends.ggml_cpu:GgmlBackend",
    "torch": "llmfw.plugins.backends.torch:TorchBackend",
    "onnx": "llmfw.plugins.backends.onnx:OnnxBackend",
    "native": "llmfw.plugins.backends.native:NativeBackend",
}


@hookimpl
def register_backends(register: Callable[[str, str], None]) -> None:
    for name, ref in BACKENDS.items():
        register(name, ref)
