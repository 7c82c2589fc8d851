"""The ONNX Runtime backend: each graph split becomes one ONNX model run by an InferenceSession.

Split by job: ``weights`` (GGUF tensors repacked for MatMulNBits), ``translate`` (graph IR → ONNX nodes, with
``emit``'s building blocks), ``runtime`` (sessions, OrtValues, IOBinding, the Backend class) and ``ort`` (the lazy
imports of ``onnxruntime`` / ``onnx``, which only this package imports, only when the backend is used).
"""
from llmfw.plugins.backends.onnx.runtime import OnnxBackend

__all__ = ["OnnxBackend"]
