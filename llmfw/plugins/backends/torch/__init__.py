"""The torch backend: the graph IR executed with PyTorch on the CPU or on a CUDA device.

Weights are converted once, at load, into the fastest form for the device that still clears the reference bar
(``LLMFW_TORCH_MATMUL`` = fp16 | int8 | bf16 | f32 overrides it):

* CPU: fp16 matmul weights for fbgemm's fp16 linear (``quantized::linear_dynamic_fp16``: float32 activations
  and accumulation, weights widened inside the kernel). Per-row int8 for fbgemm's dynamic quantized linear
  (``quantized::linear_dynamic``) is faster but measured *outside* the bar on SmolLM2 (mean log-prob error
  0.45 / 0.74 on prompts 0 / 1 vs 0.25: per-row re-quantization of Q4_1 blocks plus one activation scale per
  token), so it is opt-in. Without fbgemm: float32 (bf16 matmuls have no fast path on AVX2 CPUs).
* CUDA: bf16 weights; activations are cast to bf16 for the matmul and back to float32 after it (unverified: no
  GPU was available when this was written).

Everything else (norms, rope, attention, activations) runs in float32. A split is compiled once per graph build
into straight-line Python source (one line per op, like ``torch.fx`` code generation), with these rewrites:
matmuls sharing their input (Q/K/V, gate/up) become one matmul on a fused weight built once and cached; a norm
followed by a multiplication with a weight becomes one ``rms_norm`` / ``layer_norm`` call; rope angles are
computed once per graph run and shared by every layer. The KV cache is a static preallocated tensor per layer,
written in place with ``index_copy_``. torch is imported only by this package, and only when the backend is used.

Modules: ``environment`` (importing torch, devices), ``weights`` (the weight forms), ``kernels`` (ops that are
more than one torch call), ``compiler`` (a split -> one function), ``runtime`` (the Backend class).
"""
from llmfw.plugins.backends.torch.runtime import TorchBackend

__all__ = ["TorchBackend"]
